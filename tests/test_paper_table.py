"""`python -m analysis.paper_table` on the shipped model, offline: two methods at two budgets on a few held-out
scenes (the local lmms-eval task `hap_scenes`), each cell a run of the lmms-eval plugin in a process of its own."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from analysis import paper_table, scene_task, table_files
from analysis.scenes import heldout_items

# found, not imported: lmms-eval's task module sets PIL's process-wide LOAD_TRUNCATED_IMAGES on import, which would
# leak into every other test of the session (the cells import it in their own processes)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None,
                                reason="lmms-eval's CLI is not installed (bash .ci/install-eval --cli)")

SCENES, PER_SCENE = "500000:500003", 2  # 6 questions
# sparsevlm's smallest official budget on 6 layers processes 26 of 144 tokens: 16 is refused
ARGS = ["--methods", "hap,sparsevlm", "--tokens", "48", "16", "--scenes", SCENES, "--per-scene", str(PER_SCENE)]
CELLS = ["none-144", "hap-48", "sparsevlm-48", "hap-16"]
SAME = ("method", "tokens", "retain", "task", "metric", "value", "relative", "first_layers", "flops_ratio", "refused")


def table(out: Path) -> list[dict]:
    with (out / "table.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("table")
    assert paper_table.main([*ARGS, "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_the_table_rows_values_and_refusal(one):
    rows = table(one)
    assert list(rows[0]) == list(table_files.COLUMNS)
    assert [(r["method"], float(r["tokens"])) for r in rows] == [
        ("none", 144), ("hap", 48), ("sparsevlm", 48), ("hap", 16), ("sparsevlm", 16)]
    assert {r["task"] for r in rows} == {"hap_scenes"} and {r["metric"] for r in rows} == {"exact_match"}
    upper = float(rows[0]["value"])
    questions = list(heldout_items(range(500000, 500003), PER_SCENE))
    for r in rows[:4]:
        samples = [json.loads(line) for line in (one / r["samples"]).read_text().splitlines()]
        assert len(samples) == len(questions)  # every question, each scored by its own exact_match
        assert [s["target"] for s in samples] == [q.answer for _, q in questions]
        assert float(r["value"]) == pytest.approx(sum(s["exact_match"] for s in samples) / len(samples))
        assert float(r["relative"]) == pytest.approx(float(r["value"]) / upper)
        assert r["refused"] == "" and float(r["retain"]) == pytest.approx(float(r["tokens"]) / 144, abs=1e-5)
    assert float(rows[0]["flops_ratio"]) == 1.0 and float(rows[1]["flops_ratio"]) < 0.5 < float(rows[2]["flops_ratio"]) * 2
    assert all(float(r["prefill_ms"]) > 0 for r in rows[:4])
    refused = rows[4]
    assert refused["value"] == refused["relative"] == refused["samples"] == ""
    assert "unreachable for method='sparsevlm'" in refused["refused"]
    md = (one / "table.md").read_text()
    assert "| Upper bound (none, 144 tokens) |" in md and "**Retain 48 tokens (-66.7%)**" in md
    assert "| sparsevlm | refused: retain=0.111111 is unreachable" in md
    assert (one / "table.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_rerun_runs_nothing_and_rewrites_the_same_table(one, capsys, monkeypatch):
    before = {c: (one / "cells" / c / "cell.json").stat().st_mtime_ns for c in CELLS}
    csv_text = (one / "table.csv").read_text()
    monkeypatch.setattr(paper_table.subprocess, "run", lambda *a, **k: pytest.fail("a finished cell ran again"))
    assert paper_table.main([*ARGS, "--out", str(one)]) == 0
    assert "4 finished cell(s) reused, 0 to run, 1 refused" in capsys.readouterr().out
    assert {c: (one / "cells" / c / "cell.json").stat().st_mtime_ns for c in CELLS} == before
    assert (one / "table.csv").read_text() == csv_text


@pytest.mark.slow
def test_an_interrupted_cell_and_only_it_runs_again(one, tmp_path, capsys):
    copy = tmp_path / "copy"
    os.system(f"cp -r {one} {copy}")
    (copy / "cells" / "hap-16" / "cell.json").unlink()  # stopped while it ran: its files are there, not its record
    assert paper_table.finished(paper_table.setup_of(paper_table.parser().parse_args([*ARGS, "--out", str(copy)])),
                                paper_table.Cell("hap", 16 / 144, 16.0, ())) is None
    assert paper_table.main([*ARGS, "--out", str(copy)]) == 0
    assert "3 finished cell(s) reused, 1 to run" in capsys.readouterr().out
    assert [r["value"] for r in table(copy)] == [r["value"] for r in table(one)]


@pytest.mark.slow
def test_two_processes_give_the_table_of_one(one, tmp_path):
    assert paper_table.main([*ARGS, "--out", str(tmp_path), "--processes", "2"]) == 0
    assert [{k: r[k] for k in SAME} for r in table(tmp_path)] == [{k: r[k] for k in SAME} for r in table(one)]


def by_doc(path: Path) -> dict[int, tuple]:
    """doc_id -> (answer, score) of a cell's lmms-eval samples file (the ranks of a data-parallel run write theirs
    gathered, rank by rank)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["doc_id"]: (r["filtered_resps"], r["exact_match"]) for r in rows}


