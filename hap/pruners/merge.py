"""Merging the dropped visual tokens into the kept ones, with proportional attention (docs/method.md §10).

A cut that drops a token loses what the token carried and, as much, the attention mass the prompt
gave it: with fewer keys, softmax hands that mass to whatever is left, which skews questions that
weigh the image as a whole (how many, is there any, what colour is the background). With
`merge="proportional"` each dropped token joins the kept token whose hidden state is most similar
(cosine); the kept token's hidden state becomes the size-weighted mean of its members and its size
the number of original tokens it stands for. Every later attention adds log(size) to the logits of
that key (as Token Merging's proportional attention does), so a merged token draws the attention
of as many copies of itself: softmax over (s_i copies of key k_i) = softmax with bias log s_i.

Pure tensor functions; the pruner keeps the sizes across cuts and the adapter adds the bias to
the attention masks of the later layers, prefill and decode steps alike.
"""

from __future__ import annotations

import torch


def merge_dropped(embeds: torch.Tensor, sizes: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold every visual token into a kept one.

    embeds [batch, N, D] hidden states of the visual tokens at the cut, sizes [batch, N] the original
    tokens each stands for (1 before any merge), chosen long [batch, k] the kept ones (ascending).
    Returns (merged [batch, k, D]: size-weighted mean of each kept token and the dropped tokens most
    similar to it, sizes [batch, k]: their summed sizes, which add up to the input's).
    """
    B, N, D = embeds.shape
    k = chosen.shape[1]
    unit = torch.nn.functional.normalize(embeds.float(), dim=-1)
    kept_unit = unit.gather(1, chosen[..., None].expand(-1, -1, D))
    assign = (unit @ kept_unit.transpose(1, 2)).argmax(-1)  # [B, N] the most similar kept token
    assign.scatter_(1, chosen, torch.arange(k, device=chosen.device).expand(B, k))  # a kept token joins itself
    weight = sizes.float()
    total = torch.zeros(B, k, device=embeds.device).scatter_add_(1, assign, weight)
    summed = torch.zeros(B, k, D, device=embeds.device).scatter_add_(
        1, assign[..., None].expand(-1, -1, D), embeds.float() * weight[..., None])
    return (summed / total[..., None]).to(embeds.dtype), total


def key_bias(sizes: torch.Tensor, visual_pos: torch.Tensor, length: int) -> torch.Tensor:
    """Additive attention bias per key of a sequence of `length` tokens: log(size) at the visual tokens'
    positions `visual_pos` long [batch, k] (sizes [batch, k]), 0 elsewhere -> float [batch, length]."""
    bias = torch.zeros(sizes.shape[0], length, device=sizes.device)
    return bias.scatter_(1, visual_pos, sizes.float().log())


def add_key_bias(mask: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A materialised 4-D attention mask `[batch, 1, q, kv]` (bool, True = attend; or additive float) plus the
    per-key `bias [batch, kv']` on its first kv' columns (later columns: tokens generated since, bias 0) ->
    an additive mask of `dtype`."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    pad = mask.shape[-1] - bias.shape[-1]
    full = torch.nn.functional.pad(bias.to(mask.device, dtype), (0, pad))
    return mask + full[:, None, None, :]
