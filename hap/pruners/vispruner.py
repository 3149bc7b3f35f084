"""VisPruner's selection rule (ICCV 2025; official Theia-4869/VisPruner, `llava_arch.py` `encode_images`),
docs/method.md §7.

Before the decoder, once per image (LLaVA-NeXT: once per crop), from vision-side signals only:
- important tokens: the int(k * important_ratio) patches the [CLS] row of the feature layer's attention (averaged
  over heads) attends to most;
- diverse tokens: the other patches, in descending importance, form the residual list; while it holds R > k_div
  items, r = min(8, R - k_div) near-duplicates leave it: A = the items at even positions, B = those at odd
  positions; each A item scores its largest cosine similarity to any B item (on the L2-normalised feature-layer
  patch features); the r highest-scoring A items are dropped; the new list is the surviving A items in
  descending score order, then B in its order.
Kept: the important tokens and the final residual list, returned in raster order.

Two cases the official code never meets in its settings, handled by its evident intent:
- an odd R gives A one item more than B; the official indexing then fails on a shape mismatch; here every
  surviving A item is kept (the list shrinks by exactly r);
- r larger than A (only for tiny k_div): all of A is dropped (the list shrinks by |A|) and the loop goes on.
Ties (left to `argsort` officially) go to the lowest position: the most attended patches lowest index first, the
highest-scoring A items earliest in A first.

The pruner (`VisPruner`) runs the rule on the shared executor, on the vision tower's cues (`VisionCues`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import BeforeDecoder, Selection

IMPORTANT_RATIO = 0.5  # the official default: 64 = 32 important + 32 diverse
STEP = 8  # at most this many duplicates leave the residual list per round


def split(k: int, important_ratio: float = IMPORTANT_RATIO) -> tuple[int, int]:
    """(important, diverse) counts of a budget of `k` tokens: int(k * ratio) and the rest."""
    if not 0.0 <= important_ratio <= 1.0:
        raise ValueError(f"important_ratio={important_ratio} must lie in [0, 1]")
    important = int(k * important_ratio)
    return important, k - important


def remove_duplicates(unit: torch.Tensor, residual: torch.Tensor, k: int) -> torch.Tensor:
    """Shrink the residual list `residual` long [R] (patch indices in order) to `k` items by the iterative
    even/odd matching on `unit [N, Dv]` (L2-normalised features) -> long [k], in list order."""
    while residual.numel() > k:
        r = min(STEP, residual.numel() - k)
        a, b = residual[::2], residual[1::2]
        scores = (unit[a] @ unit[b].T).max(dim=-1).values  # [|A|]
        survivors = torch.sort(scores, descending=True, stable=True).indices[r:]
        residual = torch.cat([a[survivors], b])
    return residual


def select(cls_attention: torch.Tensor, features: torch.Tensor, k: int,
           important_ratio: float = IMPORTANT_RATIO) -> torch.Tensor:
    """VisPruner's `k` kept patches of one image (or crop).

    cls_attention [N] (the [CLS] row of the feature layer's attention over the patches, averaged over heads),
    features [N, Dv] (the feature layer's patch features, [CLS] dropped, before the projector), k (0..N) ->
    long [k], ascending.
    """
    n = cls_attention.shape[0]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie in 0..{n} (the image's patches)")
    important, diverse = split(k, important_ratio)
    order = torch.sort(cls_attention.float(), descending=True, stable=True).indices
    unit = features.float() / features.float().norm(dim=-1, keepdim=True)
    residual = remove_duplicates(unit, order[important:], diverse) if diverse > 0 else order[:0]
    return torch.cat([order[:important], residual]).sort().values


def per_crop(places: list[torch.Tensor], k: int, pick: Callable[[slice, int], torch.Tensor]) -> torch.Tensor:
    """The visual tokens kept when each crop of an image (LLaVA-NeXT's base view and tiles) keeps its own T picks, as
    the official LLaVA-NeXT code of VisPruner and CDPruner selects: T = k // crops for a budget of k visual tokens.

    places: per sample long [crops, n], the visual index of each crop's patch, -1 where the unpadding cuts it
    (`VisionCues.places`); pick(crops, T): long [crops, T] each crop's picks among its n patches, the crops being
    those at `crops` of the cues. -> long [batch, k'] ascending: the picks in the sequence (k' <= crops * T, less the
    picks the unpadding cuts, as the official index mask is unpadded after the selection)."""
    chosen, first = [], 0
    for where in places:
        crops = where.shape[0]
        if k < crops:
            raise ValueError(f"a budget of {k} visual tokens keeps none of each of the image's {crops} crops (the "
                             f"official T per crop = budget // crops): keep at least {crops}")
        visual = where.gather(1, pick(slice(first, first + crops), k // crops).to(where.device))
        chosen.append(visual[visual >= 0].sort().values)
        first += crops
    if len({len(c) for c in chosen}) > 1:
        raise ValueError(f"the samples keep {[len(c) for c in chosen]} visual tokens (the picks the unpadding cuts "
                         "differ): run them one at a time")
    return torch.stack(chosen)


class VisPruner(BeforeDecoder):
    """One selection before the first decoder layer from the vision tower's feature layer: its [CLS] attention
    averaged over heads and its patch features before the projector (`hap.pruners.visionzip.VisionCues`); on
    LLaVA-NeXT one per crop (`per_crop`)."""

    name = "vispruner"
    cls_cues = True
    crops = True

    def select(self, state, cut):
        cues, k = state.cues(), state.kept_count(cut.index)
        mean = cues.cls_attention / cues.heads  # [B, N], or [crops, n]
        if cues.places is not None:
            chosen = per_crop(cues.places, k, lambda crops, t: torch.stack(
                [select(a, f[1:], t) for a, f in zip(mean[crops], cues.features[crops])]))
        else:
            chosen = torch.stack([select(a, f[1:], k) for a, f in zip(mean, cues.features)])
        return Selection(chosen.to(state.visual_pos.device))


PRUNER = VisPruner
