"""FLOPs accounting, groups and budgets against hand-computed figures (LLaVA-1.5-7B shape)."""

import math

import pytest

from hap import HAPConfig
from hap.planning.flops import DecoderShape, Schedule, group_cuts, layer_flops, prefill_flops, solve_schedule
from hap.planning.budget import plan

LLAVA7B = DecoderShape.mha(layers=32, hidden=4096, intermediate=11008)


def test_layer_flops_matches_the_convention_by_hand():
    n, d, m = 600, 4096, 11008
    assert layer_flops(n, LLAVA7B) == 4 * n * d * d + 2 * n * n * d + 3 * n * d * m


def test_gqa_shrinks_only_the_key_value_projections():
    gqa = DecoderShape(layers=1, hidden=4096, intermediate=11008, kv_dim=1024)
    n = 100
    assert layer_flops(n, LLAVA7B) - layer_flops(n, gqa) == 2 * n * 4096 * (4096 - 1024)


def test_fastv_k2_keeping_144_averages_171_tokens():
    s = Schedule(num_visual=576, num_layers=32, cuts=[2], kept=[144])
    assert s.visual_per_layer == [576, 576] + [144] * 30
    assert s.retained_tokens == (2 * 576 + 30 * 144) / 32 == 171


def test_flops_ratio_by_hand():
    s = Schedule(num_visual=576, num_layers=32, cuts=[2], kept=[144])
    text = 40
    full = 32 * layer_flops(616, LLAVA7B)
    pruned = 2 * layer_flops(616, LLAVA7B) + 30 * layer_flops(184, LLAVA7B)
    assert s.flops_ratio(text, LLAVA7B) == pruned / full
    assert prefill_flops(s.visual_per_layer, text, LLAVA7B) == pruned


def test_groups_split_layers_evenly():
    assert group_cuts(32, 2, 3) == [2, 12, 22]
    assert group_cuts(6, 0, 3) == [0, 2, 4]
    with pytest.raises(ValueError, match="groups=5"):
        group_cuts(6, 2, 5)
    with pytest.raises(ValueError, match="first_layers"):
        group_cuts(6, 6, 1)


@pytest.mark.parametrize("retain", [0.3, 0.222, 0.111, 0.07])
def test_solved_schedule_hits_retain_within_rounding(retain):
    s = solve_schedule(576, LLAVA7B, first_layers=2, groups=3, decay=0.5, retain=retain)
    assert s.cuts == [2, 12, 22]
    assert s.kept == sorted(s.kept, reverse=True)
    # each group's count is rounded once: the layer average moves by at most 0.5 token per group span
    assert abs(s.retained_tokens - retain * 576) <= 0.5 * 30 / 32 + 1e-9
    ratio = s.kept[1] / s.kept[0]
    assert abs(ratio - 0.5) < 0.1


def test_retain_below_the_first_layers_floor_is_refused_with_the_minimum():
    # 2 of 32 full layers alone average 36 of 576 tokens = 0.0625 > 0.056
    with pytest.raises(ValueError, match=r"retain=0.056 is unreachable.*minimum is 0\.06"):
        solve_schedule(576, LLAVA7B, first_layers=2, groups=3, decay=0.5, retain=0.056)
    s = solve_schedule(576, LLAVA7B, first_layers=1, groups=3, decay=0.5, retain=0.056)
    assert abs(s.retain - 0.056) < 0.002


def test_flops_target_is_met_and_consistent_with_retain():
    s = solve_schedule(576, LLAVA7B, first_layers=2, groups=3, decay=0.5, flops_ratio=0.3, text_tokens=40)
    assert abs(s.flops_ratio(40, LLAVA7B) - 0.3) < 0.01
    again = solve_schedule(576, LLAVA7B, first_layers=2, groups=3, decay=0.5, retain=s.retain)
    assert again.kept == s.kept


def test_full_budget_keeps_everything():
    s = solve_schedule(576, LLAVA7B, first_layers=2, groups=3, decay=0.5, retain=1.0)
    assert s.kept == [576, 576, 576] and s.retain == 1.0


