"""Prompt-row attention recomputed from q and k, so the model itself keeps running on SDPA (docs/method.md §1).

For the layers whose maps are needed, only the prompt rows are recomputed: the logits q_P k^T / sqrt(d_h) (with RoPE
applied to q and k, or not, as the caller says), the causal mask, the padding mask and grouped-query heads expanded
(`prompt_logits`), then their softmax (`prompt_attention`). Cost O(|P| T d) per layer instead of O(T^2 d).
"""

from __future__ import annotations

import torch


def prompt_logits(
    q_rows: torch.Tensor,
    keys: torch.Tensor,
    row_pos: torch.Tensor,
    key_valid: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The prompt rows' attention logits q.k x scaling over every key, in float32, -inf where a row may not look.

    q_rows [batch, heads, P, d_h] (the rows' queries); keys [batch, kv_heads, T, d_h]; row_pos long [P] or
    [batch, P], each row's index in the T keys (causal: a row sees keys at index <= its own); key_valid bool
    [batch, T] or None (False = padding); bias float [batch, T] or None: added to every row's logits per key
    (proportional attention after a merge, hap/pruners/merge.py); window: a sliding-window layer's width, a row seeing
    only the keys at index > its own - window (None: every earlier key). Grouped-query keys serve their query heads.
    Returns [batch, heads, P, T].
    """
    heads, kv_heads = q_rows.shape[1], keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    B, _, P, d = q_rows.shape
    T = keys.shape[2]
    q = q_rows.float().view(B, kv_heads, heads // kv_heads, P, d)  # query head h reads kv head h // group
    logits = (q @ keys.float()[:, :, None].transpose(-1, -2)).view(B, heads, P, T) * scaling  # [B, H, P, T]
    if bias is not None:
        logits = logits + bias.float()[:, None, None, :]
    if row_pos.dim() == 1:
        row_pos = row_pos.unsqueeze(0)
    index = torch.arange(T, device=keys.device)[None, None, :]
    allowed = index <= row_pos[:, :, None]  # [B|1, P, T]
    if window is not None:
        allowed = allowed & (index > row_pos[:, :, None] - window)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :]
    return logits.masked_fill(~allowed[:, None], float("-inf"))


def prompt_attention(logits: torch.Tensor) -> torch.Tensor:
    """Attention probabilities of the prompt rows from their `prompt_logits` `[batch, heads, P, T]` -> the same
    shape; every row sums to 1 over the keys it may see (a row that may see none: zeros)."""
    return logits.softmax(-1).nan_to_num(0.0)
