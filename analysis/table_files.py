"""The files of `analysis.paper_table`: `table.csv`, `table.md` (the field's layout) and `table.png`.

`table.md` is laid out as the pruning papers print it: the unpruned model first (the upper bound), then one block per
budget ("Retain 64 tokens (-88.9%)") with a row per method; a column per task (its main metric, fractions shown as
percentages), then Avg (the mean of those columns, MME counted as a share of its 2,800 points), Rel. (the mean share
of the unpruned score, the field's usual summary), the prefill FLOPs ratio, the median prefill time per sample and,
on a GPU, its median peak memory. A refused cell's row gives its reason instead of scores.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

COLUMNS = ("method", "tokens", "retain", "task", "metric", "value", "relative", "samples", "first_layers",
           "flops_ratio", "prefill_ms", "peak_mb", "refused")  # the first eight are binding
FRACTIONS = {"exact_match", "pope_f1_score", "pope_accuracy", "mmmu_acc"}  # lmms-eval reports these in [0, 1]
MME_POINTS = 2800.0  # perception (2,000) + cognition (800)
MARKERS = "osD^vPX*<>ph"


def rows(cells: list, records: dict[str, dict], tasks: tuple[str, ...]) -> list[dict]:
    """One row per cell and task (`COLUMNS`); `relative` divides by the unpruned cell's value of the task; `refused`
    holds why a cell did not run (refused before running, or "failed: ..." with its log)."""
    upper = records.get(cells[0].key, {}).get("scores", {})
    out = []
    for cell in cells:
        record = records.get(cell.key, {})
        timings = record.get("timings", {})
        for task in tasks:
            score = record.get("scores", {}).get(task)
            base = upper.get(task, {}).get("value")
            out.append({
                "method": cell.row, "tokens": round(cell.tokens, 2), "retain": round(cell.retain, 6), "task": task,
                "metric": (score or upper.get(task) or {"metric": ""})["metric"],
                "value": None if score is None else score["value"],
                "relative": None if score is None or not base else score["value"] / base,
                "samples": "" if score is None else score["samples"], "first_layers": cell.first_layers,
                "flops_ratio": timings.get("flops_ratio"), "prefill_ms": timings.get("prefill_ms"),
                "peak_mb": timings.get("peak_mb"), "refused": cell.refused or record.get("failed", "")})
    return out


def write_csv(path: Path, table: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in table)


def shown(metric: str, value: float) -> float:
    """A score as the table prints it: a fraction as a percentage, points as points."""
    return 100 * value if metric in FRACTIONS else value


def average(task_rows: list[dict]) -> float:
    """Avg: the mean of the printed scores, MME as a percentage of its points."""
    return float(np.mean([100 * r["value"] / MME_POINTS if r["task"] == "mme" else shown(r["metric"], r["value"])
                          for r in task_rows]))


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def markdown(table: list[dict], tasks: tuple[str, ...], model: str, num_visual: float) -> str:
    """The field's layout (module docstring)."""
    by_cell: dict[tuple[str, float], list[dict]] = {}
    for r in table:
        by_cell.setdefault((r["method"], r["tokens"]), []).append(r)
    metrics = {r["task"]: r["metric"] for r in table}
    head = ["Method", *(f"{t} ({metrics[t]})" for t in tasks), "Avg", "Rel.", "FLOPs", "prefill ms", "peak MB"]
    lines = [f"# {model}: every method at every budget", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    budget = None
    for (method, tokens), cell_rows in by_cell.items():
        first = cell_rows[0]
        if method != "none" and tokens != budget:
            budget = tokens
            label = f"**Retain {tokens:g} tokens ({-100 * (1 - tokens / num_visual):.1f}%)**"
            lines.append("| " + " | ".join([label, *[""] * (len(head) - 1)]) + " |")
        name = f"Upper bound ({method}, {tokens:g} tokens)" if method == "none" else method
        if first["refused"]:
            reason = " ".join(first["refused"].split()).replace("|", "/")
            reason = reason if reason.startswith("failed: ") else f"refused: {reason}"
            lines.append("| " + " | ".join([name, reason, *[""] * (len(head) - 2)]) + " |")
            continue
        scores = [_num(shown(r["metric"], r["value"]), ".1f") for r in cell_rows]
        rel = float(np.mean([r["relative"] for r in cell_rows])) if all(r["relative"] is not None
                                                                           for r in cell_rows) else None
        lines.append("| " + " | ".join([name, *scores, _num(average(cell_rows), ".1f"),
                                        "-" if rel is None else f"{100 * rel:.1f}%",
                                        _num(first["flops_ratio"], ".3f"), _num(first["prefill_ms"], ".1f"),
                                        _num(first["peak_mb"], ".0f")]) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path, table: list[dict], model: str, num_visual: float) -> None:
    """The share of the unpruned score kept (Rel.) against the tokens, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, dict[float, list[float]]] = {}
    for r in table:
        if r["method"] != "none" and r["relative"] is not None:
            lines.setdefault(r["method"], {}).setdefault(r["tokens"], []).append(r["relative"])
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, (method, points) in enumerate(lines.items()):  # a colour and a marker of its own per method
        xs = sorted(points)
        ax.plot(xs, [100 * np.mean(points[x]) for x in xs], marker=MARKERS[i % len(MARKERS)],
                color=plt.cm.tab20(i % 20), label=method)
    ax.axhline(100, color="grey", linestyle="--", linewidth=1, label=f"none ({num_visual:g} tokens)")
    ax.set_xlabel("visual tokens per image, averaged over the decoder layers")
    ax.set_ylabel("share of the unpruned score kept (%)")
    ax.set_title(f"{model}: the mean share over the tasks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tables(out: Path, cells: list, records: dict[str, dict], tasks: tuple[str, ...], model: str) -> None:
    """table.csv, table.md and table.png in `out` from the cells (the unpruned one first) and their records."""
    table = rows(cells, records, tasks)
    num_visual = cells[0].tokens
    write_csv(out / "table.csv", table)
    (out / "table.md").write_text(markdown(table, tasks, model, num_visual))
    plot(out / "table.png", table, model, num_visual)
