"""The fidelity benchmark runs end to end on a small random model and writes the binding keys."""

import json

import numpy as np
import pytest

from analysis.benchmark import METHODS, RETAINS, main, spearman
from tiny_models import tiny_llava


def test_spearman_matches_hand_values():
    assert spearman(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(np.array([1, 2, 3, 4]), np.array([4, 3, 2, 1])) == pytest.approx(-1.0)
    # ties get average ranks: x ranks [0.5, 0.5, 2, 3], y ranks [0, 1, 2, 3]
    assert spearman(np.array([1, 1, 2, 3]), np.array([1, 2, 3, 4])) == pytest.approx(np.corrcoef([0.5, 0.5, 2, 3], [0, 1, 2, 3])[0, 1])


def test_benchmark_writes_every_method_and_budget(tmp_path):
    model, processor = tiny_llava(layers=6, kv_heads=None)
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    out = tmp_path / "bench"
    main(["--model", str(tmp_path / "model"), "--seeds", "500000:500004", "--per-scene", "2", "--out", str(out)])
    report = json.loads((out / "benchmark.json").read_text())
    assert report["n_questions"] == 8
    for method in METHODS:
        assert set(report["accuracy"][method]) == {str(r) for r in RETAINS}
        assert all(0.0 <= v <= 1.0 for v in report["accuracy"][method].values())
        # nothing pruned at retain 1.0: every method answers exactly as the unpruned model
        assert report["accuracy"][method]["1.0"] == report["unpruned_accuracy"]
        assert report["kept_recall"][method]["1.0"] == 1.0
    assert -1.0 <= report["grounding_spearman"] <= 1.0
    assert np.array(report["head_paq"]).shape == (6, 4)
    for name in ("benchmark.md", "accuracy.png", "paq_grounding.png"):
        assert (out / name).stat().st_size > 0


def test_layer_recall_averages_over_decoder_layers():
    from types import SimpleNamespace

    import torch

    from analysis.benchmark import layer_recall
    from hap.budget import Schedule

    schedule = Schedule(num_visual=6, num_layers=4, cuts=[1, 3], kept=[3, 1])
    cuts = [SimpleNamespace(kept=torch.tensor([[0, 1, 4]])), SimpleNamespace(kept=torch.tensor([[4]]))]
    target = np.array([True, True, False, False, False, False])
    # layer 0: all tokens (1.0); layers 1-2: both target patches (1.0); layer 3: none (0.0)
    assert layer_recall(SimpleNamespace(schedule=schedule, cuts=cuts), 0, target) == 0.75
