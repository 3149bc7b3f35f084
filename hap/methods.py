"""HAP and the baselines as scoring policies on one executor (docs/method.md §7).

Every method runs through the same cuts, the same FLOPs accounting and the same selection; a
policy only says how many groups there are, which prompt rows and which captured layers score a
cut, and how heads are weighted:

    method    groups     rows                  layers scoring a cut       head weights        positions after a cut
    hap       G          config.rows           the previous segment (or its last layer) softmax(PAQ / T)  original
    uniform   G          config.rows           the whole previous segment uniform (T = inf)          original
    pdrop     G          last token            the next layer (lookahead) uniform                    renumbered
    pdrop_ours G         last token            the segment's last layer   uniform                    original
    fastv     1 (at K)   last token            layer K-1                  uniform                    original
    random    G          -                     -                          seeded uniform choice      original
    visionzip 1, at 0    -                     - (the vision tower's [CLS] attention, `hap.visionzip`)  renumbered
    sparsevlm 3 (official) raters, mean          the layer that just ran    uniform, + recycling  renumbered
    autoprune L-1 (every)  all text rows, mean   the layer that just ran    uniform, + [CLS] prior at layer 0,
                                                                          MI-driven schedule, + recycling  renumbered
    none      no cuts

`pdrop` and `visionzip` follow their official code (docs/method.md §7): PyramidDrop scores the cut entering
layer l with layer l's own norm, q/k projections and RoPE applied to the tokens about to enter it, and both
renumber positions 0..T'-1 after a drop (RoPE distances between the remaining tokens shrink); HAP and the
other methods keep each token's original position. `sparsevlm` (v1.5) and `autoprune` follow theirs too
(`hap.sparsevlm`, `hap.autoprune`, `hap.recycle`): each cut is scored by the attention of the layer that just ran,
averaged over heads and then over the scoring rows (not the L2 norm over rows), its dropped tokens are partly
recycled into cluster means placed after the kept ones, and positions are renumbered. `pdrop_ours` is our earlier PyramidDrop variant, reported as
ours: FastV's rule at every cut of the pyramid (the last token's attention in the layer that just ran), original
positions kept (on the shipped model it scored above the official rule, docs/method.md §7).

HAP's own knobs beyond the paper (docs/method.md §10: `head_weight`, `sink_ranking`, `score_layers`,
`merge`, `first_cut`)
shape the `hap` policy only; the baselines score as published (`rows` applies to `uniform` too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import HAPConfig
from .fusion import fuse, fusion_weights, row_mean, token_scores


@dataclass(frozen=True)
class Policy:
    groups: int  # 0 = no pruning
    rows: str  # "prompt", "last", "question" or "raters" (SparseVLM's, chosen among the prompt rows before layer 0)
    whole_segment: bool  # score with every layer of the previous segment, else only its last layer
    temperature: float  # inf = plain head averaging
    random: bool = False
    visual_weights: bool = False  # head weights x visual share (head_weight="paq_visual")
    sink_ranking: str = "keep"  # sink tokens at a cut: "keep", "mask" or "mask_keep_one"
    first_cut: str = "attention"  # a cut before layer 0 scored by layer 0's attention, its pre-RoPE q.k, or [CLS]
    merge: str = "none"  # dropped tokens folded into the kept ones: "none", "average" or "proportional" (+ log-size bias)
    vision: bool = False  # VisionZip: one cut before layer 0 from the vision tower's [CLS] attention
    lookahead: bool = False  # score every cut with the next layer's attention on the tokens about to enter it
    renumber: bool = False  # positions 0..T'-1 after each cut (the official PyramidDrop / VisionZip), else original
    mean_rows: bool = False  # a token's score is the mean over the scoring rows (SparseVLM, AutoPrune), else the L2 norm
    recycle: bool = False  # the dropped tokens' cluster means join the kept ones (SparseVLM, AutoPrune; hap.recycle)
    autoprune: bool = False  # the layer-0 cut adds the [CLS] prior and MI_0, layer 1's MI_1 sets the schedule

    @property
    def needs_maps(self) -> bool:
        """Whether the cuts are scored by decoder attention maps (not random, not vision-side)."""
        return not (self.random or self.vision)

    @property
    def needs_cls(self) -> bool:
        """Whether a cut uses the vision tower's [CLS] attention (VisionZip, or first_cut="vision")."""
        return self.vision or self.autoprune or (self.groups > 0 and self.first_cut == "vision")


