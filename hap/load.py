"""`hap.load_model`: a hub id or a local folder through transformers' `from_pretrained`.

Safetensors weights only, never remote code; the model runs on SDPA attention (HAP recomputes the
few attention rows it needs, so nothing forces eager attention).
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


def load_processor(name_or_path: str, arch: str):
    """The model's processor through `AutoProcessor`; where that cannot build it (a processor that needs a video
    processor, hence torchvision, or its saved config) or returns a bare tokenizer, the image-only processor of the architecture
    (`hap.patch.processors`) from the same files. ValueError when neither exists."""
    from transformers import AutoProcessor
    from transformers.processing_utils import ProcessorMixin

    from .patch.processors import IMAGE_ONLY

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=False)
    except (ImportError, AttributeError, ValueError, OSError) as err:
        processor, why = None, f"{type(err).__name__}: {str(err).splitlines()[0]}"
    else:
        why = f"AutoProcessor gave a {type(processor).__name__}, not a processor"
    if isinstance(processor, ProcessorMixin):
        return processor
    if arch not in IMAGE_ONLY:
        raise ValueError(f"cannot build the processor of this {arch} ({why})")
    return IMAGE_ONLY[arch].from_pretrained(name_or_path, trust_remote_code=False)


def load_model(name_or_path: str, device: str = "auto", dtype: torch.dtype | str | None = None, device_map=None):
    """Load `(model, processor)`; dtype None = bfloat16 on a GPU, float32 on the CPU.

    `device_map` ("auto", "balanced", {module name: device}, ...) goes to `from_pretrained`, which spreads
    the model over devices with accelerate's hooks, and replaces the move to `device`; `device="auto"`
    with more than one visible GPU means `device_map="auto"`.
    """
    from transformers import AutoModelForImageTextToText

    from .patch import ADAPTERS

    target = resolve_device(device)
    if device_map is None and device == "auto" and torch.cuda.device_count() > 1:
        device_map = "auto"
    if dtype is None:
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16', 'float16')")
        dtype = getattr(torch, dtype)
    local = Path(name_or_path).expanduser()
    where = f"local folder {local}" if local.is_dir() else f"hub id {name_or_path!r}"
    config = load_config(name_or_path, where)
    arch = (config.architectures or [type(config).__name__])[0]
    if arch not in ADAPTERS:
        raise ModelLoadError(f"{where} is a {arch}; HAP supports {', '.join(ADAPTERS)}")
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            name_or_path, dtype=dtype, use_safetensors=True, trust_remote_code=False, attn_implementation="sdpa",
            **({} if device_map is None else {"device_map": device_map}),
        )
        processor = load_processor(name_or_path, arch)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load {where}: {str(err).splitlines()[0]}") from err
    return (model if device_map is not None else model.to(target)).eval(), processor


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
    """`(model, tokenizer)` of a CLIP checkpoint (hub id or local folder) for CDPruner's relevance: the
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
