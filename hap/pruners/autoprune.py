"""AutoPrune as its official code runs it (`AutoLab-SAI-SJTU/AutoPrune@e4a99184`; docs/method.md §7).

For a budget of T tokens (the official "target token num": visual tokens after each layer's drop, averaged over
all layers, layer 0 counted at S, recycled tokens included):
- layer-0 cut (after layer 0, no recycling): score(v) = prior(v) + 0.3 MI_0 mean_heads mean_text A0[t, v], where
  prior is the vision tower's [CLS] -> patch attention at the feature layer averaged over its heads, A0 layer 0's
  attention probabilities and MI_0 = (1/n) sum_h MI(A0_h[text, visual]) over the n text rows; the top
  S = min(int(2.5 T), N) stay;
- at layer 1, MI_1 = sum_h MI(A1_h[text, visual]) sets the slope k = max(k0 - gamma MI_1, 0) of the keep fractions
  kp_l = 0.75 / (1 + exp(k (l - x0 - k))) for l = 1..L-1, scaled by one common factor found by the official
  bisection so the budget is met (`keep_fractions`);
- after every layer l >= 1: the top min(ceil((S - 1) kp_l), V) by layer l's attention (mean over heads, then over
  all text rows) stay, the dropped ones are recycled (`hap.pruners.recycle`); positions are renumbered after every drop.

MI(a) of one head's rows a [n, V] (softmax rows, not renormalised over the visual columns): p(x) = 1/n,
p(x, y) = a / n, p(y) = sum_x p(x, y), MI = sum p(x, y) log2 max(p(x, y) / (p(x) p(y) + 1e-6), 1e-6).

Carried over to other decoders (ours): the logistic is defined on LLaVA's 32 layers, so on L layers layer l is
evaluated at its relative depth 32 l / L (identical on 32 layers); S, the budget and MI are unchanged. Pure functions,
then the pruner (`AutoPrune`) on the shared executor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..planning.flops import Schedule
from .base import Official
from .recycle import cluster_count

X0, K0, GAMMA = 14.9, 0.4, 0.2  # the official defaults for every budget, benchmark and model size
PRIOR_WEIGHT = 0.3  # weight of the MI-scaled text score at the layer-0 cut
FIRST_KEEP = 2.5  # S = min(int(2.5 T), N)
REFERENCE_LAYERS = 32
EPS = 1e-6


@dataclass
class Curve:
    """The schedule AutoPrune chose for one prefill (reported per run)."""

    budget: int  # T, the official target token count
    first_keep: int  # S, kept by the layer-0 cut
    mi0: float  # MI_0 (divided by the text rows)
    mi1: float  # MI_1 (summed over heads)
    slope: float  # k = max(k0 - gamma MI_1, 0)
    scale: float  # the bisection's common factor
    fractions: list[float]  # kp_l for l = 1..L-1, scaled, not clipped
    keeps: list[int]  # tokens kept by the cut after layer l, l = 1..L-1, before recycling
    counts: list[int]  # visual tokens after layer l's drop, l = 0..L-1 (S first, recycled ones included)


def mutual_information(attn: torch.Tensor) -> torch.Tensor:
    """MI of each head: `attn [..., n, V]` softmax rows of n text queries over the V visual keys -> `[...]` (bits)."""
    a = attn.float()
    n = a.shape[-2]
    p_xy = a / n
    p_y = p_xy.sum(-2, keepdim=True)
    ratio = p_xy / (p_y / n + EPS)
    return (p_xy * torch.log2(ratio.clamp_min(EPS))).sum((-1, -2))


def first_keep(budget: int, num_visual: int) -> int:
    """S = min(int(2.5 T), N), the tokens the layer-0 cut keeps."""
    return min(int(FIRST_KEEP * budget), num_visual)


def first_cut_scores(prior: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the layer-0 cut for one sample: `prior [N]` the [CLS] attention (mean over the tower's heads),
    `attn [heads, n, N]` layer 0's text rows over the visual keys -> (scores [N], MI_0 [])."""
    mi0 = mutual_information(attn).sum() / attn.shape[-2]
    return prior.float() + PRIOR_WEIGHT * mi0 * attn.float().mean(0).mean(0), mi0


def slope(mi1: float, k0: float = K0, gamma: float = GAMMA) -> float:
    """k = max(k0 - gamma MI_1, 0) (the 'linear' mode)."""
    return max(k0 - gamma * mi1, 0.0)


def logistic(num_layers: int, k: float, x0: float = X0) -> list[float]:
    """kp_l = 0.75 / (1 + exp(k (u_l - x0 - k))) for l = 1..L-1, u_l = 32 l / L the layer's place on LLaVA's depth."""
    return [0.75 / (1 + math.exp(k * (REFERENCE_LAYERS * l / num_layers - x0 - k))) for l in range(1, num_layers)]


def keep_count(first: int, fraction: float, present: int) -> int:
    """Tokens the cut after a layer keeps: min(ceil((S - 1) kp), V), the product in float32 as upstream."""
    return min(math.ceil(float(torch.tensor(first - 1) * fraction)), present)


