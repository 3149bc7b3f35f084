"""Ablation of the HAP+ knobs (docs/method.md §10) against the paper's HAP, on validation scenes.

    python -m analysis.ablation --model assets/tiny-llava --seeds 400000:400100 --retain 0.111 0.056 \
        --out results/ablation

Every non-paper choice of each HAP+ knob alone, then all of them together (`TOGETHER`: one choice
per knob, first_cut="prerope" of its two), then the library defaults (`hap.HAPConfig()`'s departures
from the paper, chosen on this table) with PAQ weighting and with plain head averaging, each as
`hap.HAPConfig.paper(**change)` on one schedule (first_layers, groups, decay: the library's per-model
defaults unless given), so a row differs from `hap_paper` in its change only. Cells: accuracy, its
difference to `hap_paper`, and the recall of the queried object's patches among the tokens present
(averaged over decoder layers, as the budget). Writes ablation.json and ablation.md to --out.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import hap
from analysis.benchmark import SCHEDULE, Tally, load_run, run_batch, run_parser

ALONE: dict[str, tuple[str, ...]] = {  # knob -> its non-paper choices, each tried alone
    "head_weight": ("paq_visual",),
    "sink_ranking": ("mask", "mask_keep_one"),
    "sink_detector": ("consensus", "both"),
    "rows": ("last", "question"),
    "score_layers": ("last",),
    "merge": ("average", "proportional"),
    "first_cut": ("prerope", "vision"),
}
TOGETHER = {"head_weight": "paq_visual", "sink_ranking": "mask_keep_one", "sink_detector": "both",
            "rows": "question", "score_layers": "last", "merge": "proportional", "first_cut": "prerope"}


def defaults() -> dict[str, object]:
    """The knobs where the library defaults (`hap.HAPConfig()`) depart from the paper."""
    return {k.name: k.default for k in hap.KNOBS if k.paper is not None and k.default != k.paper}


def variants() -> dict[str, dict]:
    """Row name -> the knobs it changes from the paper: none (`hap_paper`), each alone, all together, the
    library defaults, and the defaults with plain head averaging (T = inf: what PAQ weighting adds to them)."""
    rows = {"hap_paper": {}}
    rows.update({f"{name}={value}": {name: value} for name, values in ALONE.items() for value in values})
    rows["all"] = dict(TOGETHER)
    rows["defaults"] = defaults()
    rows["defaults, T=inf"] = {**defaults(), "temperature": float("inf")}
    return rows


def parser() -> argparse.ArgumentParser:
    return run_parser(__doc__, "400000:400100", "results/ablation", (0.111, 0.056), SCHEDULE)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    model, processor, items, batches, schedule = load_run(args, SCHEDULE)
    rows = variants()
    tally = Tally()
    t0 = time.perf_counter()
    for batch in batches:
        answers, state = run_batch(model, processor, batch, hap.HAPConfig(method="none"), trace=False)
        tally.add(("none", 1.0), batch, answers, state)
        for retain in args.retain:
            for name, change in rows.items():
                config = hap.HAPConfig.paper(retain=retain, **schedule, **change)
                answers, state = run_batch(model, processor, batch, config, trace=False)
                tally.add((name, retain), batch, answers, state)
    correct, recall = tally.correct, tally.recall
    report = {
        "model": args.model,
        "seeds": args.seeds,
        "n_questions": len(items),
        "schedule": schedule,
        "unpruned_accuracy": float(np.mean(correct[("none", 1.0)])),
        "seconds": time.perf_counter() - t0,
        "variants": {name: {
            "change": change,
            "accuracy": {str(r): float(np.mean(correct[(name, r)])) for r in args.retain},
            "delta": {str(r): float(np.mean(correct[(name, r)]) - np.mean(correct[("hap_paper", r)]))
                      for r in args.retain},
            "kept_recall": {str(r): float(np.mean(recall[(name, r)])) for r in args.retain},
        } for name, change in rows.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ablation.json").write_text(json.dumps(report, indent=1))
    (args.out / "ablation.md").write_text(markdown(report))
    print(markdown(report))
    return report


def markdown(r: dict) -> str:
    retains = list(next(iter(r["variants"].values()))["accuracy"])
    lines = [f"HAP+ ablation on {r['n_questions']} validation questions (seeds {r['seeds']}), model {r['model']}, "
             f"schedule {r['schedule']}; unpruned accuracy {r['unpruned_accuracy']:.3f}. Cells: accuracy "
             "(difference to hap_paper) / kept recall of the queried object's patches.", "",
             "| variant | " + " | ".join(f"retain {x}" for x in retains) + " |", "|---" * (len(retains) + 1) + "|"]
    for name, v in r["variants"].items():
        cells = [f"{v['accuracy'][x]:.3f} ({v['delta'][x]:+.3f}) / {v['kept_recall'][x]:.2f}" for x in retains]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
