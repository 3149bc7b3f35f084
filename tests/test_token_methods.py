"""analysis.token_methods: every candidate token-importance method is scored per question kind and timed, the
chosen one exactly as `hap.token_importance` computes it."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import hap
from analysis.scenes import heldout_items
from analysis.token_methods import GROUNDED, blocks, candidates, main
from hap import causal

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


def test_token_precision_counts_answering_patches_among_the_top():
    # top 2 by importance: index 1 (0.9) then index 3 (0.9, the later tie); one of them answers
    assert causal.token_precision([0.1, 0.9, 0.5, 0.9], [False, True, True, False]) == 0.5
    assert causal.token_precision([0.1, 0.9, 0.5, 0.2], [False, True, True, False]) == 1.0


def test_blocks_tile_a_square_grid():
    group = blocks(16, 2)  # 4x4 grid, 2x2 squares
    assert group.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert torch.bincount(blocks(144, 2)).tolist() == [4] * 36
    assert torch.bincount(blocks(9, 2)).tolist() == [4, 2, 2, 1]  # a ragged last row and column
    with pytest.raises(ValueError):
        blocks(10, 2)


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="the shipped model is not in assets/")
def test_every_method_is_reported_per_kind_on_validation_scenes(tmp_path):
    seeds, per_scene = range(400_000, 400_002), 2
    out = tmp_path / "token_methods.json"
    report = main(["--model", str(SHIPPED), "--seeds", f"{seeds.start}:{seeds.stop}", "--per-scene", str(per_scene),
                   "--out", str(out)])
    assert json.loads(out.read_text()) == report
    questions = [(s, q) for s, q in heldout_items(seeds, per_scene) if q.target_mask.any()]
    counts = Counter(q.qtype for _, q in questions)
    assert report["questions_by_kind"] == dict(counts) and report["grounded_kinds"] == ["color", "dot"]
    names = [c.name for c in candidates()]
    assert list(report["methods"]) == [*names, "chance"] and set(causal.TOKEN_SCORES) < set(names)
    for name, row in report["methods"].items():
        by_kind = row["precision_by_kind"]
        assert set(by_kind) == set(counts) and all(0.0 <= v <= 1.0 for v in by_kind.values())
        # the headline is the question-weighted mean over the grounded kinds (one question each here)
        assert row["precision"] == pytest.approx(np.mean([by_kind[k] for k in GROUNDED if k in counts]))
        assert row["cost_prefills"] is None if name == "chance" else row["cost_prefills"] > 0
    # chance: |answering| / visual tokens
    assert report["methods"]["chance"]["precision_by_kind"]["dot"] == pytest.approx(1 / 144)
    # the chosen row is the binding's token importance, not a copy of it
    model, processor = hap.load_model(str(SHIPPED), device="cpu")
    chosen = report["methods"][report["chosen"]]["precision_by_kind"]
    for scene, q in questions:
        tokens = hap.token_importance(model, processor, scene.image, q.text)
        assert chosen[q.qtype] == causal.token_precision(tokens, q.target_mask)
