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


def whole_count(k: int, num_visual: int, num_whole: int) -> int:
    """Tokens kept of the image's `num_visual` visual and `num_whole` other tokens (LLaVA-NeXT's newlines) when the
    budget plans `k` of the visual ones: the official count at the budget's ratio k / num_visual over every token it
    selects over, int(round(k / num_visual * (num_visual + num_whole)))."""
    return count(k / num_visual, num_visual + num_whole)


class DivPrune(BeforeDecoder):
    """One selection before the first decoder layer over the projected visual tokens each sample's decoder receives
    (`select`), positions renumbered as the official code splices the kept tokens. On LLaVA-NeXT (and, carried over,
    LLaVA-OneVision) the selection runs over every token of the image in the order the decoder receives them, the
    newline tokens among them, as the official LLaVA-1.6 code does (`whole_count` of them kept); the count in the
    accounting is then the visual tokens kept less the newlines dropped (`PruneState.cut`)."""

    name = "divprune"
    embeds = True
    whole_tokens = True

    def select(self, state, cut):
        k = state.kept_count(cut.index)
        if cut.whole_embeds is None:
            chosen = torch.stack([select(tokens, k) for tokens in cut.embeds])
            return Selection(chosen.to(state.visual_pos.device))
        n, r = cut.embeds.shape[1], cut.whole_embeds.shape[1]
        total = whole_count(k, n, r)
        order = torch.cat([state.visual_pos, state.whole_pos], 1).argsort(1).to(cut.embeds.device)  # [B, n + r]
        tokens = torch.cat([cut.embeds, cut.whole_embeds.to(cut.embeds)], 1)
        picks = [o[select(t[o], total)] for t, o in zip(tokens, order)]  # indices into [visual, whole]
        if len({int((p < n).sum()) for p in picks}) > 1:
            raise ValueError("method='divprune' keeps different numbers of newline tokens in the samples of this "
                             "batch: run them one at a time")
        chosen = torch.stack([p[p < n].sort().values for p in picks])
        whole = torch.zeros(len(picks), r, dtype=torch.bool, device=cut.embeds.device)
        for b, p in enumerate(picks):
            whole[b, p[p >= n] - n] = True
        return Selection(chosen.to(state.visual_pos.device), whole=whole)


PRUNER = DivPrune
