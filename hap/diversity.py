"""Relevance traded against diversity at a cut: HAP+'s `diversity` knob (docs/method.md §10).

At eight slots the tokens a prompt points at crowd out a small patch that looks like nothing else, which a diversity
rule keeps. Here a cut keeps the greedy MAP of a conditional determinantal point process (as CDPruner, with HAP's
PAQ-weighted attention for the relevance): the kernel L = diag(q) S diag(q) over the visual tokens present, S the
cosine similarity of the hidden states entering the cut, q_j = exp(r_j / 2w). Picking one token at a time, the gain of
token j (the log-determinant it adds) is, up to the factor 1 / w,

    gain_j = r_j + w * log d_j

- r_j: the cut's relevance (HAP's scores) rescaled to [0, 1] over the sample's finite scores (flat scores: all 0); a
  score of +inf (an anchor of `sink_ranking`) is taken before any finite one, -inf (a masked sink) after them all;
- d_j: the squared distance of token j's unit hidden state from the span of those already kept (1 before the first
  pick, 0 for a duplicate; floored at FLOOR), the Gram-Schmidt residual of S (one row of S computed per pick, the
  residuals accumulated in float64: in float32 the cancellation in 1 - sum e^2 leaves ~1e-7 of noise, which log d
  turns into gains that flip picks between a batch and its samples alone);
- w: the weight of diversity (w = 0: the relevance top-k; relevance flat: the greedy MAP of the DPP of kernel S).

Detected sink tokens (w > 0) form a tier of their own, after every other token of finite relevance: a massive
activation makes a sink the largest outlier of the hidden states, which the determinant would pick first; here a sink
is kept only once the other tokens run out (or first as `sink_ranking`'s anchor, or last as its mask). A floor does
not do it: a sink at the floor ties with the near-duplicates there and outranks them by its relevance. Ties go to the
lowest index. Pure functions, the picks made in numpy on a CPU (a pick's dozen small steps cost a fifth of torch's
there) and in torch elsewhere, the same arithmetic; the `hap` pruner calls `select`.
"""

from __future__ import annotations

import numpy as np
import torch

FLOOR = 1e-3  # the smallest residual d, log FLOOR the gain of a duplicate of the kept tokens: below it two tokens
#               differ less than half precision resolves (bfloat16 hidden states move unit-vector dot products by
#               ~1e-3), so such near-duplicates tie and relevance ranks them (validation: docs/method.md §10)


def rescaled(scores: torch.Tensor) -> torch.Tensor:
    """`scores [batch, N]` with each sample's finite values mapped affinely onto [0, 1] (all 0 where they are flat),
    +-inf kept, in float32 -> [batch, N]."""
    scores = scores.float()
    finite = scores.isfinite()
    low = scores.masked_fill(~finite, torch.inf).amin(-1, keepdim=True)
    high = scores.masked_fill(~finite, -torch.inf).amax(-1, keepdim=True)
    span = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(finite, ((scores - low) / span).clamp(0, 1), scores)


def _tier(values: torch.Tensor, open_: torch.Tensor) -> torch.Tensor:
    """The tokens of `open_` (bool [batch, N]) whose `values` [batch, N] equal the largest among them."""
    best = values.masked_fill(~open_, -torch.inf).amax(-1, keepdim=True)
    return open_ & (values == best)


def select(relevance: torch.Tensor, embeds: torch.Tensor, k: int, weight: float,
           sink: torch.Tensor | None = None, priority: torch.Tensor | None = None) -> torch.Tensor:
    """The `k` tokens the greedy relevance-diversity rule keeps -> long [batch, k], ascending.

    `relevance [batch, N]` (higher = keep; +-inf allowed), `embeds [batch, N, D]` the hidden states (the kernel S is
    their cosine similarity, one row computed per pick), `weight` w >= 0, `sink` bool [batch, N] tokens kept after
    every other finite-relevance one where w > 0, `priority [batch, N]` ranked before anything (an analysis hook, as in `hap.scoring.fusion.select_top`). Each
    step takes, among the unpicked tokens of the highest priority and then of the highest class (+inf relevance,
    finite, a detected sink's finite relevance, -inf), the largest r + w log d (module docstring)."""
    batch, n = relevance.shape
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, {n}]")
    r = rescaled(relevance)
    rank = torch.where(r.isfinite(), 2, torch.where(r > 0, 3, 0)).float()  # +inf: 3, finite: 2, -inf: 0
    if sink is not None and weight > 0:  # a detected sink: after every other finite token (module docstring)
        rank = torch.where(sink.to(r.device) & r.isfinite(), 1.0, rank)
    r = r.nan_to_num(0.0, 0.0, 0.0)
    unit = torch.nn.functional.normalize(embeds.double(), dim=-1).to(r.device)  # [B, N, D], float64 (module docstring)
    priority = None if priority is None else priority.to(r.device).float()
    if r.device.type == "cpu":  # one sample at a time in numpy: a pick's dozen small steps cost a fifth of torch's
        picks = torch.from_numpy(np.stack([_picks(r[b].double().numpy(), rank[b].numpy(), unit[b].numpy(), k, weight,
                                                  None if priority is None else priority[b].numpy())
                                           for b in range(batch)]))
    else:
        picks = _picks_batched(r, rank, unit, k, weight, priority)
    return picks.sort(-1).values


