"""HiPrune's selection rule (anchors, buffers, registers; official Danielement321/HiPrune, the LLaVA
`LLaVA/llava/model/llava_arch.py` `encode_images`), docs/method.md §7.

Before the decoder, once per image (LLaVA-NeXT: once per crop, K // crops each, as the official code divides its
budget by the crops the tower encodes), from two layers of the vision tower:
- "global" attention of a layer: its attention map averaged over heads, then over **every** query row ([CLS]
  included), at the patch columns;
- anchors: the T = round(K x 0.1 / 5) patches of highest global attention in the object layer, the 9th of 24
  (`attentions[8]`; the same relative depth, max(1, round(9 / 24 x L)) - 1, on an L-layer tower);
- buffers: each anchor's neighbours at +-1 and +- one grid row (the official +-24 on CLIP-336), clamped to the patch
  range and de-duplicated (+-1 wraps across row ends, as the official index arithmetic does);
- registers: the K - |anchors and buffers| patches of highest global attention in the feature layer (the official
  `attentions[mm_vision_select_layer]`, layer -2 on LLaVA) after 1 is subtracted at the anchors and buffers.
Kept: exactly K patches, raster order, [CLS] dropped. Ties (left to `topk` officially) go to the lowest index; the
official maps are fp16, here float32.

The pruner (`HiPrune`) reads both full maps through the generic tower capture (`Pruner.tower`).
"""

from __future__ import annotations

import math

import torch

from .base import BeforeDecoder, Selection
from .cues import TowerRead
from .vispruner import per_crop

ANCHOR_SHARE = 0.1  # the official HIPRUNE_ALPHA
OBJECT = TowerRead(9 / 24, attention="map")  # the official HIPRUNE_OBJECT_LAYER=9 of CLIP-L's 24 layers
DEEP = TowerRead(None, attention="map")  # the feature layer: mm_vision_select_layer


def global_attention(maps: torch.Tensor) -> torch.Tensor:
    """maps [B, H, 1 + N, 1 + N] ([CLS] first) -> [B, N]: the mean over heads, then over every query row, of each
    patch column."""
    return maps.float().mean(1).mean(1)[:, 1:]


def anchor_count(k: int, share: float = ANCHOR_SHARE) -> int:
    """T = round(k x share / 5) (Python's round: half to even): 1 / 3 / 4 anchors for k = 64 / 128 / 192."""
    return round(k * share / 5)


def top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` highest of `scores` [N], ties to the lowest index -> long [k]."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def hierarchical_select(shallow: torch.Tensor, deep: torch.Tensor, k: int, side: int) -> torch.Tensor:
    """HiPrune's `k` picks of one image (or crop): shallow, deep [N] (the object layer's and the feature layer's global
    attention), `side` the grid's row length -> long [k], ascending."""
    n = shallow.shape[0]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie in 0..{n} (the image's patches)")
    anchors = top(shallow.float(), anchor_count(k))
    near = torch.cat([anchors, anchors - 1, anchors + 1, anchors - side, anchors + side]).clamp(0, n - 1).unique()
    near = near[:k]  # never more than the budget (5T <= K for every K the official rounding gives)
    taken = torch.zeros(n, device=deep.device)
    taken[near] = 1
    registers = top(deep.float() - taken, k - near.numel())
    return torch.cat([near, registers]).sort().values


class HiPrune(BeforeDecoder):
    """One selection before the first decoder layer from two full attention maps of the tower; on LLaVA-NeXT one per
    crop (`per_crop`)."""

    name = "hiprune"
    tower = (OBJECT, DEEP)
    crops = True

    def select(self, state, cut):
        cues, k = state.cues(), state.kept_count(cut.index)
        shallow = global_attention(cues.layers[OBJECT.layer].attention)  # [B, N] (or crops)
        deep = global_attention(cues.layers[DEEP.layer].attention)
        side = math.isqrt(shallow.shape[1])
        if cues.places is not None:
            chosen = per_crop(cues.places, k, lambda crops, t: torch.stack(
                [hierarchical_select(s, d, t, side) for s, d in zip(shallow[crops], deep[crops])]))
        else:
            chosen = torch.stack([hierarchical_select(s, d, k, side) for s, d in zip(shallow, deep)])
        return Selection(chosen.to(state.visual_pos.device))


PRUNER = HiPrune
