"""DivPrune's selection rule (CVPR 2025; official vbdi/divprune, `llava_arch.py` `DivPrune`), docs/method.md §7.

Before the decoder, on the projected visual tokens of one image: keep the `k` most diverse tokens, as a greedy
max-min selection under the cosine distance d(i, j) = 1 - cos(f_i, f_j) of the raw projected vectors.
- first pick: the token whose nearest other token is farthest, argmax_j of the second-smallest d(., j) (the
  smallest is its own 0);
- then k - 1 steps: argmax_j of min over the picked s of d(s, j).
Ties go to the lowest index (torch.argmax returns the first maximum, as in the official code).

One departure, for one case only: the official score of an already picked token is its own distance (~0, up to
rounding), so it can pick a token twice when every unpicked token is a duplicate of a picked one (the spliced
sequence then holds that token twice). Here picked tokens are out of the running, so the k indices are always
distinct: in that case the rule takes the duplicate (the same direction) instead of repeating the pick. On any
input where the official rule picks no token twice, both keep the same set.

Pure tensor functions (no question and no attention weights are needed), then the pruner (`DivPrune`).
"""

from __future__ import annotations

import torch

from .base import BeforeDecoder, Selection


def count(ratio: float, n: int) -> int:
    """Tokens kept of `n` at `ratio` (the official `int(round(ratio * n))`; 64/128/192 of 576 = ratio 1/9, 2/9,
    1/3)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio={ratio} must lie in [0, 1]")
    return int(round(ratio * n))


def distances(tokens: torch.Tensor) -> torch.Tensor:
    """Cosine distances 1 - cos(f_i, f_j) of `tokens [N, D]`, in float32 -> [N, N]."""
    unit = tokens.float() / tokens.float().norm(dim=-1, keepdim=True)
    return 1.0 - unit @ unit.T


def select(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` tokens of `tokens [N, D]` (one image's projected visual tokens) DivPrune keeps -> long [k],
    ascending (0 <= k <= N), on the tokens' device."""
    n = tokens.shape[0]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie in 0..{n} (the image's visual tokens)")
    picks = torch.empty(k, dtype=torch.long, device=tokens.device)
    if k == 0:
        return picks
    d = distances(tokens)
    first = int(d.kthvalue(2, dim=0).values.argmax()) if n > 1 else 0
    picks[0] = first
    nearest = d[first].clone()  # [N] distance of each token to its nearest pick
    nearest[first] = -torch.inf
    for i in range(1, k):
        j = int(nearest.argmax())
        picks[i] = j
        nearest = torch.minimum(nearest, d[j])  # earlier picks stay at -inf
        nearest[j] = -torch.inf
    return picks.sort().values


class DivPrune(BeforeDecoder):
    """One selection before the first decoder layer over the projected visual tokens each sample's decoder receives
    (`select`), positions renumbered as the official code splices the kept tokens."""

    name = "divprune"
    embeds = True

    def select(self, state, cut):
        k = state.kept_count(cut.index)
        chosen = torch.stack([select(tokens, k) for tokens in cut.embeds])
        return Selection(chosen.to(state.visual_pos.device))


PRUNER = DivPrune
