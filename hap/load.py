"""`hap.load_model`: a hub id or a local folder through transformers' `from_pretrained`.

Safetensors weights only, never remote code; the model runs on SDPA attention (HAP recomputes the
few attention rows it needs, so nothing forces eager attention).
"""

from __future__ import annotations

from functools import cache
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


def load_model(name_or_path: str, device: str = "auto", dtype: torch.dtype | str | None = None, device_map=None):
    """Load `(model, processor)`; dtype None = bfloat16 on a GPU, float32 on the CPU.

    `device_map` ("auto", "balanced", {module name: device}, ...) goes to `from_pretrained`, which spreads
    the model over devices with accelerate's hooks, and replaces the move to `device`; `device="auto"`
    with more than one visible GPU means `device_map="auto"`.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

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
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load {where}: it is not a local model folder and the hub copy is unknown or unreachable "
            f"(offline?). Details: {str(err).splitlines()[0]}"
        ) from err
    arch = (config.architectures or [type(config).__name__])[0]
    if arch not in ADAPTERS:
        raise ModelLoadError(f"{where} is a {arch}; HAP supports {', '.join(ADAPTERS)}")
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            name_or_path, dtype=dtype, use_safetensors=True, trust_remote_code=False, attn_implementation="sdpa",
            **({} if device_map is None else {"device_map": device_map}),
        )
        processor = load_processor(name_or_path, config)
    except (OSError, ValueError, ImportError) as err:
        raise ModelLoadError(f"cannot load {where}: {str(err).splitlines()[0]}") from err
    return (model if device_map is not None else model.to(target)).eval(), processor


def load_processor(name_or_path: str, config):
    """The model's processor (`AutoProcessor`); for Qwen2-VL / Qwen2.5-VL without torchvision (their video processor
    needs it; the project does not), the same processor for images and text only (`image_only`)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or config.model_type not in IMAGE_ONLY:
        return AutoProcessor.from_pretrained(name_or_path, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    return image_only(config.model_type)(AutoImageProcessor.from_pretrained(name_or_path, trust_remote_code=False),
                                         tokenizer, getattr(tokenizer, "chat_template", None))


IMAGE_ONLY = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}  # model_type -> processor class


@cache
def image_only(model_type: str) -> type:
    """The processor class of `model_type` (IMAGE_ONLY) for images and text only: built from an image processor and
    a tokenizer carrying Qwen's vision tokens, no video processor. It keeps the stock class's name, so a processor it
    saves is the stock one's folder (loaded by the stock class where torchvision is installed)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    stock = getattr(transformers, IMAGE_ONLY[model_type])

    def __init__(self, image_processor, tokenizer, chat_template=None):
        self.image_token, self.video_token = QWEN_VISION_TOKENS[1], QWEN_VISION_TOKENS[3]
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(stock.__name__, (stock,), {"__init__": __init__, "__doc__": image_only.__doc__})


QWEN_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
