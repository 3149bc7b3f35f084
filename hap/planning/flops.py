"""FLOPs accounting, layer groups and per-group visual-token budgets (docs/method.md §4, §8): the arithmetic, which
knows no method (planning a method's schedule with its pruner is `hap.planning.budget`).

One convention for every method: per decoder layer and n tokens in the sequence, multiply-accumulates

    q, o projections     2 n d^2
    k, v projections     2 n d d_kv          (d_kv = kv_heads * head_dim; = d without GQA)
    attention            2 n^2 d             (q k^T and attention @ v)
    gated FFN            3 n d m

which is 4nd^2 + 2n^2d + 3ndm for multi-head attention (the SparseVLM / AutoPrune / FitPrune
convention). Prefill FLOPs are the sum over layers; the FLOPs ratio compares a schedule with the
unpruned one on the same sequence. "Retained visual tokens" is the plain average over ALL decoder
layers of the visual tokens present in each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

FLOPS_CONVENTION = ("MACs per layer: 2nd*d_q + 2n*d*d_kv + 2n*min(n, w)*d_q + 3ndm (= 4nd^2+2n^2d+3ndm without "
                    "GQA, with d_q = d and no sliding window w)")


@dataclass(frozen=True)
class DecoderShape:
    """The decoder dimensions the accounting needs."""

    layers: int
    hidden: int  # d
    intermediate: int  # m, gated FFN width
    kv_dim: int  # d_kv = num_key_value_heads * head_dim
    windows: tuple[int | None, ...] = ()  # [layers] each layer's sliding window (None: full attention); (): all full
    q_dim: int | None = None  # d_q = num_attention_heads * head_dim where it differs from d (Gemma 3), else None

    @classmethod
    def mha(cls, layers: int, hidden: int, intermediate: int) -> "DecoderShape":
        return cls(layers, hidden, intermediate, hidden)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens, None where it attends over every earlier token."""
        return self.windows[layer] if self.windows else None


def layer_flops(n: int | float, shape: DecoderShape, window: int | None = None) -> int | float:
    """Multiply-accumulates of one decoder layer over a sequence of n tokens (exact for integer n;
    fractional n serves the continuous budget solve). A sliding-window layer (`window` tokens) scores each query
    against at most `window` keys: its attention term counts n * min(n, window) query-key pairs, not n^2."""
    d, m = shape.hidden, shape.intermediate
    q = shape.q_dim or d
    keys = n if window is None else min(n, window)
    return 2 * n * d * q + 2 * n * d * shape.kv_dim + 2 * n * keys * q + 3 * n * d * m


def prefill_flops(visual_per_layer: list[int], text_tokens: int, shape: DecoderShape) -> int:
    """Prefill MACs when layer l holds `visual_per_layer[l]` visual tokens and every text token."""
    return sum(layer_flops(text_tokens + v, shape, shape.window(l)) for l, v in enumerate(visual_per_layer))


@dataclass
class Schedule:
    """Which decoder layers run on how many visual tokens.

    `cuts[g]` is the first layer of group g; group g spans layers [cuts[g], cuts[g+1]) (the last
    one ends at the last layer) and keeps `kept[g]` of the visual tokens present before it, plus `recycled[g]`
    cluster means of the dropped ones (SparseVLM, AutoPrune; `hap.pruners.recycle`).
    """

    num_visual: int
    num_layers: int
    cuts: list[int]
    kept: list[int]
    target_retain: float | None = None
    notes: list[str] = field(default_factory=list)
    recycled: list[int] = field(default_factory=list)  # [groups] recycled tokens added at each cut; empty: none
    budget: int | None = None  # the official budget T of sparsevlm / autoprune (their accounting, `official_tokens`)
    last_drop: int | None = None  # visual tokens after the last layer's own drop (AutoPrune cuts there too)
    planned: list[int] = field(default_factory=list)  # [groups] the budget's counts where the rule keeps others
    #                                                   (`kept`: DART's 4 + 8T, downsample's pooled grid); empty: same

    @property
    def visual_per_layer(self) -> list[int]:
        """[layers] visual tokens present in each decoder layer (what it processes; recycled tokens included)."""
        counts = [self.num_visual] * self.num_layers
        for g, start in enumerate(self.cuts):
            end = self.cuts[g + 1] if g + 1 < len(self.cuts) else self.num_layers
            counts[start:end] = [self.kept[g] + (self.recycled[g] if self.recycled else 0)] * (end - start)
        return counts

    @property
    def official_tokens(self) -> float:
        """The SparseVLM / AutoPrune accounting: visual tokens after each layer's drop, averaged over the layers
        (a cut layer counted at its post-drop count, not at what it processed)."""
        per = self.visual_per_layer
        after = per[1:] + [per[-1] if self.last_drop is None else self.last_drop]
        return sum(after) / self.num_layers

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """[(start, end)] decoder-layer range of each group."""
        ends = self.cuts[1:] + [self.num_layers]
        return list(zip(self.cuts, ends))

    @property
    def retained_tokens(self) -> float:
        """Visual tokens present, averaged over all decoder layers."""
        return sum(self.visual_per_layer) / self.num_layers

    @property
    def retain(self) -> float:
        return self.retained_tokens / self.num_visual

    def flops_ratio(self, text_tokens: int, shape: DecoderShape) -> float:
        full = prefill_flops([self.num_visual] * self.num_layers, text_tokens, shape)
        return prefill_flops(self.visual_per_layer, text_tokens, shape) / full


