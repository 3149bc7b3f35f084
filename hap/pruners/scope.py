"""SCOPE's selection rule (NeurIPS 2025, saliency x coverage; official kinredon/SCOPE, `scope/clip_encoder.py`
`CLIPVisionTower_SCOPE.forward` and `SCOPE`), docs/method.md §7.

Before the decoder, once per image (LLaVA-NeXT: once per crop, K // crops each, as the official LLaVA-NeXT run
divides its budget by the crops the tower encodes), from the vision tower's layer -2 (HF `attentions[-2]`,
`hidden_states[-2]`, hard-coded officially: LLaVA's feature layer on every checkpoint it runs; here the model's feature
layer, `VisionCues`):
- saliency a_i: the [CLS] query row's attention to patch i, **summed** over heads;
- similarity S[j, i]: the cosine of patches j and i (layer -2's patch states, [CLS] dropped);
- greedy facility location, K steps from cur_max = 0: gain_i = sum_j max(0, S[j, i] - cur_max[j]) x a_i^alpha
  (alpha = 1, the official "multi" combination); picked tokens are masked; the first maximum wins (`argmax`);
  cur_max = max(cur_max, S[best]).
Kept: exactly K patches, in raster order (the official mask keeps them in place); [CLS] dropped. The official code runs
in fp16 (ties possible there); here in float32.

The pruner (`Scope`) reads the feature layer's [CLS] cues (`Pruner.cls_cues`: the row summed over heads, the states).
"""

from __future__ import annotations

import torch

from .base import BeforeDecoder, Selection
from .vispruner import per_crop

ALPHA = 1.0  # the official default (env ALPHA)


def coverage_select(saliency: torch.Tensor, features: torch.Tensor, k: int, alpha: float = ALPHA) -> torch.Tensor:
    """SCOPE's `k` picks of one image (or crop): saliency [N] (>= 0), features [N, Dv] -> long [k], ascending."""
    n = saliency.shape[0]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie in 0..{n} (the image's patches)")
    unit = features.float() / features.float().norm(dim=-1, keepdim=True)
    sim = unit @ unit.T  # [N, N]
    weight = saliency.float() ** alpha
    cur = sim.new_zeros(n)
    picked = torch.zeros(n, dtype=torch.bool, device=sim.device)
    picks = torch.empty(k, dtype=torch.long, device=sim.device)
    for i in range(k):
        gains = (sim - cur[:, None]).clamp_min(0).sum(0) * weight  # gain of adding column i
        best = int(gains.masked_fill(picked, -torch.inf).argmax())
        picks[i], picked[best] = best, True
        cur = torch.maximum(cur, sim[best])
    return picks.sort().values


class Scope(BeforeDecoder):
    """One selection before the first decoder layer from the tower's feature layer ([CLS] attention summed over heads,
    patch states); on LLaVA-NeXT one per crop (`per_crop`)."""

    name = "scope"
    cls_cues = True
    crops = True

    def select(self, state, cut):
        cues, k = state.cues(), state.kept_count(cut.index)
        saliency, patches = cues.cls_attention, cues.features[:, 1:]  # [B, N], [B, N, Dv] (or [crops, ...])
        if cues.places is not None:
            chosen = per_crop(cues.places, k, lambda crops, t: torch.stack(
                [coverage_select(a, f, t) for a, f in zip(saliency[crops], patches[crops])]))
        else:
            chosen = torch.stack([coverage_select(a, f, k) for a, f in zip(saliency, patches)])
        return Selection(chosen.to(state.visual_pos.device))


PRUNER = Scope