def _picks(r: np.ndarray, rank: np.ndarray, unit: np.ndarray, k: int, weight: float,
           priority: np.ndarray | None) -> np.ndarray:
    """`select`'s picks of one sample, in numpy (the arithmetic of `_picks_batched`, step for step): `r [N]` the
    rescaled relevance (float64), `rank [N]` its tiers, `unit [N, D]` the unit hidden states -> int64 [k], in pick
    order."""
    n = r.shape[0]
    tiered = priority is not None or bool((rank != 2).any())  # else every token is in one tier
    residual = np.ones(n)  # d: squared distance from the span of the kept unit vectors
    basis = np.zeros((k, n))  # row i: each token's coordinate on the i-th kept direction
    closed = np.zeros(n, dtype=bool)
    picks = np.empty(k, dtype=np.int64)
    for i in range(k):
        gain = r + weight * np.log(np.maximum(residual, FLOOR))
        shut = closed
        if tiered:
            candidates = ~closed
            if priority is not None:
                candidates &= priority == priority[candidates].max()
            shut = ~(candidates & (rank == rank[candidates].max()))
        gain[shut] = -np.inf
        j = int(gain.argmax())
        picks[i] = j
        closed[j] = True
        if i + 1 < k:  # Gram-Schmidt: every token's coordinate on the new direction, S[j] less the kept directions
            e = unit @ unit[j] - basis[:i, j] @ basis[:i]
            e /= np.sqrt(max(residual[j], FLOOR))
            basis[i] = e
            residual = np.maximum(residual - e * e, 0)
    return picks


def _picks_batched(r: torch.Tensor, rank: torch.Tensor, unit: torch.Tensor, k: int, weight: float,
                   priority: torch.Tensor | None) -> torch.Tensor:
    """`select`'s picks of every sample at once, in torch (an accelerator's tensors) -> long [batch, k], in pick
    order."""
    batch, n = r.shape
    tiered = priority is not None or bool((rank != 2).any())  # else every token is in one tier
    residual = torch.ones_like(r, dtype=torch.float64)  # d: squared distance from the span of the kept unit vectors
    basis = torch.zeros(batch, k, n, dtype=torch.float64, device=r.device)  # row i: each token's coordinate on the
    #                                                                         i-th kept direction
    open_ = torch.ones(batch, n, dtype=torch.bool, device=r.device)
    picks = torch.empty(batch, k, dtype=torch.long, device=r.device)
    rows = torch.arange(batch, device=r.device)
    for i in range(k):
        candidates = open_
        if tiered:
            candidates = open_ if priority is None else _tier(priority, open_)
            candidates = _tier(rank, candidates)
        d = residual.clamp_min(FLOOR)
        j = (r + weight * d.log()).masked_fill(~candidates, -torch.inf).argmax(-1)  # float64
        picks[:, i] = j
        open_[rows, j] = False
        if i + 1 < k:  # Gram-Schmidt: every token's coordinate on the new direction, S[j] less the kept directions
            e = (unit @ unit[rows, j][..., None]).squeeze(-1) - (basis[rows, :i, j][:, None] @ basis[:, :i]).squeeze(1)
            e = e / residual[rows, j].clamp_min(FLOOR).sqrt()[:, None]
            basis[:, i] = e
            residual = (residual - e * e).clamp_min(0)
    return picks