def group_cuts(num_layers: int, first_layers: int, groups: int) -> list[int]:
    """First layer of each of `groups` near-equal contiguous groups of layers [first_layers, num_layers)."""
    span = num_layers - first_layers
    if first_layers >= num_layers:
        raise ValueError(f"first_layers={first_layers} must be < the decoder's {num_layers} layers")
    if groups > span:
        raise ValueError(
            f"groups={groups} must be <= {span}: layers [{first_layers}, {num_layers}) cannot be split into more groups"
        )
    return [first_layers + (g * span) // groups for g in range(groups)]


def _counts(log_k1: float, log_decay: float, groups: int, num_visual: int) -> list[float]:
    """Continuous group budgets k_g = k_1 * decay^(g-1), within [1, num_visual], from log k_1 and log decay (no
    overflow or underflow for any decay in (0, 1])."""
    log_n = math.log(num_visual)
    return [max(1.0, math.exp(min(log_n, log_k1 + g * log_decay))) for g in range(groups)]


def _round_counts(counts: list[float], num_visual: int, fits: Callable[[list[int]], bool]) -> list[int]:
    """Integer budgets that do not exceed the continuous ones' target: each count rounded down (at least 1,
    non-increasing), then single tokens added back, earliest group first, while `fits` (the target still holds)."""
    kept: list[int] = []
    for c in counts:
        kept.append(max(1, min(math.floor(c + 1e-9), num_visual if not kept else kept[-1])))
    grown = True
    while grown:
        grown = False
        for g in range(len(kept)):
            more = kept[:g] + [kept[g] + 1] + kept[g + 1:]
            if more[g] <= (kept[g - 1] if g else num_visual) and fits(more):
                kept, grown = more, True
    return kept


def solve_schedule(
    num_visual: int,
    shape: DecoderShape,
    *,
    first_layers: int,
    groups: int,
    decay: float,
    retain: float | None = None,
    flops_ratio: float | None = None,
    text_tokens: int = 0,
) -> Schedule:
    """Solve k_1 (then k_g = k_1 * decay^(g-1), within [1, num_visual]) so the schedule hits the target.

    The target is the layer-averaged retained fraction `retain`, or the prefill FLOPs ratio
    `flops_ratio` (which depends on `text_tokens`). log k_1 is found by bisection on the continuous
    schedule, then the counts are rounded so the realised schedule never exceeds the target (`_round_counts`);
    a shortfall of more than one token per layer is reported in `notes`.
    Raises ValueError when the target is below what the first `first_layers` full layers and one token per
    group already cost.
    """
    if (retain is None) == (flops_ratio is None):
        raise ValueError("solve_schedule needs exactly one of retain or flops_ratio")
    L = shape.layers
    cuts = group_cuts(L, first_layers, groups)
    lengths = [e - s for s, e in zip(cuts, cuts[1:] + [L])]
    full_flops = prefill_flops([num_visual] * L, text_tokens, shape)

    def achieved(counts: list[float]) -> float:
        per_layer = [float(num_visual)] * first_layers
        for length, c in zip(lengths, counts):
            per_layer += [c] * length
        if retain is not None:
            return sum(per_layer) / (L * num_visual)
        return prefill_flops(per_layer, text_tokens, shape) / full_flops

    target = retain if retain is not None else flops_ratio
    name = "retain" if retain is not None else "flops_ratio"
    if achieved([num_visual] * groups) <= target:  # every layer keeps everything
        return Schedule(num_visual, L, cuts, [num_visual] * groups, retain)
    floor = achieved([1] * groups)
    if target < floor:
        raise ValueError(
            f"{name}={target:g} is unreachable: with first_layers={first_layers} of {L} decoder layers keeping all "
            f"{num_visual} visual tokens and at least one token per group, the minimum is {floor:.4f}; lower "
            f"first_layers (0 prunes before the first layer) or raise {name}"
        )
    log_decay = math.log(decay)
    lo, hi = -1.0, math.log(num_visual) - (groups - 1) * log_decay  # at hi every group keeps everything
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if achieved(_counts(mid, log_decay, groups, num_visual)) < target else (lo, mid)
    counts = _counts(lo, log_decay, groups, num_visual)
    kept = _round_counts(counts, num_visual, lambda k: achieved(k) <= target * (1 + 1e-12))
    schedule = Schedule(num_visual, L, cuts, kept, retain)
    short = (first_layers * num_visual + sum(n * c for n, c in zip(lengths, counts))) / L - schedule.retained_tokens
    if short > 1:
        schedule.notes.append(f"integer rounding keeps {short:.2f} visual tokens per layer fewer than {name}={target:g} "
                              f"asks (realised retain {schedule.retain:.4f})")
    return schedule