def policy_for(config: HAPConfig) -> Policy:
    m = config.method
    if m == "none":
        return Policy(0, config.rows, True, math.inf)
    if m == "hap":
        return Policy(config.groups, config.rows, config.score_layers == "segment", config.temperature,
                      visual_weights=config.head_weight == "paq_visual", sink_ranking=config.sink_ranking,
                      first_cut=config.first_cut, merge=config.merge)
    if m == "uniform":
        return Policy(config.groups, config.rows, True, math.inf)
    if m == "pdrop":
        return Policy(config.groups, "last", False, math.inf, lookahead=True, renumber=True)
    if m in ("fastv", "pdrop_ours"):  # pdrop_ours: FastV's cut at every group boundary
        return Policy(1 if m == "fastv" else config.groups, "last", False, math.inf)
    if m == "visionzip":
        return Policy(1, config.rows, False, math.inf, vision=True, renumber=True)
    if m in ("sparsevlm", "autoprune"):  # the groups come from their official schedule (hap.budget.solve_budget)
        return Policy(1, "raters" if m == "sparsevlm" else "prompt", False, math.inf, renumber=True, mean_rows=True,
                      recycle=True, autoprune=m == "autoprune")
    return Policy(config.groups, config.rows, False, math.inf, random=True)


def scoring_layers(policy: Policy, segment: tuple[int, int]) -> list[int]:
    """Layers whose maps score the cut that follows `segment` = [start, end).

    A cut before layer 0 has no layer behind it; it looks ahead at layer 0's own attention over
    the full input (as PyramidDrop scores every cut with the next layer's queries and keys), unless HAP's
    first_cut="vision" scores it by the vision tower's [CLS] attention (docs/method.md §10). A lookahead
    policy (pdrop) scores every cut with layer `end` itself (`looks_ahead`).
    """
    start, end = segment
    if not policy.needs_maps:
        return []
    if looks_ahead(policy, segment):
        return [] if start == end and policy.first_cut == "vision" else [end]
    return list(range(start, end)) if policy.whole_segment else [end - 1]


def looks_ahead(policy: Policy, segment: tuple[int, int]) -> bool:
    """Whether the cut after `segment` = [start, end) is scored by layer `end` before it runs (on the tokens about
    to enter it), rather than by layers that ran: always for a lookahead policy, and for a cut before layer 0."""
    return policy.lookahead or segment[0] == segment[1]


def recycles(policy: Policy, cut_index: int) -> bool:
    """Whether cut `cut_index` recycles its dropped tokens: every cut of SparseVLM, AutoPrune's but its layer-0 one."""
    return policy.recycle and not (policy.autoprune and cut_index == 0)


def head_weights(policy: Policy, paq: torch.Tensor, visual_share: torch.Tensor) -> torch.Tensor:
    """The fusion weights of the scoring heads, `paq`, `visual_share` [batch, layers, heads] -> the same shape,
    summing to 1 per sample: softmax(PAQ / T), times the visual share where the policy says so."""
    return fusion_weights(paq, policy.temperature, visual_share if policy.visual_weights else None)


def rank_sinks(scores: torch.Tensor, sink: torch.Tensor, mode: str) -> torch.Tensor:
    """Scores with the sink tokens moved in the ranking (docs/method.md §10): `scores [batch, visual]`,
    `sink` bool [batch, visual]; "keep": unchanged; "mask": sinks last; "mask_keep_one": sinks last except
    the best-scored sink of each sample, first (an anchor)."""
    if mode == "keep":
        return scores
    out = scores.masked_fill(sink, -math.inf)
    if mode == "mask_keep_one":
        best = scores.masked_fill(~sink, -math.inf).argmax(-1, keepdim=True)  # [B, 1]
        anchor = torch.zeros_like(sink).scatter_(1, best, True) & sink
        out = out.masked_fill(anchor, math.inf)
    return out


def cut_scores(
    policy: Policy,
    attn: torch.Tensor | None,
    weights: torch.Tensor | None,
    row_valid: torch.Tensor,
    num_visual: int,
    seed: int,
    cut_index: int,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of the visual tokens present at a cut, `[batch, visual]` (higher = keep).

    attn [batch, layers, heads, P, visual] and weights [batch, layers, heads] (`head_weights`) of the scoring
    layers; sink bool [batch, visual]: the tokens any scoring layer flagged as sinks (for `sink_ranking`).
    """
    if policy.random:
        gen = torch.Generator().manual_seed(seed * 1009 + cut_index)
        return torch.rand(num_visual, generator=gen).expand(row_valid.shape[0], -1)
    fused = fuse(attn, weights)
    scores = row_mean(fused, row_valid) if policy.mean_rows else token_scores(fused, row_valid)
    return scores if sink is None else rank_sinks(scores, sink, policy.sink_ranking)
