"""One vision pass per image: the image features of a processed image, computed once and reused (docs/method.md §9).

Every run of one request gives the model the same pixels: the unpruned and pruned answers, the traced run, the
causal and utility passes, a sweep's methods x budgets. The vision tower and projector are a large share of a
small model's prefill (4.4 of 10.3 s for a 0.5B LLaVA at 729 visual tokens on a CPU), so `reusing_features(model,
cache)` memoises the model's `get_image_features` for a block: the first run of an image computes its features,
the later ones read them. `FeatureCache` keys each entry by everything the features depend on (the pixel tensor's
bytes, shape, dtype and device, and every other argument, e.g. Qwen2-VL's `image_grid_thw`) and by the model
instance and the processor options in effect (`hap.patch.processors.processor_options`: LLaVA-NeXT's pinpoints
change how the model packs the same pixels), so one cache never hands one image's, model's, dtype's or tiling's
features to another; it keeps the `size` most recently used entries.

A run whose method reads the vision tower itself (VisionZip, AutoPrune's [CLS] prior, HAP's first_cut="vision", any
`Pruner.tower` read of other tower layers: the patch captures them while the tower runs) always runs the tower
(`needs_tower`).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps

import torch

from ..pruners import pruner_for

FEATURES = "get_image_features"  # the multimodal model's method that runs the vision tower and the projector


@dataclass
class FeatureCache:
    """The image features of the last `size` images (LRU), how often they were found, and what computing them took."""

    size: int = 4
    entries: OrderedDict = field(default_factory=OrderedDict)
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0  # spent computing entries
    last_seconds: float = 0.0  # what computing the entry asked for last took (when it was computed)
    took: dict = field(default_factory=dict)  # key -> the seconds its entry took to compute

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size={self.size!r} must be an integer >= 1 (images kept)")

    def get(self, key: tuple, compute: Callable[[], object]) -> object:
        """The entry of `key`, computed (and the oldest entry dropped beyond `size`) when absent; a copy either way,
        so a caller may change what it is given."""
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
        else:
            self.misses += 1
            t0 = time.perf_counter()
            self.entries[key] = detached(compute())
            self.took[key] = time.perf_counter() - t0
            self.seconds += self.took[key]
            while len(self.entries) > self.size:
                self.took.pop(self.entries.popitem(last=False)[0])
        self.last_seconds = self.took[key]
        return detached(self.entries[key])


def detached(value):
    """`value` with every tensor replaced by a detached copy (lists, tuples, dicts and transformers' ModelOutput
    walked through); a copy made outside inference mode is an ordinary tensor, usable with autograd."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):  # ModelOutput is an OrderedDict: rebuilt as its own type
        return type(value)(**{k: detached(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(detached(v) for v in value)
    return value


def fingerprint(value) -> tuple:
    """A hashable key of an argument: a tensor by its bytes' SHA-256, shape, dtype and device; containers walked."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().cpu()
        digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return ("tensor", digest, tuple(value.shape), str(value.dtype), str(value.device))
    if isinstance(value, dict):
        return ("dict", tuple((k, fingerprint(v)) for k, v in sorted(value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(fingerprint(v) for v in value))
    return ("value", repr(value))


def explicit(config, kwargs: dict) -> dict:
    """The keyword arguments that choose something: without those left at their default (None, return_dict=True,
    or a value equal to the model config's entry of that name, which None stands for) and the decoder's `use_cache`
    (passed down with the forward's other keywords; the tower has no cache), so that `generate`'s call (pixels only)
    and the forward's (pixels and the config's feature layer spelled out) share a key."""
    def default(name: str, value) -> bool:
        if value is None or name == "use_cache" or (name == "return_dict" and value is True):
            return True
        return not isinstance(value, torch.Tensor) and getattr(config, name, default) == value

    return {k: v for k, v in kwargs.items() if not default(k, v)}


def needs_tower(model) -> bool:
    """Whether the model's current HAP patch reads the vision tower while it runs (its [CLS] cues)."""
    patch = getattr(model, "_hap", None)
    return patch is not None and pruner_for(patch.config).needs_cls


@contextmanager
def reusing_features(model, cache: FeatureCache | None) -> Iterator[FeatureCache | None]:
    """Inside the block, `model`'s image features come from `cache` (None: computed every time, as without the
    block). The model is stock again after the block, even on error; blocks on one model do not nest."""
    if cache is None:
        yield None
        return
    owner = model.model
    if FEATURES in vars(owner):
        raise RuntimeError("reusing_features blocks on one model do not nest")
    compute = getattr(owner, FEATURES)

    @wraps(compute)  # its signature: `generate` reads it to pass the pixels in
    def features(*args, **kwargs):
        if needs_tower(model):
            return compute(*args, **kwargs)
        key = (id(model), model.config._name_or_path, str(model.dtype), fingerprint(args),
               fingerprint(explicit(model.config, kwargs)), getattr(model, "_hap_options", None))
        return cache.get(key, lambda: compute(*args, **kwargs))

    setattr(owner, FEATURES, features)
    try:
        yield cache
    finally:
        delattr(owner, FEATURES)
