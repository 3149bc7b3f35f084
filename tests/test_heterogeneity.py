"""analysis.heterogeneity end to end on a few held-out scenes: the plan's share grows, the classifier's scores come
out per detector (massive sink tokens seen by the norm test, plain ones not), the files are written."""

import json
from pathlib import Path

import pytest

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


@pytest.mark.slow
@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="the shipped model is not in assets/")
def test_heterogeneity_runs_and_writes_its_curves(tmp_path):
    from analysis.heterogeneity import main

    args = ["--model", str(SHIPPED), "--seeds", "500000:500003", "--shares", "0", "0.5", "--methods", "hap",
            "uniform", "hap_paper", "--sink-tokens", "4"]
    report = main([*args, "--out", str(tmp_path)])
    assert report["scoring_layers"] == [0, 1, 3] and report["massive"]
    assert set(report["accuracy"]) == {"sink_4", "dispersed"}
    assert set(report["accuracy"]["sink_4"]["0.5"]) == {"hap", "uniform", "hap_paper"}
    for detector in ("norm", "consensus"):  # massive sink tokens: both detectors see the planted sinks
        assert report["classifier"]["sink_4"]["0.5"][detector]["recall"] == 1.0
    assert report["unpruned"]["sink_4"]["0.0"] == report["unpruned"]["dispersed"]["0.0"]  # share 0 plants nothing
    assert json.loads((tmp_path / "heterogeneity.json").read_text())["n_questions"] == 3
    md = (tmp_path / "heterogeneity.md").read_text()
    assert (tmp_path / "heterogeneity.png").stat().st_size > 0 and "| hap_paper - uniform (points) |" in md
    plain = main([*args, "--shares", "0.5", "--kinds", "sink", "--no-massive", "--out", str(tmp_path / "plain")])
    assert not plain["massive"] and set(plain["accuracy"]) == {"sink_4"}
    assert plain["classifier"]["sink_4"]["0.5"]["norm"]["recall"] == 0.0  # no massive activation: the norm test misses
    assert plain["classifier"]["sink_4"]["0.5"]["consensus"]["recall"] == 1.0
