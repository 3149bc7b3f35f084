"""HAP and the baselines as scoring policies on one executor (docs/method.md §7).

Every method runs through the same cuts, the same FLOPs accounting and the same selection; a
policy only says how many groups there are, which prompt rows and which captured layers score a
cut, and how heads are weighted:

    method    groups     rows                  layers scoring a cut       head weights
    hap       G          config.rows           the whole previous segment softmax(PAQ / T)
    uniform   G          config.rows           the whole previous segment uniform (T = inf)
    pdrop     G          last token            last layer of the segment  uniform
    fastv     1 (at K)   last token            layer K-1                  uniform
    random    G          -                     -                          seeded uniform choice
    none      no cuts
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import HAPConfig
from .fusion import group_map, token_scores


@dataclass(frozen=True)
class Policy:
    groups: int  # 0 = no pruning
    rows: str  # "prompt" or "last"
    whole_segment: bool  # score with every layer of the previous segment, else only its last layer
    temperature: float  # inf = plain head averaging
    random: bool = False


def policy_for(config: HAPConfig) -> Policy:
    m = config.method
    if m == "none":
        return Policy(0, config.rows, True, math.inf)
    if m == "hap":
        return Policy(config.groups, config.rows, True, config.temperature)
    if m == "uniform":
        return Policy(config.groups, config.rows, True, math.inf)
    if m == "pdrop":
        return Policy(config.groups, "last", False, math.inf)
    if m == "fastv":
        return Policy(1, "last", False, math.inf)
    return Policy(config.groups, config.rows, False, math.inf, random=True)


def scoring_layers(policy: Policy, segment: tuple[int, int]) -> list[int]:
    """Layers whose maps score the cut that follows `segment` = [start, end).

    A cut before layer 0 has no layer behind it; it looks ahead at layer 0's own attention over
    the full input (as PyramidDrop scores with the next layer's queries and keys).
    """
    start, end = segment
    if policy.random:
        return []
    if start == end:
        return [end]
    return list(range(start, end)) if policy.whole_segment else [end - 1]


def cut_scores(
    policy: Policy,
    attn: torch.Tensor | None,
    paq: torch.Tensor | None,
    row_valid: torch.Tensor,
    num_visual: int,
    seed: int,
    cut_index: int,
) -> torch.Tensor:
    """Scores of the visual tokens present at a cut, `[batch, visual]` (higher = keep).

    attn [batch, layers, heads, P, visual] and paq [batch, layers, heads] of the scoring layers.
    """
    if policy.random:
        gen = torch.Generator().manual_seed(seed * 1009 + cut_index)
        return torch.rand(num_visual, generator=gen).expand(row_valid.shape[0], -1)
    return token_scores(group_map(attn, paq, policy.temperature), row_valid)
