"""The trace (hap/runs/trace.py): maps on the original grid, the tracer's records, and a Result from hand-made records."""

import math

import torch

from hap import HAPConfig
from hap.planning.flops import DecoderShape, Schedule
from hap.scoring.heads import head_stats
from hap.runs.trace import CutTrace, Outcome, Tracer, on_grid, to_result

NAN = math.nan


def test_on_grid_scatters_present_tokens_and_leaves_nan_elsewhere():
    got = on_grid(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[4, 0, 2]]), 5)
    torch.testing.assert_close(got, torch.tensor([[2.0, NAN, 3.0, NAN, 1.0]]), equal_nan=True)
    per_head = on_grid(torch.ones(1, 2, 2), torch.tensor([[1, 3]]), 4)  # [batch, heads, N_cur]
    assert per_head.isnan().tolist() == [[[True, False, True, False]] * 2]


def traced_layer(tracer: Tracer, index: int, kept: torch.Tensor) -> None:
    """Record layer `index` over the tokens `kept` [1, n]: head 0 looks at the first present token only."""
    n = kept.shape[1]
    attn = torch.full((1, 2, 3, n), 0.5 / n)  # [batch, heads, P, n]
    attn[0, 0] = 0.0
    attn[0, 0, :, 0] = 0.5
    valid, sink = torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, n, dtype=torch.bool)
    tracer.layer(index, attn, head_stats(attn, valid, sink), sink, valid, kept)


def test_the_tracer_records_every_map_of_a_layer():
    tracer = Tracer(num_visual=4, temperature=0.1)
    traced_layer(tracer, 0, torch.tensor([[0, 1, 3]]))
    tr = tracer.layers[0]
    assert tr.paq.shape == (1, 2) and tr.paq[0, 0] > tr.paq[0, 1] and tr.tokens_present == 3
    assert tr.head_maps.shape == (1, 2, 4) and tr.head_maps[0, :, 2].isnan().all()
    torch.testing.assert_close(tr.head_attention[0, 1], torch.tensor([1 / 3, 1 / 3, NAN, 1 / 3]), equal_nan=True)
    assert tr.fused_map[0, 0] > tr.uniform_map[0, 0]  # PAQ weights favour the focused head
    assert tr.sink_count.tolist() == [0]


def test_to_result_from_hand_made_records():
    shape = DecoderShape.mha(layers=4, hidden=8, intermediate=16)
    config = HAPConfig(retain=0.5, groups=2).resolved(4)  # first_layers resolves to 0 on 4 layers
    schedule = Schedule(num_visual=4, num_layers=4, cuts=[1, 2], kept=[3, 2], target_retain=0.5)
    tracer = Tracer(4, config.temperature)
    traced_layer(tracer, 0, torch.tensor([[0, 1, 2, 3]]))
    traced_layer(tracer, 1, torch.tensor([[0, 1, 3]]))
    tracer.cut_maps[1] = (torch.ones(1, 4), torch.zeros(1, 4))
    weights = torch.full((1, 1, 2), 0.5)
    cuts = [CutTrace(1, [0], torch.tensor([[0, 1, 3]]), torch.rand(1, 1, 2), weights),
            CutTrace(2, [1], torch.tensor([[0, 3]]), torch.rand(1, 1, 2), weights)]
    r = to_result(Outcome(config, shape, 2, 4, 10, schedule, cuts, tracer), "blue", "prompt", (2, 2), ["a note"])
    assert (r.answer, r.method, r.num_layers, r.num_heads, r.num_visual, r.text_tokens) == ("blue", "hap", 4, 2, 4, 6)
    assert r.config["first_layers"] == 0 and r.target_retain == 0.5 and r.target_flops_ratio is None
    assert r.visual_per_layer == [4, 3, 2, 2] and r.retained_tokens == 2.75 and r.retain == 2.75 / 4
    assert r.flops_ratio == schedule.flops_ratio(6, shape)
    assert [(g.index, g.layers, g.scored_by, g.kept) for g in r.groups] == [(0, (1, 2), [0], [0, 1, 3]),
                                                                            (1, (2, 4), [1], [0, 3])]
    assert r.groups[1].weights == [[0.5, 0.5]]
    assert r.paq[:2].isfinite().all() and r.paq[2:].isnan().all()  # layers 2, 3 were not captured
    assert r.head_class[0] == ["optimal", "dispersed"] and r.head_class[3] == ["", ""]
    assert r.sink_tokens == [0, 0, -1, -1] and r.maps.head.shape == (4, 2, 4)
    assert r.maps.group[0].tolist() == [1.0] * 4 and r.maps.group[1].isnan().all()  # cut 2 has no traced maps
    assert r.notes == ["a note"]


def test_an_unpruned_result_has_no_groups_and_the_full_flops():
    shape = DecoderShape.mha(layers=2, hidden=8, intermediate=16)
    r = to_result(Outcome(HAPConfig(method="none").resolved(2), shape, 2, 4, 9, None, [], None), "", "", (2, 2), [])
    assert r.groups == [] and r.flops_ratio == 1.0 and r.visual_per_layer == [4, 4] and r.maps.group.shape == (0, 4)
    assert r.paq.isnan().all() and r.sink_tokens == [-1, -1]