@pytest.mark.slow
def test_data_parallel_on_two_cpu_processes_gives_the_table_of_one(one, tmp_path):
    """`--data-parallel --processes 2` on a CPU: each cell runs as two processes of one gloo group (torchrun), each
    answering its share of the questions, gathered by lmms-eval: the same table, every question answered once with
    the one-process answer."""
    assert paper_table.main([*ARGS, "--out", str(tmp_path), "--data-parallel", "--processes", "2",
                             "--threads", "1"]) == 0
    rows, ones = table(tmp_path), table(one)
    exact = [k for k in SAME if k != "flops_ratio"]  # the mean over the ranks' timing files: summed in another order
    assert [{k: r[k] for k in exact} for r in rows] == [{k: r[k] for k in exact} for r in ones]
    assert [float(r["flops_ratio"] or 0) for r in rows] == pytest.approx([float(o["flops_ratio"] or 0) for o in ones])
    for r, o in zip(rows[:4], ones[:4]):
        assert by_doc(tmp_path / r["samples"]) == by_doc(one / o["samples"])
    for cell in CELLS:
        log = (tmp_path / "cells" / cell / "log.txt").read_text()
        assert "Running on rank 0" in log and "Running on rank 1" in log  # two processes, one table
        assert sorted(p.name for p in (tmp_path / "cells" / cell).glob("timings*")) == [
            "timings.rank0.jsonl", "timings.rank1.jsonl"]
        assert "torch.distributed.run --standalone --nproc_per_node 2" in json.loads(
            (tmp_path / "cells" / cell / "cell.json").read_text())["command"]


