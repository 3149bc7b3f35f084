"""Planning a run's schedule with its method's pruner (docs/method.md §4, §7): the one planner of the executor, the
lmms-eval plugin, the sweep and the speed script. The arithmetic it solves with (FLOPs, groups, `solve_schedule`) is
`hap.planning.flops`; here the pruner says where it cuts (`groups`, `before_decoder`, `min_full_layers`), whether its official
code sets its own schedule (`official`) and what its rule really keeps (`realised`, `min_tokens`).
"""

from __future__ import annotations

from ..config import HAPConfig
from ..pruners import pruner_class, pruner_for
from .flops import DecoderShape, Schedule, group_cuts, prefill_flops, solve_schedule


def plan(config: HAPConfig, shape: DecoderShape, num_visual: int, text_tokens: int = 0,
         grids: tuple[tuple[int, int], ...] = ()) -> Schedule | None:
    """The schedule `config` asks for on a decoder of `shape` and a sequence of `num_visual` visual and
    `text_tokens` text tokens; None when the method does not prune. The one planner of the pruner, the
    lmms-eval plugin and the speed script: model-dependent defaults resolve here (`HAPConfig.resolved`),
    FastV gets its single cut at K, a pruner that cuts before the decoder (VisionZip) its single cut before layer 0
    (k = floor(retain x N) in every layer, at least its `min_tokens`), an official schedule (SparseVLM, AutoPrune)
    its budget (`solve_budget`), and an unreachable budget raises ValueError naming the knobs. `grids`: the (rows,
    cols) of each view's token grid, for a rule whose count depends on them (`Pruner.realised`; downsample)."""
    config = config.resolved(shape.layers)
    pruner = pruner_for(config)
    if not pruner.groups:
        return None
    if pruner.official:
        return solve_budget(config, shape, num_visual, text_tokens)
    full = _full_layers(config)
    try:
        schedule = solve_schedule(num_visual, shape, first_layers=full, groups=pruner.groups, decay=config.decay,
                                  retain=config.retain, flops_ratio=config.flops_ratio, text_tokens=text_tokens)
    except ValueError as err:
        if full > config.first_layers:  # the pruner's own floor, not the knob's
            raise ValueError(f"method={config.method!r} cuts entering layer {full} at the earliest (it reads the layer "
                             f"before its cut), whatever first_layers={config.first_layers} says: {err}") from err
        raise
    _check_min_tokens(config, shape, schedule, text_tokens)
    kept = [pruner.realised(k, num_visual, grids) for k in schedule.kept]
    if kept != schedule.kept:
        schedule.notes.append(f"method={config.method!r} keeps {kept} visual tokens where the budget plans "
                              f"{schedule.kept} (its rule's count): realised retain {_realised(schedule, kept):.4f}")
        schedule.planned, schedule.kept = schedule.kept, kept
    return schedule


def _realised(schedule: Schedule, kept: list[int]) -> float:
    """The retain of `schedule` with `kept` in place of its counts."""
    return Schedule(schedule.num_visual, schedule.num_layers, schedule.cuts, kept).retain


def official_schedule(method: str, budget: int, num_visual: int, num_layers: int) -> Schedule:
    """The schedule of an official-schedule `method` (sparsevlm, autoprune) at the official budget `budget`."""
    return pruner_class(method).official_schedule(budget, num_visual, num_layers)


def solve_budget(config: HAPConfig, shape: DecoderShape, num_visual: int, text_tokens: int) -> Schedule:
    """The schedule of sparsevlm / autoprune at the largest official budget T (an integer, by bisection) whose
    tokens processed per layer stay within `config`'s retain or FLOPs ratio, counted like every other method's
    (what each layer runs on, not the official post-drop accounting; docs/method.md §7)."""
    if config.retain is not None:
        name, target = "retain", config.retain
        achieved = lambda s: s.retain
    else:
        name, target = "flops_ratio", config.flops_ratio
        achieved = lambda s: s.flops_ratio(text_tokens, shape)
    build = lambda t: official_schedule(config.method, t, num_visual, shape.layers)
    lowest = build(1)
    if achieved(lowest) > target * (1 + 1e-12):
        raise ValueError(f"{name}={target:g} is unreachable for method={config.method!r}: its smallest budget "
                         f"processes {lowest.retained_tokens:.1f} of {num_visual} visual tokens per layer "
                         f"({name} {achieved(lowest):.4f}); raise {name}")
    lo, hi = 1, num_visual
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if achieved(build(mid)) <= target * (1 + 1e-12) else (lo, mid - 1)
    schedule = build(lo)
    schedule.target_retain = config.retain
    return schedule


def _check_min_tokens(config: HAPConfig, shape: DecoderShape, schedule: Schedule, text_tokens: int) -> None:
    """ValueError naming the budget knob when a cut keeps fewer visual tokens than the method's `min_tokens`
    (VisionZip: its [CLS] slot alone, no image token), with the smallest value of that knob that keeps enough."""
    least = pruner_class(config.method).min_tokens
    if min(schedule.kept) >= least:
        return
    n = schedule.num_visual
    if config.retain is not None:
        name, target, floor = "retain", config.retain, least / n
    else:
        name, target = "flops_ratio", config.flops_ratio
        floor = (prefill_flops([least] * shape.layers, text_tokens, shape)
                 / prefill_flops([n] * shape.layers, text_tokens, shape))
    raise ValueError(f"{name}={target:g} keeps {min(schedule.kept)} of {n} visual tokens, which under "
                     f"method={config.method!r} is too few: it needs at least {least} (`min_tokens`): raise {name} "
                     f"to at least {floor:.4f}")


def smallest_retain(config: HAPConfig, shape: DecoderShape, num_visual: int) -> float:
    """The smallest retain `plan` accepts for `config`'s method on `shape`: its first full layers keep all
    `num_visual` tokens and every later layer one (VisionZip: its `min_tokens` in every layer; 1.0 for a method that
    does not prune)."""
    config = config.resolved(shape.layers)
    pruner = pruner_for(config)
    if not pruner.groups:
        return 1.0
    if pruner.official:
        return official_schedule(config.method, 1, num_visual, shape.layers).retain
    full = _full_layers(config)
    group_cuts(shape.layers, full, pruner.groups)  # refuses the layouts `plan` refuses, naming the knob
    least = pruner.realised(pruner.min_tokens, num_visual)
    return (full * num_visual + (shape.layers - full) * least) / (shape.layers * num_visual)


def _full_layers(config: HAPConfig) -> int:
    """Decoder layers before the first cut: none for a pruner that cuts before the decoder (VisionZip), else
    first_layers, at least the pruner's `min_full_layers` (DART reads the layer before its cut)."""
    pruner = pruner_class(config.method)
    return 0 if pruner.before_decoder else max(config.first_layers, pruner.min_full_layers)