def budget_counts(fractions: list[float], first: int) -> list[int]:
    """The official budget estimate (`cal_sum_tokens_no_membership`): visual tokens after each layer's drop,
    S at layer 0, then keep_l = ceil((S - 1) min(1, kp_l)) plus its recycled tokens."""
    counts = [first]
    for f in fractions:
        keep = math.ceil((first - 1) * min(1.0, f))
        counts.append(keep + cluster_count(counts[-1] - keep))
    return counts


def keep_fractions(k: float, first: int, budget: int, num_layers: int, x0: float = X0) -> tuple[list[float], float]:
    """The official `generate_keep_percent_abs`: (fractions kp_l for l = 1..L-1, the common scale) so that the
    budget estimate sums to L x T: the unscaled curve when a coarse estimate lands within 1 of it, else the
    bisection on a scale in [0, 20] (200 steps at most, stopping once within 0.01), scaled, not clipped."""
    curve = logistic(num_layers, k, x0)
    target = num_layers * budget
    coarse, before, used = 0, 0, first
    for l, f in enumerate(curve, start=1):
        used = int(first * f)
        coarse += used * (l - before)
        before = l
    coarse += used * (num_layers - before)
    if abs(coarse - target) < 1:
        return curve, 1.0
    low, high, best, least = 0.0, 20.0, 1.0, math.inf
    for _ in range(200):
        mid = (low + high) / 2
        total = sum(budget_counts([f * mid for f in curve], first))
        if abs(total - target) < least:
            least, best = abs(total - target), mid
            if least < 0.01:
                break
        low, high = (mid, high) if total < target else (low, mid)
    return [f * best for f in curve], best


def run_counts(fractions: list[float], first: int) -> tuple[list[int], list[int]]:
    """(keeps, counts) as the cuts run them: after layer l, keep_count of the V present, then its recycled tokens;
    counts[0] = S (after layer 0), counts[l] after layer l's drop."""
    keeps, counts = [], [first]
    for f in fractions:
        keeps.append(keep_count(first, f, counts[-1]))
        counts.append(keeps[-1] + cluster_count(counts[-1] - keeps[-1]))
    return keeps, counts


def curve(budget: int, num_visual: int, num_layers: int, mi1: float, mi0: float = math.nan,
          k0: float = K0, gamma: float = GAMMA, x0: float = X0) -> Curve:
    """The schedule for budget T on `num_visual` tokens and `num_layers` layers given MI_1 (and MI_0, reported)."""
    first = first_keep(budget, num_visual)
    k = slope(mi1, k0, gamma)
    fractions, scale = keep_fractions(k, first, budget, num_layers, x0)
    keeps, counts = run_counts(fractions, first)
    return Curve(budget, first, mi0, mi1, k, scale, fractions, keeps, counts)


def schedule(chosen: Curve, num_visual: int, num_layers: int) -> Schedule:
    """AutoPrune's schedule from its curve `chosen`: a cut after every layer, S after layer 0 (nothing recycled
    there)."""
    recycled = [0] + [n - k for n, k in zip(chosen.counts[1:], chosen.keeps)]
    return Schedule(num_visual, num_layers, list(range(1, num_layers)), [chosen.first_keep, *chosen.keeps[:-1]],
                    recycled=recycled[:-1], budget=chosen.budget, last_drop=chosen.counts[-1])


class AutoPrune(Official):
    """A cut after every layer, scored by every text row: the layer-0 one adds the [CLS] prior and MI_0 (and recycles
    nothing), layer 1's MI_1 sets the schedule. One prompt at a time (batch 1)."""

    name = "autoprune"
    cls_cues = True
    max_batch = 1
    batch_rule = "its schedule follows each prompt's mutual information, as the official code's batch of 1"

    def curve(self, state):
        """The curve layer 1's MI_1 chose (`Curve` as a dict), None before it."""
        chosen = state.memo.get("curve")
        return None if chosen is None else asdict(chosen)

    @classmethod
    def official_schedule(cls, budget, num_visual, num_layers):
        """Its schedule before layer 1 sets its curve, at MI_1 = 0 (the steepest curve: the most tokens processed
        for the budget)."""
        return schedule(curve(budget, num_visual, num_layers, mi1=0.0), num_visual, num_layers)

    def recycles(self, cut_index):
        return cut_index != 0

    def scores(self, state, cut):
        """The first two cuts' scores (batch 1). The layer-0 cut: the [CLS] prior (mean over the tower's heads) plus
        0.3 MI_0 times the text rows' head-mean attention. The layer-1 cut: MI_1 sets the curve, which replaces the
        planned schedule (same budget T), then the plain head-mean row-mean scores. Later cuts: those."""
        if cut.index >= 2:
            return super().scores(state, cut)
        a = cut.attn[0, 0][:, state.row_valid[0]]  # [H, n, V] the text rows of the scoring layer
        if cut.index == 0:
            cues = state.cues()
            scores, mi0 = first_cut_scores(cues.cls_attention[0] / cues.heads, a)
            state.memo["mi0"] = float(mi0)
            return scores[None]
        s = state.schedule
        chosen = curve(s.budget, s.num_visual, s.num_layers, float(mutual_information(a).sum()), state.memo["mi0"])
        state.memo["curve"] = chosen
        planned = schedule(chosen, s.num_visual, s.num_layers)
        s.kept, s.recycled, s.last_drop = planned.kept, planned.recycled, planned.last_drop
        return a.mean(0).mean(0)[None]


PRUNER = AutoPrune
