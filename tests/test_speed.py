"""The speed benchmark script runs and prints every row; the reported ratios are those of its own timings."""

import json

import pytest

from analysis.speed import GRID, main, table
from hap.planning.flops import DecoderShape, Schedule, layer_flops


def test_speed_script_prints_ratios_for_each_method(capsys):
    report = main(["--shape", "mid", "--layers", "2", "--repeats", "1", "--methods", "hap", "hap_paper", "random",
                   "--retain", "0.5", "--groups", "2", "--text-tokens", "12"])
    out = capsys.readouterr().out
    assert "first_layers=0" in out and "text only" in out
    printed = [line.split() for line in out.splitlines() if line.split()[:1] in (["hap"], ["hap_paper"], ["random"])]
    rows = report["mid"]
    assert [r[0] for r in printed] == [r["method"] for r in rows] == ["hap", "hap_paper", "random"]
    assert rows[1]["overhead"] is not None  # the paper's HAP against random too
    base_ms = float(out.split("none: prefill ")[1].split(" ms")[0])
    for line, row in zip(printed, rows):
        assert float(line[3]) == pytest.approx(row["seconds"] * 1000, abs=0.05)
        assert float(line[4]) == pytest.approx(row["speedup"], abs=0.005)
        assert row["speedup"] == pytest.approx(base_ms / float(line[3]), rel=0.02, abs=0.01)  # none / method
        assert row["kept"] == pytest.approx(0.5 * GRID * GRID, abs=1) and row["ideal"] > 1
    assert printed[0][-1].endswith("%") and rows[2]["overhead"] is None


def test_table_ratios_come_from_the_timings_and_the_flops():
    shape = DecoderShape.mha(layers=2, hidden=8, intermediate=16)
    schedule = Schedule(num_visual=10, num_layers=2, cuts=[0], kept=[5])
    median = {("none", 1.0): 4.0, ("hap", 0.5): 2.5, ("random", 0.5): 2.0}
    peak = dict.fromkeys(median, 0.0)
    hap_row, random_row = table({("hap", 0.5): schedule, ("random", 0.5): schedule}, median, peak, 3, shape)
    assert hap_row["speedup"] == 4.0 / 2.5 and random_row["speedup"] == 2.0
    assert hap_row["ideal"] == pytest.approx(layer_flops(13, shape) / layer_flops(8, shape))
    assert hap_row["overhead"] == pytest.approx(0.5 / 2.5) and hap_row["kept"] == 5


def test_causal_speed_reports_the_gradient_pass_and_head_utility_as_prefills():
    from analysis.causal_speed import main as causal_speed
    from hap.planning.flops import DecoderShape
    from hap.utility import cost

    report = causal_speed(["--layers", "2", "--repeats", "1", "--text-tokens", "8"])
    assert report["gradients_s"] > 0 and report["gradients_per_prefill"] == pytest.approx(
        report["gradients_s"] / report["prefill_s"])
    assert report["utility_layers"] == 1 and report["utility_per_prefill"] == pytest.approx(
        report["utility_s"] / report["prefill_s"])
    predicted = cost(DecoderShape.mha(2, 1024, 2816), 576, 8, 16)  # the "mid" width, 16 heads, keep 64
    assert report["utility_flops_prefills"] == pytest.approx(predicted) and 2 < predicted < 3


@pytest.mark.slow
def test_app_speed_serves_the_app_before_and_after_and_writes_its_ratios(tmp_path):
    """`python -m analysis.app_speed --smoke`: the real app served twice (sharing off, on), every request timed and
    written as a ratio to the prefill it measured."""
    from analysis import app_speed

    report = app_speed.main(["--smoke", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)])
    assert set(report["modes"]) == {"before", "after"} and report["prefill_s"] > 0
    for times in report["modes"].values():
        assert set(times) == {"load", "analyze_off", "analyze_auto", "analyze_keeps", "sweep"} and min(times.values()) > 0
    table = (tmp_path / "smoke.md").read_text()
    after = report["modes"]["after"]["sweep"]
    ratios = f"{after / report['prefill_s']:.2f} \\| {after / report['prefill_last_s']:.2f}"
    assert f"{after:.1f} ({ratios})" in table and report["prefill_last_s"] > 0
    assert json.loads((tmp_path / "smoke.json").read_text()) == report


def test_the_stage_breakdown_takes_nested_stages_out_and_divides_by_each_requests_prefill():
    """`app.stages.Clock` keeps each stage's own time (a timed call nested in another is taken out of it);
    `analysis.app_speed.stage_rows` makes the handler's rest, the payload and each share of the request's prefill from a
    probe's report."""
    import time

    from analysis import app_speed
    from app.stages import Clock

    clock = Clock()
    inner = clock.wrap("vision", lambda: time.sleep(0.02))
    clock.wrap("handler", lambda: (inner(), time.sleep(0.01)))()
    assert 0.02 <= clock.seconds["vision"] < 0.03 and 0.01 <= clock.seconds["handler"] < 0.02  # exclusive
    request = {"client": 10.0, "prefill_s": 5.0, "stages": {"vision": 1.0, "tracing": 0.5, "decode": 4.0,
                                                            "figures": 1.0, "handler": 2.5},
               "runs": [{"label": "hap", "prefill_s": 1.0, "scoring_s": 0.2},
                        {"label": "hap traced replay", "prefill_s": 1.0, "scoring_s": 0.6}]}
    rows = app_speed.stage_rows({"requests": [request, {**request, "client": 12.0, "prefill_s": 6.0}]})
    assert rows["prefill hap traced replay"] == (1.0, pytest.approx((0.2 + 1 / 6) / 2)) and rows["present"] is None
    assert rows["other"][0] == pytest.approx(2.5 - (2.0 - 0.5)) and rows["scoring"][0] == pytest.approx(0.8)
    payload = (pytest.approx(2.0), pytest.approx((1.0 / 5 + 3.0 / 6) / 2))  # the client's wait less the handler's
    assert rows["payload"] == payload
    table = app_speed.stages_markdown({"base": {"requests": [request]}}, "cmd")
    assert "| total: the client's wait for `/analyze` | 10.000 (2.000) |" in table and "| - |" in table
