"""VisionZip-style selection before the decoder (docs/method.md §7): the peer baseline at small budgets.

The vision tower's [CLS] query says which patches carry the image's summary: the `dominant`
tokens are the patches it attends to most (averaged over heads). The remaining patches are not
dropped outright: a few evenly spaced ones become `contextual` targets, every other remaining patch
joins the target whose key it is most similar to (cosine), and each target's embedding becomes
the mean of its members. Dominant plus contextual tokens enter the decoder and stay in every
layer, so the layer-averaged retained fraction is simply (dominant + contextual) / N.

Pure tensor functions; the adapter supplies the [CLS] attention row and the keys of the tower's
feature layer, and the projected visual embeddings.
"""

from __future__ import annotations

import torch

DOMINANT_SHARE = 54 / 64  # the published 54 dominant + 10 contextual split of 64 tokens


def split_budget(k: int, dominant_share: float = DOMINANT_SHARE) -> tuple[int, int]:
    """(dominant, contextual) counts for a budget of `k` tokens; at least one dominant token, and
    a contextual token only when k >= 2."""
    if k < 1:
        raise ValueError(f"a VisionZip budget needs at least one token; got k={k}")
    dominant = min(k, max(1, round(k * dominant_share)))
    if dominant == k and k >= 2:
        dominant = k - 1
    return dominant, k - dominant


def dominant_tokens(cls_attention: torch.Tensor, k: int) -> torch.Tensor:
    """Top-`k` patches by [CLS] attention: `cls_attention [batch, N]` -> long `[batch, k]`, ascending."""
    order = torch.sort(cls_attention.float(), dim=-1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=-1).values


def contextual_tokens(keys: torch.Tensor, embeds: torch.Tensor, dominant: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the non-dominant patches into `k` contextual tokens.

    keys [batch, N, d] (the tower's keys, for similarity), embeds [batch, N, D] (what the decoder
    receives), dominant long [batch, n_dom]. Returns (targets long [batch, k]: the patch whose place
    each contextual token takes, ascending; merged [batch, k, D]: the mean embedding of each target
    and the remaining patches most similar to it).
    """
    B, N, _ = keys.shape
    if k == 0:
        return dominant.new_zeros(B, 0), embeds.new_zeros(B, 0, embeds.shape[-1])
    rest_mask = torch.ones(B, N, dtype=torch.bool, device=keys.device)
    rest_mask.scatter_(1, dominant, False)
    rest = rest_mask.nonzero()[:, 1].view(B, -1)  # [B, R] ascending
    R = rest.shape[1]
    if k > R:
        raise ValueError(f"{k} contextual tokens need at least {k} non-dominant patches; there are {R}")
    pick = torch.linspace(0, R - 1, k, device=keys.device).round().long()  # evenly spaced targets
    targets = rest[:, pick]  # [B, k]
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = unit.gather(1, rest[..., None].expand(-1, -1, unit.shape[-1])) @ \
        unit.gather(1, targets[..., None].expand(-1, -1, unit.shape[-1])).transpose(1, 2)  # [B, R, k]
    assign = sim.argmax(-1)  # [B, R] every remaining patch (targets join themselves)
    assign[:, pick] = torch.arange(k, device=keys.device)
    members = torch.nn.functional.one_hot(assign, k).to(embeds.dtype)  # [B, R, k]
    rest_embeds = embeds.gather(1, rest[..., None].expand(-1, -1, embeds.shape[-1]))
    merged = members.transpose(1, 2) @ rest_embeds / members.sum(1)[..., None]
    return targets, merged


def select(cls_attention: torch.Tensor, keys: torch.Tensor, embeds: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VisionZip's `k` tokens: `split_budget(k)` dominant ones by [CLS] attention, the rest merged into contextual
    ones. cls_attention [batch, N], keys [batch, N, d], embeds [batch, N, D] -> (chosen long [batch, k] ascending,
    slots long [batch, k_ctx]: where in `chosen` each contextual token sits, merged [batch, k_ctx, D])."""
    n_dominant, n_contextual = split_budget(k)
    dominant = dominant_tokens(cls_attention, n_dominant)
    targets, merged = contextual_tokens(keys, embeds, dominant, n_contextual)
    chosen = torch.cat([dominant, targets], 1).sort(1).values
    return chosen, torch.searchsorted(chosen, targets), merged
