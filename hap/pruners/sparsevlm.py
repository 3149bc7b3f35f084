"""SparseVLM v1.5 as its official code runs it (`Gumpest/SparseVLMs@v1.5`; docs/method.md §7).

- Raters, once before layer 0, from the decoder's input embeddings: m_t = mean over visual tokens v of softmax over
  the text tokens t of <e_v, e_t> (no scaling); the raters are the text tokens with m_t above the mean of m.
  "Text" is everything after the visual block (the chat template's tail included).
- Cuts after layers 2, 6 and 15 of LLaVA's 32: each scored by that layer's own attention probabilities, averaged
  over all heads, then over the raters' rows; the top min(K_s, V - 1) stay in order, the dropped ones are recycled
  (`hap.pruners.recycle`), positions are renumbered 0..T'-1.
- K_s comes from fixed lists per budget T (the "retained tokens" of the paper: visual tokens after each layer's drop,
  averaged over the 32 layers, recycled ones included): 64 -> 66/30/17, 128 -> 303/110/36, 192 -> 300/200/110.

Carried over to other decoders (ours, docs/method.md §7): the cut layers sit at the same relative depth,
`round(l x L / 32)` (made strictly increasing), and the counts at the same share of the visual tokens: for the budget
share t = T / N, each stage keeps the share the official lists give at 64/576, 128/576 and 192/576, linearly
interpolated between them, scaled down proportionally below 64/576 and interpolated up to all tokens at t = 1. On
LLaVA-1.5 (576 tokens, 32 layers) at T = 64, 128 or 192 this is the official list exactly. Pure functions,
then the pruner (`SparseVLM`) on the shared executor.
"""

from __future__ import annotations

import torch

from ..planning.flops import Schedule
from .base import Official
from .recycle import cluster_count

REFERENCE_LAYERS = 32  # LLaVA-1.5's decoder, where the official layers are defined
REFERENCE_TOKENS = 576  # LLaVA-1.5's visual tokens, where the official lists are defined
PRUNE_LAYERS = (2, 6, 15)  # the layers whose output is cut (v1.5 M:69)
STAGE_LISTS = {64: (66, 30, 17), 128: (303, 110, 36), 192: (300, 200, 110)}  # v1.5 score.py:7-9


def raters(visual: torch.Tensor, text: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The text raters: `visual [batch, N, D]` and `text [batch, P, D]` input embeddings, `valid` bool [batch, P]
    (the real text rows) -> bool [batch, P], the rows with m_t > mean(m) among the valid ones."""
    logits = visual.float() @ text.float().transpose(1, 2)  # [B, N, P]
    m = logits.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1).mean(1)  # [B, P]
    mean = (m * valid).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True)
    return valid & (m > mean)


def prune_layers(num_layers: int) -> list[int]:
    """The layers whose output is cut on a decoder of `num_layers`: 2, 6, 15 at the same relative depth, strictly
    increasing, the last below the last layer (on 32 layers: 2, 6, 15)."""
    if num_layers < len(PRUNE_LAYERS) + 1:
        raise ValueError(f"sparsevlm cuts after {len(PRUNE_LAYERS)} layers and needs a decoder of at least "
                         f"{len(PRUNE_LAYERS) + 1} layers; this one has {num_layers}")
    out: list[int] = []
    for i, l in enumerate(PRUNE_LAYERS):
        lowest = out[-1] + 1 if out else 0
        highest = num_layers - 1 - (len(PRUNE_LAYERS) - i)
        out.append(min(max(round(l * num_layers / REFERENCE_LAYERS), lowest), highest))
    return out


def stage_keeps(budget: int, num_visual: int) -> list[int]:
    """K_s, the tokens each stage keeps before recycling, for the official budget `budget` of `num_visual` tokens
    (the official list on 576 tokens at 64/128/192; interpolated on the share of tokens elsewhere, see above)."""
    if num_visual == REFERENCE_TOKENS and budget in STAGE_LISTS:
        return list(STAGE_LISTS[budget])
    share = budget / num_visual
    anchors = sorted((t / REFERENCE_TOKENS, [k / REFERENCE_TOKENS for k in ks]) for t, ks in STAGE_LISTS.items())
    anchors = [(0.0, [0.0] * len(PRUNE_LAYERS))] + anchors + [(1.0, [1.0] * len(PRUNE_LAYERS))]
    for (t0, k0), (t1, k1) in zip(anchors, anchors[1:]):
        if share <= t1:
            w = (share - t0) / (t1 - t0)
            return [max(1, round(((1 - w) * a + w * b) * num_visual)) for a, b in zip(k0, k1)]
    return [num_visual] * len(PRUNE_LAYERS)


def stage_counts(budget: int, num_visual: int) -> tuple[list[int], list[int]]:
    """(kept, recycled) per stage as the official code runs them: min(K_s, V - 1) kept of the V present, then
    `cluster_count` of the dropped recycled; V for the next stage is their sum."""
    kept, recycled, present = [], [], num_visual
    for k in stage_keeps(budget, num_visual):
        k = max(1, min(k, present - 1))
        kept.append(k)
        recycled.append(cluster_count(present - k))
        present = k + recycled[-1]
    return kept, recycled


def schedule(budget: int, num_visual: int, num_layers: int) -> Schedule:
    """SparseVLM v1.5's schedule for the official budget `budget`: a cut after each of `prune_layers`."""
    kept, recycled = stage_counts(budget, num_visual)
    cuts = [l + 1 for l in prune_layers(num_layers)]
    return Schedule(num_visual, num_layers, cuts, kept, recycled=recycled, budget=budget)


class SparseVLM(Official):
    """Its cuts scored by the raters' rows."""

    name = "sparsevlm"
    fixed_rows = "raters"
    reads_input = True

    def on_input(self, state, embeds):
        """Its raters from the decoder's input embeddings `embeds` [batch, T, D] (`raters`): from here on only their
        rows score (the head statistics too)."""
        rows = state.row_positions(embeds.shape[1]).to(embeds.device)
        gather = lambda pos: embeds.gather(1, pos[..., None].expand(-1, -1, embeds.shape[-1]))
        chosen = raters(gather(state.visual_pos.to(embeds.device)), gather(rows), state.row_valid.to(embeds.device))
        state.row_valid = chosen.to(state.row_valid.device)

    @classmethod
    def official_schedule(cls, budget, num_visual, num_layers):
        return schedule(budget, num_visual, num_layers)


PRUNER = SparseVLM
