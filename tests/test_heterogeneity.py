"""analysis.heterogeneity end to end on a few held-out scenes: the plan's share grows, the classifier's scores come
out per detector, the files are written."""

import json
from pathlib import Path

import pytest

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


@pytest.mark.slow
@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="the shipped model is not in assets/")
def test_heterogeneity_runs_and_writes_its_curves(tmp_path):
    from analysis.heterogeneity import main

    report = main(["--model", str(SHIPPED), "--seeds", "500000:500003", "--shares", "0", "0.5", "--methods", "hap",
                   "uniform", "--out", str(tmp_path)])
    assert report["scoring_layers"] == [0, 1, 3]
    assert set(report["accuracy"]["sink"]["0.5"]) == {"hap", "uniform"}
    assert report["classifier"]["sink"]["0.5"]["norm"]["recall"] == 0.0  # no massive activation: the norm test misses
    assert report["classifier"]["sink"]["0.5"]["consensus"]["recall"] == 1.0
    assert report["unpruned"]["sink"]["0.0"] == report["unpruned"]["dispersed"]["0.0"]  # share 0 plants nothing
    assert json.loads((tmp_path / "heterogeneity.json").read_text())["n_questions"] == 3
    assert (tmp_path / "heterogeneity.png").stat().st_size > 0 and "| hap |" in (tmp_path / "heterogeneity.md").read_text()
