"""Model adapters: one file per architecture, each patching a model *instance* (never a class).

`apply(model, config)` picks the adapter from the model's class; `remove(model)` undoes it.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..config import HAPConfig
from . import llava

ADAPTERS = {"LlavaForConditionalGeneration": llava}


def adapter_for(model):
    name = type(model).__name__
    if name not in ADAPTERS:
        raise ValueError(f"HAP has no adapter for {name}; supported: {', '.join(ADAPTERS)}")
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