def test_a_budget_below_one_token_per_group_is_refused_with_the_minimum():
    shape = DecoderShape.mha(layers=6, hidden=64, intermediate=128)
    with pytest.raises(ValueError, match=r"retain=0.001 is unreachable.*at least one token per group.*0\.0069"):
        solve_schedule(144, shape, first_layers=0, groups=3, decay=0.5, retain=0.001)
    assert solve_schedule(144, shape, first_layers=0, groups=3, decay=0.5, retain=1 / 144).kept == [1, 1, 1]


@pytest.mark.parametrize("decay, groups", [(1e-6, 30), (1e-12, 30), (1e-200, 3), (1e-200, 30), (1.0, 30)])
def test_extreme_decays_meet_the_request_or_are_refused(decay, groups):
    """Review finding: the bisection ran on k_1 up to N / decay^(G-1) (imprecise, or a division by zero)."""
    s = solve_schedule(576, LLAVA7B, first_layers=2, groups=groups, decay=decay, retain=0.2)
    assert 0.2 - 1 / 576 <= s.retain <= 0.2 + 1e-12
    assert s.kept == sorted(s.kept, reverse=True) and min(s.kept) >= 1
    with pytest.raises(ValueError, match="at least one token per group"):  # 2 full layers + 30 x 1 token > 0.0635
        solve_schedule(576, LLAVA7B, first_layers=2, groups=30, decay=decay, retain=0.0635)


def test_rounding_never_exceeds_the_request():
    """Review finding: per-group rounding to the nearest exceeded the request (N=7, retain 0.5 kept 4 tokens)."""
    s = solve_schedule(7, DecoderShape.mha(layers=1, hidden=64, intermediate=128), first_layers=0, groups=1,
                       decay=0.5, retain=0.5)
    assert s.kept == [3]
    for layers, n in ((4, 7), (6, 144), (32, 576)):
        shape = DecoderShape.mha(layers=layers, hidden=64, intermediate=128)
        for groups in range(1, 4):
            for first in range(0, min(layers - groups, 3) + 1):
                for decay in (0.3, 0.5, 0.9):
                    for retain in (0.05, 0.111, 0.2, 0.37, 0.5, 0.73):
                        try:
                            s = solve_schedule(n, shape, first_layers=first, groups=groups, decay=decay, retain=retain)
                        except ValueError:
                            continue
                        assert s.retain <= retain + 1e-12, (layers, n, groups, first, decay, retain, s.kept)
                        assert s.notes or s.retained_tokens >= retain * n - 1 - 1e-9


SHALLOW = DecoderShape.mha(layers=6, hidden=64, intermediate=128)


def test_plan_resolves_the_per_model_defaults():
    assert plan(HAPConfig(), SHALLOW, 144).cuts == [0, 2, 4]  # first_layers 0 on 6 layers
    deep = plan(HAPConfig(), LLAVA7B, 576)
    assert deep.cuts == [2, 12, 22] and deep.target_retain == 0.111
    assert deep.kept == solve_schedule(576, LLAVA7B, first_layers=2, groups=3, decay=0.5, retain=0.111).kept


def test_plan_gives_fastv_one_cut_at_k_and_none_no_schedule():
    fastv = plan(HAPConfig(method="fastv", retain=0.3, first_layers=2), LLAVA7B, 576)
    assert fastv.cuts == [2] and fastv.kept == [math.floor(576 * (0.3 * 32 - 2) / 30)]  # never above the request
    assert plan(HAPConfig(method="none"), LLAVA7B, 576) is None


def test_plan_gives_visionzip_its_tokens_in_every_layer():
    vz = plan(HAPConfig(method="visionzip", retain=0.111, first_layers=2), LLAVA7B, 576)
    assert vz.cuts == [0] and vz.kept == [63] and vz.visual_per_layer == [63] * 32  # floor(0.111 x 576)


def test_plan_with_a_flops_target_keeps_fewer_tokens_behind_a_longer_text():
    config = HAPConfig(flops_ratio=0.5, first_layers=2)
    short, long = plan(config, LLAVA7B, 576, text_tokens=10), plan(config, LLAVA7B, 576, text_tokens=300)
    assert short.flops_ratio(10, LLAVA7B) == pytest.approx(0.5, abs=0.01) and long.kept[0] < short.kept[0]
