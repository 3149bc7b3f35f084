"""HoloV's selection rule (NeurIPS 2025, holistic visual budget; official obananas/HoloV, `llava/model/utils.py`
`HoloV`, called in `llava/model/llava_arch.py` after the projector), docs/method.md §7.

Before the decoder, once per image over its projected visual tokens in sequence order (LLaVA-NeXT: the base view and
the unpadded tile grid together, as the official code runs it, each token's attention from its own crop's [CLS] row):
- a_i: the feature layer's [CLS] attention to token i, **mean** over heads (`attentions[select_layer]`);
- 16 contiguous chunks in raster order, N // 16 tokens each, the first N % 16 one larger;
- per chunk of n > 1 tokens: unit features, S without its diagonal, m_i = sum_j S_ij / (n - 1),
  v_i = sum_j (S_ij - m_i)^2 / (n - 1) (the zeroed diagonal included); the token score 1e3 a_i + 0.09 v_i x c, c =
  mean |1e3 a| / (mean |v| + 1e-6); the chunk's score the mean token score (a chunk of one token: its attention);
- allocation: w = scores / (sum + 1e-6), floor(K w) per chunk, the remainder one each to the chunks of highest w;
- inside a chunk: the top by raw attention (descending); a chunk allotted at least its size keeps all of it, in order.
Where a chunk is allotted more than it holds, the official code pads the surplus with zero vectors; here the surplus
goes to the next chunks (wrapping round to the first), so exactly K tokens of the image are kept. Kept in the official
order (chunk by chunk, by attention inside a chunk), written into the first K slots (`Selection.tokens`). Float32
throughout (the official features are fp16); ties to the lowest index.

The pruner (`HoloV`) reads the feature layer's [CLS] cues and the projected tokens (`Cut.embeds`).
"""

from __future__ import annotations

import torch

from .base import BeforeDecoder, Selection

CHUNKS = 16
SCALE = 1e3  # the attention's weight
VARIANCE = 0.09  # the official alpha: the similarity variance's weight
EPS = 1e-6


def chunk_bounds(n: int, chunks: int = CHUNKS) -> list[tuple[int, int]]:
    """[start, end) of each non-empty chunk of `n` tokens: n // chunks each, the first n % chunks one larger."""
    size, extra = divmod(n, chunks)
    bounds, start = [], 0
    for p in range(chunks):
        end = start + size + (p < extra)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


def chunk_score(tokens: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """One chunk's score: tokens [n, D], attention [n] -> a scalar (float32)."""
    n = tokens.shape[0]
    attention = attention.float()
    if n <= 1:
        return attention.mean()
    x = tokens.float()
    unit = x / (x.norm(dim=1, keepdim=True) + EPS)
    sim = (unit @ unit.T) * (1 - torch.eye(n, device=x.device))
    mean = sim.sum(1) / (n - 1)
    var = ((sim - mean[:, None]) ** 2).sum(1) / (n - 1)
    scaled = attention * SCALE
    return (scaled + VARIANCE * var * (scaled.abs().mean() / (var.abs().mean() + EPS))).mean()


def allocate(scores: torch.Tensor, sizes: list[int], k: int) -> list[int]:
    """Tokens per chunk: floor(k x share), the remainder one each to the best chunks (descending share, ties to the
    first), then each chunk's surplus over its size carried to the next chunks (wrapping round) -> counts summing to
    k. scores [C] (float32), sizes: the chunks' token counts (summing to >= k)."""
    weights = scores / (scores.sum() + EPS)
    counts = (weights * k).floor().long()
    remaining = k - int(counts.sum())
    if remaining > 0:
        counts[torch.sort(weights, descending=True, stable=True).indices[:remaining]] += 1
    counts, carry = counts.tolist(), 0
    while True:
        for i, size in enumerate(sizes):
            want = counts[i] + carry
            counts[i], carry = min(want, size), max(want - size, 0)
        if carry == 0:
            return counts


def holistic_select(tokens: torch.Tensor, attention: torch.Tensor, k: int, chunks: int = CHUNKS) -> torch.Tensor:
    """HoloV's `k` picks of one image: tokens [N, D] (projected), attention [N] ([CLS] attention, head mean) ->
    long [k] in the official order (chunk by chunk; inside a chunk by descending attention, or in place where the
    chunk keeps all of its tokens)."""
    n = tokens.shape[0]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie in 0..{n} (the image's visual tokens)")
    bounds = chunk_bounds(n, chunks)
    scores = torch.stack([chunk_score(tokens[s:e], attention[s:e]) for s, e in bounds])
    picks = []
    for (s, e), count in zip(bounds, allocate(scores, [e - s for s, e in bounds], k)):
        if count >= e - s:
            picks.append(torch.arange(s, e, device=tokens.device))
        elif count > 0:
            picks.append(s + torch.sort(attention[s:e].float(), descending=True, stable=True).indices[:count])
    return torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long, device=tokens.device)


def visual_attention(places: torch.Tensor, attention: torch.Tensor, n: int) -> torch.Tensor:
    """Each visual token's attention from its crop's [CLS] row: places long [crops, p] (the visual index of each crop
    patch, -1 where the unpadding cuts it), attention [crops, p] -> [n]."""
    out = attention.new_zeros(n)
    inside = places >= 0
    out[places[inside]] = attention[inside]
    return out


class HoloV(BeforeDecoder):
    """One selection before the first decoder layer over the projected visual tokens, by spatial chunk budgets and the
    feature layer's [CLS] attention (head mean); on LLaVA-NeXT over every patch token of the image at once."""

    name = "holov"
    cls_cues = True
    crops = True
    embeds = True
    writes_tokens = True

    def select(self, state, cut):
        cues, k = state.cues(), state.kept_count(cut.index)
        mean = cues.cls_attention / cues.heads  # [B, N] (or [crops, p])
        embeds = cut.embeds.to(mean.device)
        if cues.places is not None:
            starts = [0]
            for where in cues.places:
                starts.append(starts[-1] + where.shape[0])
            mean = torch.stack([visual_attention(where, mean[a:b], embeds.shape[1])
                                for where, a, b in zip(cues.places, starts, starts[1:])])
        order = torch.stack([holistic_select(x, a, k) for x, a in zip(embeds, mean)])  # [B, k]
        tokens = embeds.gather(1, order[..., None].expand(-1, -1, embeds.shape[-1]))
        slots = torch.arange(k, device=state.visual_pos.device).expand(embeds.shape[0], -1)
        return Selection(slots, tokens=tokens, patches=order.to(state.visual_pos.device))


PRUNER = HoloV
