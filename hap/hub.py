"""Loading from the hub or a local folder, below the adapters: the error every loader raises, the device choice, a
checkpoint's config, and CLIP for a pruner that reads it (`Pruner.clip`, loaded by the adapters). Safetensors only,
never remote code. `hap.load` builds on these to load a whole model with its adapter.
"""

from __future__ import annotations

from pathlib import Path

import torch


class ModelLoadError(OSError):
    """The model could not be loaded (unknown id, hub unreachable, missing files, unsupported class)."""


def resolve_device(device: str = "auto") -> torch.device:
    """The torch device `device` names ("auto": the GPU when there is one); ValueError on a name torch does not
    know, and on a GPU this machine lacks (saying which devices it has)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device={device!r} is not a torch device (use 'auto', 'cpu', 'cuda', 'cuda:1', ...)") from err
    if target.type == "cuda" and (target.index or 0) >= torch.cuda.device_count():
        have = f"cuda:0..cuda:{torch.cuda.device_count() - 1}" if torch.cuda.is_available() else "no CUDA GPU"
        raise ValueError(f"device={device!r}: this machine has {have}; use 'cpu' or 'auto'")
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}: this machine has no MPS device; use 'cpu' or 'auto'")
    return target


def load_config(name_or_path: str, where: str):
    """The checkpoint's config through `AutoConfig` (no remote code); ModelLoadError naming `where` when it is
    neither a local model folder nor a reachable hub id."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load {where}: it is not a local model folder and the hub copy is unknown or unreachable "
            f"(offline?). Details: {str(err).splitlines()[0]}"
        ) from err


def load_clip(clip_model: str, device=None, dtype=None):
    """`(model, tokenizer)` of a CLIP checkpoint (hub id or local folder) for a pruner that reads CLIP (`Pruner.clip`: CDPruner's relevance): the
    `CLIPModel` (text tower, text projection, visual projection) and its tokenizer. device None: "auto" (as
    `load_model`); dtype None: float32. Safetensors only, never remote code. ModelLoadError when the folder is
    missing, the hub copy unknown or unreachable, or the checkpoint is not a CLIP model with its text tower."""
    from transformers import AutoTokenizer, CLIPModel

    local = Path(clip_model).expanduser()
    if local.is_absolute() or clip_model.startswith((".", "~")) or clip_model.count("/") > 1:
        if not local.is_dir():
            raise ModelLoadError(f"clip_model={clip_model!r}: no such folder ({local})")
    where = f"clip_model={clip_model!r} ({'local folder' if local.is_dir() else 'hub id'})"
    config = load_config(clip_model, where)
    if config.model_type != "clip":
        raise ModelLoadError(f"{where} is a {config.model_type}, not a CLIP model with its text tower "
                             "(a CLIPModel checkpoint such as openai/clip-vit-large-patch14-336)")
    try:
        model = CLIPModel.from_pretrained(clip_model, dtype=dtype or torch.float32, use_safetensors=True,
                                          trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(clip_model, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load {where}: {str(err).splitlines()[0]}") from err
    return model.to(resolve_device(device or "auto")).eval(), tokenizer
