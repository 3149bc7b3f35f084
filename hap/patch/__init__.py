"""Model adapters: one file per architecture, each patching a model *instance* (never a class).

`apply(model, config)` picks the adapter from the model's class; `remove(model)` undoes it.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..config import HAPConfig
from . import llava, qwen2_vl

ADAPTERS = {
    "LlavaForConditionalGeneration": llava,
    "Qwen2VLForConditionalGeneration": qwen2_vl,
    "Qwen2_5_VLForConditionalGeneration": qwen2_vl,
}


def adapter_for(model):
    name = type(model).__name__
    if name not in ADAPTERS:
        raise ValueError(
            f"HAP has no adapter for {name} (LLaVA-NeXT's any-resolution tiling among others); "
            f"supported: {', '.join(ADAPTERS)}"
        )
    return ADAPTERS[name]


def apply(model, config: HAPConfig, trace: bool = False):
    """Patch `model` in place; a plain `model.generate(**inputs)` then prunes. Returns the patch state."""
    return adapter_for(model).apply_patch(model, config, trace=trace)


def remove(model) -> None:
    """Undo `apply`; the model behaves exactly as the stock one again."""
    adapter_for(model).remove_patch(model)


@contextmanager
def patched(model, config: HAPConfig, trace: bool = False):
    """`with hap.patched(model, config) as p:` patches for the block and always unpatches."""
    state = apply(model, config, trace=trace)
    try:
        yield state
    finally:
        remove(model)