def test_dry_run_lists_cells_commands_refusals_and_an_estimate(tmp_path, capsys):
    assert paper_table.main([*ARGS, "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:5]] == [*CELLS, "sparsevlm-16"]
    assert out[1].startswith("hap-48: python -m hap.lmms_eval --model llava_hf_hap --force_simple --model_args "
                             "pretrained=assets/tiny-llava,device=cpu,dtype=float32,method=hap,retain=0.333")
    assert "--tasks hap_scenes --batch_size 1 --log_samples" in out[1]
    assert out[4].startswith("sparsevlm-16: refused: retain=0.111111 is unreachable")
    assert out[5].startswith("estimate: ") and "6 questions per cell" in out[5]
    assert not (tmp_path / "cells").exists()  # nothing ran
    docs = (tmp_path / "tasks" / scene_task.TASK / "docs.jsonl").read_text().splitlines()
    assert len(docs) == 6 and json.loads(docs[0]).keys() == {"seed", "question", "answer", "kind"}


def test_a_schedule_that_reaches_the_budget_is_picked():
    """A 32-layer decoder with the default first_layers=2 cannot reach 5.6% (its floor is (2 x 144 + 30) / (32 x 144)
    = 0.069): the cell takes first_layers=1; DART, which reads the layer before its cut, gets 1 as well."""
    import torch
    from transformers import AutoModelForImageTextToText

    from hap.hub import load_config

    config = load_config("assets/tiny-llava", "the shipped model")
    config.text_config.num_hidden_layers = 32
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    cells = {c.key: c for c in paper_table.plan_cells(model, ["hap", "dart"], [0.111, 0.056], None)}
    assert list(cells) == ["none-144", "hap-15.98", "dart-15.98", "hap-8.064", "dart-8.064"]
    assert [c.first_layers for c in cells.values()] == [None, 2, 2, 1, 1]
    assert not any(c.refused for c in cells.values())


@pytest.mark.parametrize("argv, message", [
    (["--methods", "hap,hop"], "'hop' is not a method"),
    (["--tokens", "200", "--tasks", "gqa"], "out of range"),
    (["--scenes", "5:x"], "give A:B"),
    (["--scenes", "5:5"], "holds no scene"),
    ([], "no task"),
    (["--scenes", "1:2", "--processes", "0"], "at least 1"),
])
def test_bad_arguments_say_what_is_allowed(tmp_path, capsys, argv, message):
    assert paper_table.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_main_metrics_follow_the_field():
    mme = {"alias": "mme", "mme_cognition_score,none": 300.0, "mme_perception_score,none": 1500.0}
    assert paper_table.main_metric("mme", mme) == ("mme_perception_score+mme_cognition_score", 1800.0)
    pope = {"pope_accuracy,none": 0.86, "pope_f1_score,none": 0.85, "pope_f1_score_stderr,none": 0.01}
    assert paper_table.main_metric("pope", pope) == ("pope_f1_score", 0.85)
    assert paper_table.main_metric("mine", {"acc,none": 0.5, "acc_stderr,none": 0.1}) == ("acc", 0.5)
    with pytest.raises(RuntimeError, match="no metric 'pope_f1_score'"):
        paper_table.main_metric("pope", {"pope_accuracy,none": 0.8})


@pytest.mark.slow
def test_a_task_of_your_own_beside_the_scenes(tmp_path):
    """--include-path (a folder of the user's tasks) and the scenes task reach lmms-eval together."""
    mine = scene_task.write_task(tmp_path / "mine", range(500010, 500012), 1, paper_table.ROOT)
    yaml = mine / f"{scene_task.TASK}.yaml"
    yaml.write_text(yaml.read_text().replace(f"task: {scene_task.TASK}", "task: my_scenes"))
    out = tmp_path / "out"
    assert paper_table.main(["--methods", "hap", "--tokens", "48", "--scenes", "500000:500002", "--tasks", "my_scenes",
                             "--include-path", str(tmp_path / "mine"), "--out", str(out)]) == 0
    rows = table(out)
    assert [(r["method"], r["task"]) for r in rows] == [
        ("none", "my_scenes"), ("none", "hap_scenes"), ("hap", "my_scenes"), ("hap", "hap_scenes")]
    assert all(r["value"] != "" for r in rows)


@pytest.mark.slow
def test_a_failed_cell_is_in_the_table_and_runs_again_next_time(one, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "copy"
    os.system(f"cp -r {one} {copy}")
    (copy / "cells" / "hap-16" / "cell.json").unlink()
    command = paper_table.Setup.command
    monkeypatch.setattr(paper_table.Setup, "command", lambda self, cell: (
        [sys.executable, "-c", "import sys; print('out of memory'); sys.exit(3)", "--model_args", "x"]
        if cell.key == "hap-16" else command(self, cell)))
    assert paper_table.main([*ARGS, "--out", str(copy)]) == 1
    assert "1 cell(s) failed (hap-16)" in capsys.readouterr().err
    row = [r for r in table(copy) if (r["method"], r["tokens"]) == ("hap", "16.0")][0]
    assert row["value"] == "" and row["refused"].startswith("failed: exit 3") and "out of memory" in row["refused"]
    assert "| hap | failed: exit 3, see " in (copy / "table.md").read_text()
    assert not (copy / "cells" / "hap-16" / "cell.json").exists()  # not finished: the next run tries it again


def test_without_lmms_eval_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(paper_table.importlib.util, "find_spec", lambda name: None)
    assert paper_table.main([*ARGS, "--out", str(tmp_path)]) == 2
    assert "bash .ci/install-eval --cli" in capsys.readouterr().err and not (tmp_path / "cells").exists()
