"""DART's selection rule (EMNLP 2025, "Stop looking for important tokens"; official ZichenWen1/DART,
`modeling_llama_self.py` `get_retained_image_token`), docs/method.md §7.

Inside the decoder, once in prefill, entering layer K (layers 0..K-1 see every token), from layer K-1:
- keys: layer K-1's keys after k_proj and RoPE, heads concatenated `[T, heads * head_dim]` (repeating GQA's kv
  heads changes no ranking);
- states: layer K-1's output passed through the model's *final* norm `[T, D]`.
Pivots: the `pivots` (4) visual tokens with the largest key L1 norm, and the `pivots` tokens with the largest key
L1 norm among the tokens after the image. Pool: the visual tokens minus the image pivots. For each pivot in turn,
the `per_pivot` pool tokens least cosine-similar to it (on the final-normed states) are kept and leave the pool.
Kept: the image pivots and the picked tokens (pivots + 2 * pivots * per_pivot visual tokens); all text is kept.

Pivot order: the official loop runs over `list(set(image_pivots + text_pivots))`, a Python set of *absolute*
sequence positions built from the two lists in descending-L1 order. The order a set iterates small integers in
follows their hash slots, not their values, so it is neither ascending nor by L1; and since each pivot removes its
picks from the pool, another order keeps another set. `pivot_order` builds the same set the same way, on purpose.

Ties (which the official code leaves to `topk`): the largest L1 norms and the least similar pool tokens are both
taken lowest position first. Similarities are computed in float32.

Edge cases, handled rather than failing as `topk` would in the official code:
- fewer than `pivots` visual tokens or text tokens after the image: all of them are pivots (fewer pivots);
- image and text pivots never coincide (the caller's `visual` and `after_image` must be disjoint, checked), so the
  set holds every pivot once;
- pool exhaustion: when the pool runs out, each later pivot takes what is left (possibly nothing), so the image
  keeps all its tokens rather than more than it has; `kept_count` gives the count either way.

The pruner (`Dart`) runs the rule on the shared executor, which hands it layer K-1's keys and final-normed output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Pruner, Selection

PIVOTS = 4  # image pivots, and text pivots (official pivot_image_token = pivot_text_token = 4)


def per_pivot(budget: int, pivots: int = PIVOTS, n: int | None = None) -> int:
    """Tokens each pivot keeps (T) for a budget of `budget` visual tokens: floor(M / (2 * pivots)), the official
    `MAX_NUM_TRUNCTION // 8`; the official 64/128/192 settings thus keep 68/132/196 of 576 (pivots included).
    With `n` (the image's visual tokens), M is first capped at n - pivots (the pool): the official LLaVA-1.6 rule
    T = floor(min(320, N - 4) / 8) is `per_pivot(320, n=N)`."""
    if budget < 0 or pivots < 1:
        raise ValueError(f"budget={budget} must be >= 0 and pivots={pivots} >= 1")
    if n is not None:
        budget = max(0, min(budget, n - pivots))
    return budget // (2 * pivots)


def per_pivot_ratio(n: int, ratio: float, pivots: int = PIVOTS) -> int:
    """T for Qwen2-VL / Qwen2.5-VL as the official code counts it from the reduction ratio: int(n (1 - ratio) / 8)
    of the image's `n` visual tokens."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio={ratio} must lie in [0, 1]")
    return int(n * (1 - ratio) / (2 * pivots))


def kept_count(n: int, per_pivot: int, pivots: int = PIVOTS, after: int | None = None) -> int:
    """Visual tokens `select` keeps of `n`, with `after` tokens after the image (None: at least `pivots`)."""
    image = min(pivots, n)
    text = pivots if after is None else min(pivots, after)
    return image + min((image + text) * per_pivot, n - image)


def top_l1(keys: torch.Tensor, positions: torch.Tensor, k: int) -> list[int]:
    """The `k` positions (of `positions`) whose keys have the largest L1 norm, in descending order (lowest position
    first on ties) -> list of absolute positions."""
    l1 = keys[positions].float().abs().sum(-1)
    order = torch.sort(l1, descending=True, stable=True).indices[:k]
    return positions[order].tolist()


def pivot_order(image_pivots: list[int], text_pivots: list[int]) -> list[int]:
    """The order the official loop visits the pivots in: `list(set(image_pivots + text_pivots))` (see the module
    docstring: a Python set's iteration order, kept on purpose)."""
    return list(set(image_pivots + text_pivots))


def select(keys: torch.Tensor, normed: torch.Tensor, visual: torch.Tensor, after_image: torch.Tensor,
           per_pivot: int, pivots: int = PIVOTS) -> torch.Tensor:
    """DART's kept visual tokens.

    keys [T, d] (layer K-1's keys, heads concatenated), normed [T, D] (layer K-1's output through the final norm),
    visual long [N] (the image's visual-token positions, ascending), after_image long [A] (the positions after the
    image: the text-pivot candidates), per_pivot (T), pivots (4) -> long indices into 0..N-1, ascending.
    """
    visual, after_image = visual.to(keys.device), after_image.to(keys.device)
    if per_pivot < 0 or pivots < 1:
        raise ValueError(f"per_pivot={per_pivot} must be >= 0 and pivots={pivots} >= 1")
    if visual.numel() > 1 and not bool((visual[1:] > visual[:-1]).all()):
        raise ValueError("visual positions must be strictly ascending")
    if bool(torch.isin(after_image, visual).any()):
        raise ValueError("after_image positions must not include visual positions")
    image_pivots = top_l1(keys, visual, pivots)
    order = pivot_order(image_pivots, top_l1(keys, after_image, pivots))
    sim = F.cosine_similarity(normed[order].float()[:, None], normed[visual].float()[None], dim=-1)  # [P, N]
    kept = torch.isin(visual, torch.tensor(image_pivots, dtype=visual.dtype, device=visual.device))
    pool = ~kept
    for row in sim:
        take = min(per_pivot, int(pool.sum()))
        picks = torch.sort(row.masked_fill(~pool, torch.inf), stable=True).indices[:take]
        pool[picks] = False
        kept[picks] = True
    return kept.nonzero()[:, 0]


class Dart(Pruner):
    """One selection entering layer K = `first_layers` (at least 1: it reads layer K-1), from layer K-1's keys and
    final-normed output (`Cut.keys`, `Cut.normed`): the image pivots and per_pivot(budget) tokens per pivot; the text
    pivots come from every token after the image. Original positions kept."""

    name = "dart"
    fixed_rows = "prompt"  # the tokens after the image: the text-pivot candidates
    fixed_cuts = 1
    maps = False
    layer_states = True
    min_full_layers = 1

    def realised(self, k, num_visual, grids=()):
        return kept_count(num_visual, per_pivot(k))

    def select(self, state, cut):
        """Each sample's rule on its own sequence: positions counted from its first real token (left padding off),
        as the official batch of one counts them (the pivot order follows absolute positions)."""
        T = state.seq_index.shape[1]
        rows, valid = state.row_positions(T), state.row_valid
        real = state.key_valid()
        starts = [0] * len(rows) if real is None else real.long().argmax(1).tolist()
        per = per_pivot(cut.budget)
        chosen = [select(keys[s:], normed[s:], visual - s, row[ok] - s, per) for keys, normed, visual, row, ok, s
                  in zip(cut.keys, cut.normed, state.visual_pos, rows, valid, starts)]
        if len({c.numel() for c in chosen}) > 1:
            raise ValueError("method='dart' keeps a count that depends on the tokens after the image: a batch needs "
                             f"at least {PIVOTS} of them in every prompt")
        return Selection(torch.stack(chosen).to(state.visual_pos.device))


PRUNER = Dart
