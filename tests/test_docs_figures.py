"""What the docs state about the benchmark and the execution is what the code and `results/benchmark` hold (a stale
figure is a wrong claim): the held-out questions per kind, the PyramidDrop comparison of docs/method.md §7, and which
methods renumber positions (docs/method.md §9, the hook machinery's docstring)."""

import json
import re
from collections import Counter
from pathlib import Path

import hap
from analysis.scenes import heldout_items
from hap.knobs import KNOBS
from hap.pruners import pruner_for
from hap.patch import decoder

ROOT = Path(__file__).resolve().parent.parent
RESULTS = (ROOT / "docs" / "results.md").read_text()
METHOD = (ROOT / "docs" / "method.md").read_text()
BENCHMARK = json.loads((ROOT / "results" / "benchmark" / "benchmark.json").read_text())
METHODS = next(k for k in KNOBS if k.name == "method").choices


def _section(text: str, start: str, end: str) -> str:
    begin = text.index(start)
    return text[begin:text.index(end, begin + len(start))]


def test_the_results_state_the_held_out_questions_per_kind():
    start, stop = (int(s) for s in BENCHMARK["seeds"].split(":"))
    per_scene = BENCHMARK["n_questions"] // (stop - start)
    counts = Counter(q.qtype for _, q in heldout_items(range(start, stop), per_scene))
    stated = re.search(r"(\d+) held-out questions, (\d+) to (\d+) per kind", RESULTS)
    assert stated, "docs/results.md's benchmark paragraph states the questions per kind as 'N to M per kind'"
    assert int(stated[1]) == BENCHMARK["n_questions"] == sum(counts.values())
    assert (int(stated[2]), int(stated[3])) == (min(counts.values()), max(counts.values()))


def test_the_pyramiddrop_comparison_in_the_method_notes_is_the_benchmarks():
    """Every three-decimal figure of docs/method.md's `pdrop_ours` paragraph is pdrop_ours' or pdrop's accuracy or
    relative accuracy at the retain it names, in results/benchmark."""
    paragraph = _section(METHOD, "- `pdrop_ours`:", "\n\n")
    retain = re.search(r"at retain\s+(0\.\d+)", paragraph)[1]
    figures = {f"{BENCHMARK[k][m][retain]:.3f}" for m in ("pdrop_ours", "pdrop") for k in ("accuracy", "relative")}
    stated = set(re.findall(r"\b0\.\d{3}\b", paragraph)) - {retain}
    assert stated and stated <= figures, (stated, figures)
    assert {f"{BENCHMARK['accuracy'][m][retain]:.3f}" for m in ("pdrop_ours", "pdrop")} <= stated


def test_the_execution_docs_name_the_methods_that_renumber_positions():
    renumbering = {m for m in METHODS if pruner_for(hap.HAPConfig(method=m)).renumber}
    assert renumbering == {"pdrop", "visionzip", "sparsevlm", "autoprune", "divprune", "vispruner", "cdpruner",
                           "scope", "holov", "prunesid", "hiprune", "downsample"}
    for name, text in (("docs/method.md §9", _section(METHOD, "## §9", "## §10")), ("decoder.py", decoder.__doc__)):
        sentences = [s for s in re.split(r"(?<=[.;])\s", " ".join(text.split())) if "renumber" in s]
        assert sentences, f"{name} does not say which methods renumber positions"
        for sentence in sentences:
            assert set(re.findall(r"`(\w+)`", sentence)) & set(METHODS) == renumbering, (name, sentence)


def test_the_paper_effect_table_is_its_benchmark():
    """results/paper_effect/README.md: each row's PAQ-weighting and uniform accuracy and their difference in points
    are the run's benchmark.json (the paper's rows, layers and no merge on both sides)."""
    folder = ROOT / "results" / "paper_effect"
    run = json.loads((folder / "benchmark.json").read_text())
    assert (run["config"]["rows"], run["config"]["score_layers"], run["config"]["merge"]) == ("prompt", "segment", "none")
    rows = re.findall(r"^\| ([\d.]+) \(\d+ of 144 tokens\) \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+) points \|$",
                      (folder / "README.md").read_text(), re.M)
    assert [r[0] for r in rows] == list(run["accuracy"]["hap"])
    for retain, paq, uniform, diff in rows:
        got_paq, got_uniform = run["accuracy"]["hap"][retain], run["accuracy"]["uniform"][retain]
        assert (float(paq), float(uniform)) == (round(got_paq, 3), round(got_uniform, 3))
        assert float(diff) == round(100 * (got_paq - got_uniform), 1)


def test_the_field_table_in_the_docs_is_the_committed_run():
    """Every cell of docs/results.md's field table and the README's 16-token figures are results/paper_table's."""
    import csv

    with (ROOT / "results" / "paper_table" / "table.csv").open() as f:
        rows = {(r["method"], float(r["tokens"])): r for r in csv.DictReader(f)}
    section = _section(RESULTS, "## The field's table", "**LLaVA-1.5-7B.**")
    lines = [line for line in section.splitlines() if line.startswith("| ") and "tokens (-" not in line]
    assert len(lines) == len({m for m, _ in rows})  # a line per method, none first
    for line in lines[1:]:
        method, *cells, times = [c.strip() for c in line.strip("|").split("|")]
        for tokens, cell in zip((48.0, 32.0, 16.0), cells):
            row = rows[(method, tokens)]
            expected = "refused" if row["refused"] else (
                f"{float(row['value']):.2f} ({100 * float(row['relative']):.1f}%)")
            assert cell == expected, (method, tokens)
        timed = [rows[(method, t)] for t in (48.0, 16.0)]
        assert times == " / ".join("-" if r["refused"] else f"{float(r['prefill_ms']):.1f}" for r in timed)
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"16 of 144 tokens: HAP\+ keeps ([\d.]+)% of the\s+unpruned score, DivPrune ([\d.]+)%, "
                       r"uniform ([\d.]+)%, the paper's HAP ([\d.]+)%", readme)
    assert stated, "README quotes the field table's 16-token shares"
    assert [float(x) for x in stated.groups()] == [
        round(100 * float(rows[(m, 16.0)]["relative"]), 1) for m in ("hap", "divprune", "uniform", "hap_paper")]
