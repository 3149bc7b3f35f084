"""What the vision side hands a pruner: the vision tower's cues of one prefill, captured by the adapters (`hap.patch`)
for a pruner that asks for them (`Pruner.cls_cues`, `Pruner.clip`, `Pruner.tower`), read through `State.cues()`.
Architecture-free and method-free: an adapter fills them in, the executor carries them, each rule reads the fields it
names.

`TowerRead` is how a pruner names the tower layers it reads beyond the feature layer (their attention, the [CLS] row
or the full map, and their output hidden states); the adapter captures each once per image while the tower runs,
the attention recomputed from the layer's own q and k projections (the tower keeps SDPA), into `VisionCues.layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

ATTENTION = ("", "cls", "map")  # what a `TowerRead` takes of a layer's attention: none, the [CLS] row, every row


@dataclass(frozen=True)
class TowerRead:
    """One vision-tower layer a pruner reads (`Pruner.tower`), keyed in `VisionCues.layers` by `layer`.

    layer: None is the model's feature layer (the layer whose output the projector maps: `hidden_states[-2]` on
    LLaVA-1.5, whose `attentions[-2]` is computed inside it); an int the index of HF's `attentions[layer]` (negative
    from the end); a float in (0, 1) a relative depth, the layer max(1, round(depth x L)) - 1 of an L-layer tower
    (HiPrune's 9th of 24 is 9 / 24 on every tower). attention: "" (none), "cls" (the [CLS] query row per head,
    [B, H, T]) or "map" (every query row per head, [B, H, T, T]); hidden: the layer's output [B, T, Dv]. T counts the
    [CLS] token first: a read needs a tower with one (refused on SigLIP)."""

    layer: int | float | None
    attention: str = ""
    hidden: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} must be one of {ATTENTION}")
        if isinstance(self.layer, float) and not 0.0 < self.layer < 1.0:
            raise ValueError(f"a relative depth must lie in (0, 1); got {self.layer}")

    def index(self, layers: int, feature: int) -> int:
        """The layer's index (0..layers-1) in a tower of `layers` layers whose feature layer is `feature`; ValueError
        past its end."""
        if self.layer is None:
            i = feature
        elif isinstance(self.layer, float):
            i = max(1, round(self.layer * layers)) - 1
        else:
            i = self.layer + layers if self.layer < 0 else self.layer
        if not 0 <= i < layers:
            raise ValueError(f"vision-tower layer {self.layer!r} is not one of a tower of {layers} layers")
        return i


@dataclass
class TowerLayer:
    """What one tower layer gave a `TowerRead`, over the B images the tower ran (LLaVA-NeXT: the crops), [CLS] first:
    attention [B, H, T] (the [CLS] row) or [B, H, T, T] (every row), float32 softmax(q k^T x scale) per head, or None;
    hidden [B, T, Dv] the layer's output, or None."""

    attention: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def to(self, device) -> TowerLayer:
        return TowerLayer(*(None if t is None else t.to(device) for t in (self.attention, self.hidden)))


@dataclass
class VisionCues:
    """What the tower's feature layer gives one prefill, and the other layers its pruner reads (`layers`)."""

    cls_attention: torch.Tensor  # [batch, N] the [CLS] row's attention over the patches, summed over heads
    keys: torch.Tensor  # [batch, N, d] the patches' keys averaged over heads
    features: torch.Tensor  # [batch, 1 + N, Dv] the layer's output, [CLS] first
    project: Callable[[torch.Tensor], torch.Tensor]  # tower features [batch, n, Dv] -> decoder embeddings [batch, n, D]
    heads: int  # the feature layer's attention heads (cls_attention / heads is their mean: AutoPrune's prior)
    image_embeds: torch.Tensor | None = None  # [batch, N, E] the patches' CLIP image embeddings (CDPruner), or None
    # LLaVA-NeXT's crops (base view, then each tile): the tensors above are over every crop of the batch's images
    # ([crops, n] ...), and `places` gives per sample long [its crops, n] the visual index of each crop's patch (-1: cut
    # by the unpadding, not in the sequence); None: one image per sample, its patches the visual tokens in order
    places: list[torch.Tensor] | None = None
    layers: dict[int | float, TowerLayer] = field(default_factory=dict)  # `TowerRead.layer` -> what that layer gave

    def to(self, device) -> VisionCues:
        """The cues with every tensor on `device`."""
        moved = {name: None if t is None else t.to(device) for name, t in (
            ("cls_attention", self.cls_attention), ("keys", self.keys), ("features", self.features),
            ("image_embeds", self.image_embeds))}
        return replace(self, **moved, places=None if self.places is None else [p.to(device) for p in self.places],
                       layers={k: v.to(device) for k, v in self.layers.items()})
