"""`hap.load_model`: a hub id or a local folder through transformers' `from_pretrained`, for the architectures an
adapter supports (`hap.patch.ADAPTERS`).

Safetensors weights only, never remote code; the model runs on SDPA attention (HAP recomputes the
few attention rows it needs, so nothing forces eager attention).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .hub import ModelLoadError, load_config, resolve_device


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
