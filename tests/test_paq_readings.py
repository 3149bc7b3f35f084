"""analysis.paq_readings: each reading on planted heads, and the end-to-end table on the shipped model."""

from pathlib import Path

import numpy as np
import pytest

from analysis import paq_readings as R
from hap import utility

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


def view(dist: np.ndarray, neutral: np.ndarray | None = None, written: np.ndarray | None = None) -> R.LayerView:
    H, N = dist.shape
    return R.LayerView(3, dist, np.linspace(0.1, 0.9, H), np.full(H, 0.5), np.ones((H, N)) if written is None
                       else written, np.arange(N, dtype=float), dist if neutral is None else neutral)


def test_readings_on_planted_heads():
    N = 32
    onehot = np.eye(N)
    spread = np.full(N, 1 / N)
    first, last = np.repeat([1 / 16, 0.0], 16), np.repeat([0.0, 1 / 16], 16)  # tokens 0-15, tokens 16-31
    dist = np.stack([spread, onehot[0], first])
    v = view(dist, neutral=np.stack([spread, onehot[0], last]))
    agree = view(np.stack([onehot[0], onehot[0], onehot[5]]))  # two heads look at token 0, one elsewhere
    assert R.consensus(agree) == pytest.approx([2 / 5 ** 0.5, 2 / 5 ** 0.5, 1 / 5 ** 0.5])
    assert R.contrast(v).tolist() == [0.0, 0.0, 1.0]  # head 2 moved with the question, heads 0 and 1 did not
    assert R.value_focus(v) == pytest.approx([0.0, 1.0, 0.2])  # what is written is uniform: the map's own focus
    louder = view(dist, written=np.stack([np.ones(N), np.ones(N), 10 * np.ones(N)]))
    assert R.value_mass(louder)[2] == pytest.approx(10 * R.value_mass(louder)[1])
    assert R.similarity(v)[2] > R.similarity(v)[1]  # tokens 0-15 are more similar than token 0 (similarity = index)
    assert (R.depth(v) == 3).all() and R.focus(v) is v.paq


def test_the_table_on_the_shipped_model(tmp_path):
    out = tmp_path / "readings.json"
    report = R.main(["--model", str(SHIPPED), "--seeds", "400000:400001", "--per-scene", "2", "--out", str(out)])
    assert report["n_questions"] == 2 and set(report["readings"]) == {*R.READINGS, "prior"}
    for name, r in report["readings"].items():
        assert -1.0 <= r["pooled"] <= 1.0, name
        assert (r["within_layers"] is None) == (name == "depth")
    assert out.with_suffix(".md").read_text().count("\n| ") == len(R.READINGS) + 2  # header + one row per reading
    assert utility.default_keep(144) == R.TOP
