"""app.gpu_check: `--smoke` runs the GPU check's code on small shapes on the CPU (so it cannot rot) and writes the
binding keys per shape and method; the 7B shapes build on the meta device, each with a processor that matches it."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
from PIL import Image

from analysis import speed
from hap.runs.keeps import pruning
from app import gpu_check
from hap.runs.run import chat_prompt

BINDING = {"speedup", "ideal", "peak_memory_bytes", "seconds"}


def test_smoke_runs_every_stage_and_writes_the_binding_keys(tmp_path):
    t0 = time.perf_counter()
    report = gpu_check.main(["--smoke", "--out", str(tmp_path)])
    assert time.perf_counter() - t0 < 180
    saved = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    assert saved == json.loads(json.dumps(report)) and saved["device"] == "cpu" and saved["smoke"]
    assert list(saved["shapes"]) == list(gpu_check.SMOKE_SHAPES)
    for name, shape in saved["shapes"].items():
        assert list(shape["methods"]) == list(gpu_check.METHODS)
        for method, budgets in shape["methods"].items():
            assert list(budgets) == [f"{r:g}" for r in gpu_check.RETAINS]
            for row in budgets.values():
                if "skipped" in row:  # the official PyramidDrop renumbers positions, which M-RoPE refuses
                    assert (shape["family"], method) == ("qwen", "pdrop")
                    continue
                assert BINDING <= row.keys() and row["peak_memory_bytes"] is None  # no CUDA: no peak
                assert row["speedup"] > 0 and row["ideal"] > 1 and row["seconds"] > 0
        analyze, causal, sweep = shape["analyze"], shape["causal"], shape["sweep"]
        assert analyze["seconds"] > analyze["causal_seconds"] > 0 and analyze["causal_mode"] == "attribution"
        assert set(analyze["latency_s"]) == {"unpruned", "pruned", "uniform"} and analyze["head_utility_seconds"] > 0
        assert causal["gradients_s"] > 0 and causal["prefill_s"] > 0
        refused = {"cdpruner", "hawk"} | ({"pdrop", "visionzip", "sparsevlm", "autoprune", "divprune", "vispruner",
                                           "scope", "holov", "prunesid", "hiprune"}  # default CLIP: CLIP-L/336 only;
                                          if shape["family"] == "qwen" else set())  # hawk: no static head importance
        assert sweep["budgets"] >= 6 and sweep["methods"] == len(set(pruning()) - refused)
        if shape["family"] != "llava":
            assert "paper_table" not in shape  # the lmms-eval plugin wraps llava_hf
        elif importlib.util.find_spec("lmms_eval") is None:
            assert "install-eval" in shape["paper_table"]["skipped"]
        else:  # the unpruned cell, then each method at each budget, through the lmms-eval plugin
            rows = shape["paper_table"]["rows"]
            assert [(r["method"], float(r["tokens"])) for r in rows] == [
                ("none", speed.GRID**2), *((m, t) for t in gpu_check.TABLE_TOKENS for m in gpu_check.TABLE_METHODS)]
            assert all(r["task"] == "hap_scenes" and 0 <= float(r["value"]) <= 1 and float(r["prefill_ms"]) > 0
                       for r in rows)
    table = (tmp_path / "gpu_check_smoke.md").read_text()
    table_cells = 1 + len(gpu_check.TABLE_METHODS) * len(gpu_check.TABLE_TOKENS) if importlib.util.find_spec(
        "lmms_eval") else 1  # the paper_table stage's cells, or the line saying it was skipped
    assert table.count("| llava-small | ") == len(gpu_check.METHODS) * len(gpu_check.RETAINS) + 1 + table_cells


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the full check would run")
def test_without_a_gpu_the_full_check_says_to_use_smoke(tmp_path):
    with pytest.raises(SystemExit, match="--smoke"):
        gpu_check.main(["--out", str(tmp_path)])


@pytest.mark.parametrize("name", gpu_check.SHAPES)
def test_the_7b_shapes_build_on_the_meta_device_with_a_matching_processor(name):
    """What the GPU run builds: the real decoder shape in bf16, its special tokens those of the processor, which
    gives the scene speed.GRID^2 visual tokens."""
    processor, ids = gpu_check.processor_for(speed.SHAPES[name]["family"])
    model = speed.random_vlm(name, None, torch.bfloat16, "meta", ids)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.device.type == "meta"
    assert 6.5e9 < sum(p.numel() for p in model.parameters()) < 8.5e9
    inputs = processor(images=Image.open(gpu_check.SCENE), text=chat_prompt(processor, gpu_check.PROMPT),
                       return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == speed.GRID**2
