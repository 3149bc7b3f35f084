"""What the vision side hands a pruner: the vision tower's cues of one prefill, captured by the adapters (`hap.patch`)
for a pruner that asks for them (`Pruner.cls_cues`, `Pruner.clip`), read through `State.cues()`. Architecture-free and
method-free: an adapter fills them in, the executor carries them, each rule reads the fields it names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class VisionCues:
    """What the tower's feature layer gives one prefill."""

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
