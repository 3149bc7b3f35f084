"""The fidelity benchmark runs end to end on the shipped model and writes the binding keys, consistently."""

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import hap
from analysis.benchmark import METHODS, RETAINS, main
from analysis.scenes import QTYPES, heldout_items
from hap.causal import spearman

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


def test_spearman_matches_hand_values():
    assert spearman(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(np.array([1, 2, 3, 4]), np.array([4, 3, 2, 1])) == pytest.approx(-1.0)
    # ties get average ranks: x ranks [0.5, 0.5, 2, 3], y ranks [0, 1, 2, 3]
    assert spearman(np.array([1, 1, 2, 3]), np.array([1, 2, 3, 4])) == pytest.approx(np.corrcoef([0.5, 0.5, 2, 3], [0, 1, 2, 3])[0, 1])


def test_benchmark_writes_every_method_and_budget(tmp_path):
    """On the shipped (trained) model, so that the unpruned accuracy is not 0 and the retain-1.0 check means
    something; every check below fails for some wrong report."""
    out = tmp_path / "bench"
    main(["--model", str(SHIPPED), "--seeds", "500000:500004", "--per-scene", "2", "--out", str(out),
          "--methods", *METHODS, "oracle", "oracle_causal"])
    report = json.loads((out / "benchmark.json").read_text())
    text = json.loads((SHIPPED / "config.json").read_text())["text_config"]
    n = report["n_questions"]
    assert n == 8 and report["config"]["first_layers"] == 0  # the per-model default on 6 layers
    assert 0 < report["unpruned_accuracy"] and (report["unpruned_accuracy"] * n).is_integer()
    for method in (*METHODS, "oracle"):
        accuracy, recall = report["accuracy"][method], report["kept_recall"][method]
        assert set(accuracy) == set(recall) == {str(r) for r in RETAINS}
        assert all((v * n) == pytest.approx(round(v * n)) for v in accuracy.values())  # a share of n questions
        for r, v in accuracy.items():
            assert report["relative"][method][r] == pytest.approx(v / report["unpruned_accuracy"])
        # nothing pruned at retain 1.0: every method answers exactly as the unpruned model
        assert accuracy["1.0"] == report["unpruned_accuracy"]
        assert recall["1.0"] == 1.0 and recall["0.056"] < recall["0.222"] <= 1.0  # pruning drops object patches
    assert -1.0 <= report["grounding_spearman"] <= 1.0  # NaN fails too
    assert np.array(report["head_paq"]).shape == (text["num_hidden_layers"], text["num_attention_heads"])
    assert len(report["norm_ratio"]) == text["num_hidden_layers"] and min(report["norm_ratio"]) >= 1.0
    for r in ("0.222", "0.111", "0.056"):  # the answering patches first: recall at least the uniform one's
        assert report["kept_recall"]["oracle"][r] >= report["kept_recall"]["uniform"][r]
    assert set(report["accuracy_by_type"]["oracle"]["0.111"]) == set(QTYPES)
    assert -1.0 <= report["causal_spearman"] <= 1.0 and 0.0 <= report["causal_token_precision"] <= 1.0
    # per kind: the kinds with answering patches, whose question-weighted mean is the overall precision
    kinds = Counter(q.qtype for _, q in heldout_items(range(500_000, 500_004), 2) if q.target_mask.any())
    by_type = report["causal_token_precision_by_type"]
    assert set(by_type) == set(kinds) and all(0.0 <= v <= 1.0 for v in by_type.values())
    assert report["causal_token_precision"] == pytest.approx(
        sum(by_type[k] * n for k, n in kinds.items()) / sum(kinds.values()))
    assert all(f"{k} {v:.3f}" in (out / "benchmark.md").read_text() for k, v in by_type.items())
    assert report["accuracy"]["oracle_causal"]["1.0"] == report["unpruned_accuracy"]
    # head utility: per question, a share of its 5 cut layers (6 decoder layers); per kind, question-weighted
    kinds = Counter(q.qtype for _, q in heldout_items(range(500_000, 500_004), 2))
    assert -1.0 <= report["utility_spearman"] <= 1.0 and -1.0 <= report["utility_spearman_within_layers"] <= 1.0
    for key in ("utility_best_head", "utility_uniform", "utility_paq"):
        assert 0.0 <= report[key] <= 1.0 and report[key] * 5 * n == pytest.approx(round(report[key] * 5 * n))
        by_type = report[f"{key}_by_type"]
        assert set(by_type) == set(kinds)
        assert report[key] == pytest.approx(sum(by_type[k] * m for k, m in kinds.items()) / n)
    assert "| best_head | " in (out / "benchmark.md").read_text()
    for name in ("benchmark.md", "accuracy.png", "paq_grounding.png"):
        assert (out / name).stat().st_size > 0


def test_layer_recall_averages_over_decoder_layers():
    from types import SimpleNamespace

    import torch

    from analysis.benchmark import layer_recall
    from hap.planning.flops import Schedule

    schedule = Schedule(num_visual=6, num_layers=4, cuts=[1, 3], kept=[3, 1])
    cuts = [SimpleNamespace(kept=torch.tensor([[0, 1, 4]]), recycled=None),
            SimpleNamespace(kept=torch.tensor([[4]]), recycled=None)]
    target = np.array([True, True, False, False, False, False])
    # layer 0: all tokens (1.0); layers 1-2: both target patches (1.0); layer 3: none (0.0)
    assert layer_recall(SimpleNamespace(schedule=schedule, cuts=cuts), 0, target) == 0.75
    # a recycled cluster mean standing at patch 1 (SparseVLM, AutoPrune) is no patch: layers 1-2 hold one of two
    cuts[0].recycled = torch.tensor([[False, True, False]])
    assert layer_recall(SimpleNamespace(schedule=schedule, cuts=cuts), 0, target) == 0.25 + 0.5 * 0.5


def test_the_ablation_runs_every_knob_alone_and_together(tmp_path):
    from analysis.ablation import ALONE, TOGETHER, defaults, main as ablation, variants

    names = variants()
    assert names["hap_paper"] == {} and names["all"] == TOGETHER and names["defaults"] == defaults() != {}
    assert names["defaults, T=inf"]["temperature"] == math.inf
    assert len(names) == 1 + sum(len(v) for v in ALONE.values()) + 3
    assert hap.HAPConfig(**defaults()) == hap.HAPConfig()  # the defaults row is the library's HAP
    report = ablation(["--model", str(SHIPPED), "--seeds", "400000:400002", "--per-scene", "2", "--retain", "0.111",
                       "--out", str(tmp_path)])
    assert set(report["variants"]) == set(names) and report["variants"]["hap_paper"]["delta"]["0.111"] == 0.0
    for v in report["variants"].values():
        assert 0.0 <= v["kept_recall"]["0.111"] <= 1.0 and (v["accuracy"]["0.111"] * 4).is_integer()
    assert "| all |" in (tmp_path / "ablation.md").read_text()


def test_hap_paper_is_the_paper_preset_on_the_run_schedule(tmp_path):
    """`hap` given every paper value by its flag answers as `hap_paper`, whatever the library defaults;
    `visionzip` is a benchmark method too."""
    from analysis.benchmark import KNOB_FLAGS
    from hap import KNOBS

    paper = [arg for k in KNOBS if k.paper is not None and k.name in KNOB_FLAGS for arg in (k.flag, str(k.paper))]
    report = main(["--model", str(SHIPPED), "--seeds", "500000:500002", "--per-scene", "1", "--out", str(tmp_path),
                   "--methods", "hap", "hap_paper", "visionzip", "--retain", "0.111", *paper])
    assert report["accuracy"]["hap"] == report["accuracy"]["hap_paper"]
    assert 0.0 <= report["kept_recall"]["visionzip"]["0.111"] <= 1.0  # the peer runs on the same budget
    assert report["kept_recall"]["hap"] == report["kept_recall"]["hap_paper"]


def test_per_kind_rows_add_up_to_the_overall_rows(tmp_path, capsys):
    """`--methods all` runs every registry method; each question kind's and scene kind's accuracy, weighted by its
    questions, gives the overall one; the per-kind tables print from the stored JSON alone (`--by-kind`)."""
    from analysis.benchmark import PAPER_TOKENS, SCENE_KINDS
    from hap.runs.keeps import pruning

    report = main(["--model", str(SHIPPED), "--seeds", "500000:500003", "--per-scene", "3", "--out", str(tmp_path),
                   "--methods", "all", "hap", "--retain", "0.333", "0.111", "--accuracy-only"])
    assert list(report["accuracy"]) == pruning()  # each once, in the registry's order
    n, by_type, by_scene = report["n_questions"], report["n_by_type"], report["n_by_scene"]
    assert n == 9 == sum(by_type.values()) == sum(by_scene.values()) and set(by_scene) == set(SCENE_KINDS)

    def weighted(values: dict, counts: dict) -> float:
        return sum(values[k] * m for k, m in counts.items() if m) / n

    assert weighted(report["unpruned_by_type"], by_type) == pytest.approx(report["unpruned_accuracy"])
    assert weighted(report["unpruned_by_scene"], by_scene) == pytest.approx(report["unpruned_accuracy"])
    reached = 0
    for method, row in report["accuracy"].items():
        for retain, value in row.items():
            if math.isnan(value):  # out of reach: no kind has an accuracy either
                assert all(math.isnan(v) for v in report["accuracy_by_type"][method][retain].values())
                continue
            reached += 1
            assert weighted(report["accuracy_by_type"][method][retain], by_type) == pytest.approx(value), method
            assert weighted(report["accuracy_by_scene"][method][retain], by_scene) == pytest.approx(value), method
    assert reached >= len(pruning())
    table = (tmp_path / "by_kind.md").read_text()
    assert f"{PAPER_TOKENS['0.333']} of 576" in table and "| cluttered scenes (5-6 objects) (" in table
    assert table in (tmp_path / "benchmark.md").read_text()
    rows = (tmp_path / "by_kind.csv").read_text().splitlines()
    kinds = len(report["unpruned_by_type"]) + len(SCENE_KINDS) + 1
    assert rows[0] == "kind,questions,method,retain,accuracy" and len(rows) == 1 + kinds * (1 + 2 * len(pruning()))
    capsys.readouterr()
    assert main(["--by-kind", str(tmp_path / "benchmark.json")])["accuracy_by_scene"].keys() == set(pruning())
    assert capsys.readouterr().out.strip() == table.strip()


def test_a_method_the_model_refuses_is_named_not_run(tmp_path, monkeypatch):
    from analysis import benchmark

    monkeypatch.setattr(benchmark, "refusal", lambda model, config: "no [CLS]" if config.method == "fastv" else None)
    report = main(["--model", str(SHIPPED), "--seeds", "500000:500002", "--per-scene", "1", "--out", str(tmp_path),
                   "--methods", "hap", "fastv", "--retain", "0.111", "--accuracy-only"])
    assert report["refused"] == {"fastv": "no [CLS]"} and math.isnan(report["accuracy"]["fastv"]["0.111"])
    assert not math.isnan(report["accuracy"]["hap"]["0.111"])
    assert "fastv: refused by the model, not run (no [CLS])." in (tmp_path / "benchmark.md").read_text()
