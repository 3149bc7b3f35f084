"""PAQ-weighted fusion of attention maps, token scores and top-k selection (docs/method.md §5, §6).

A group's maps are stacked as `attn [batch, layers, heads, prompt, visual]` with `paq [batch,
layers, heads]`. The weights w = softmax(PAQ / T) run over all (layer, head) pairs of the group;
T = inf gives uniform averaging. Given the heads' visual share mu (`head_weight="paq_visual"`,
docs/method.md §10), w ~ mu exp(PAQ / T) instead. The group map M = sum w * A factors into head fusion per layer
(softmax over that layer's heads) and layer fusion with beta_l = the layer's share of w.
"""

from __future__ import annotations

import torch

_EPS = 1e-12


def scaled(paq: torch.Tensor, temperature: float) -> torch.Tensor:
    """(PAQ - max PAQ) / T over the last dim, `[..., n]` -> the same shape, each in [-inf, 0]: the logits of
    softmax(PAQ / T) shifted so that no temperature > 0 overflows (PAQ / T reaches inf below T ~ 3e-39 in float32,
    and inf - inf is NaN); divided in float64, where any positive float T stays positive."""
    paq = paq.double()
    return ((paq - paq.amax(-1, keepdim=True)) / temperature).float()


def fusion_weights(paq: torch.Tensor, temperature: float, visual_share: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(PAQ / T) (or mu exp(PAQ / T) normalised, with `visual_share`) over every trailing dim:
    `paq [batch, ...]` -> same shape, summing to 1 per sample."""
    logits = scaled(paq.flatten(1), temperature)
    if visual_share is not None:
        logits = logits + visual_share.float().flatten(1).clamp_min(_EPS).log()
    return logits.softmax(-1).view_as(paq)


def fuse(attn: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of maps: `attn [batch, *w, prompt, visual]`, `weights [batch, *w]` -> `[batch, prompt, visual]`."""
    w = weights.to(attn.dtype)
    return (attn * w[..., None, None]).flatten(1, -3).sum(1)


def head_fusion(attn: torch.Tensor, paq: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-layer head fusion: `attn [batch, layers, heads, P, V]`, `paq [batch, layers, heads]` -> `[batch, layers, P, V]`."""
    w = scaled(paq, temperature).softmax(-1)
    return (attn * w[..., None, None].to(attn.dtype)).sum(2)


def layer_shares(paq: torch.Tensor, temperature: float) -> torch.Tensor:
    """beta_l: each layer's share of the group softmax mass, `[batch, layers]`."""
    return fusion_weights(paq, temperature).sum(-1)


def group_map(attn: torch.Tensor, paq: torch.Tensor, temperature: float) -> torch.Tensor:
    """M_g = sum_{l,h} softmax(PAQ/T)[l,h] A[l,h]: `[batch, layers, heads, P, V]` -> `[batch, P, V]`."""
    return fuse(attn, fusion_weights(paq, temperature))


def token_scores(fused: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """s_v = L2 norm over the valid prompt rows: `fused [batch, P, V]`, `row_valid [batch, P]` -> `[batch, V]`."""
    rows = fused.float() * row_valid[:, :, None].to(torch.float32)
    return rows.norm(dim=1)


def row_mean(fused: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """s_v = mean over the valid prompt rows (SparseVLM, AutoPrune): `fused [batch, P, V]`, `row_valid [batch, P]`
    -> `[batch, V]`."""
    valid = row_valid[:, :, None].to(torch.float32)
    return (fused.float() * valid).sum(1) / valid.sum(1).clamp_min(1)


def select_top(scores: torch.Tensor, k: int, priority: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k highest scores per sample, ties broken by position, in ascending order.

    scores [batch, V] -> long [batch, k]. With `priority [batch, V]`, tokens are ranked by priority first
    and by score among equal priorities (lexicographic order).
    """
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k={k} must be in [1, {scores.shape[-1]}]")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    if priority is not None:
        first = torch.sort(priority.gather(1, order), dim=-1, descending=True, stable=True).indices
        order = order.gather(1, first)
    return order[:, :k].sort(dim=-1).values
