"""What if heads differed? Accuracy of every pruner as planted sink (or dispersed) heads take a growing share of
the scoring layers' heads (`hap.plant`, docs/method.md §14), on held-out scenes.

    python -m analysis.heterogeneity --model assets/tiny-llava --seeds 500000:500200 --out results/heterogeneity

For each kind (sink, dispersed) and each share (0, 25, 50, 75% of the heads of every scoring layer, drawn with a
fixed seed per share), the plan is planted for the whole run and: the unpruned accuracy with the plan (what the
plan itself costs the model), the accuracy of every method at each budget (`hap.METHODS` but "none", plus
`hap_paper`, the paper's HAP on the run's schedule; a method added to `hap.METHODS` joins automatically), and the
classifier's precision / recall on the plan from the unpruned traced prompt rows, under the run's sink detector and
under the attention-consensus one (a planted sink has no massive activation, so the paper's norm detector cannot see
it). The scoring layers are those whose maps score HAP's cuts (the run's knobs, the lookahead of a cut before layer
0 included); the plan's sink tokens are the default (the most redundant visual token of each image). Every knob of
`hap.knobs` but the method and the budget is a flag, as in `analysis.benchmark`.

Outputs in --out: heterogeneity.json (accuracy[kind][share][method][retain], unpruned[kind][share],
classifier[kind][share][detector] = {precision, recall} averaged over questions, false_sink_rate[kind][share]
[detector]: the share of unplanted heads classified sink), heterogeneity.md and heterogeneity.png.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

import hap
from hap.heads import HeadStats, classify
from hap.pruners import pruner_for
from hap.patch.decoder import decoder_shape
from hap.planting import Plan, classifier_report, share_plan
from hap.run import chat_prompt
from analysis.benchmark import KNOB_FLAGS, load_run, method_run, run_batch, run_parser
from analysis.scenes import N_PATCHES

SHARES = (0.0, 0.25, 0.5, 0.75)
RETAINS = (0.111, 0.056)
KINDS = ("sink", "dispersed")
METHODS = (*(m for m in hap.METHODS if m != "none"), "hap_paper")
DETECTORS = ("norm", "consensus")
SEED = 0  # the head draw of share i uses SEED + i


def parser() -> argparse.ArgumentParser:
    p = run_parser(__doc__, "500000:500200", "results/heterogeneity", RETAINS, KNOB_FLAGS)
    p.set_defaults(per_scene=1)
    p.add_argument("--shares", type=float, nargs="+", default=list(SHARES))
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--strength", type=float, default=0.9)
    return p


def hap_scoring_layers(model, base: dict, retain: float, num_visual: int, text_tokens: int) -> list[int]:
    """The layers whose prompt-row maps score HAP's cuts with the run's knobs at `retain` (`hap.budget.plan`)."""
    config = hap.HAPConfig(method="hap", retain=retain, **base)
    schedule = hap.plan(config, decoder_shape(model), num_visual, text_tokens)
    starts = [0, *schedule.cuts]
    pruner = pruner_for(config.resolved(schedule.num_layers))
    return sorted({l for g, cut in enumerate(schedule.cuts) for l in pruner.scoring_layers((starts[g], cut))})


def classes_of(state, config: hap.HAPConfig) -> list[list[list[str]]]:
    """Head classes `[questions][layers][heads]` of a traced run (every layer traced)."""
    traced = state.tracer.layers
    per_layer = [classify(HeadStats(t.sink_share, t.dispersion, t.visual_share, t.paq), config.tau_sink,
                          config.tau_disp) for _, t in sorted(traced.items())]  # [layers][questions][heads]
    return [list(rows) for rows in zip(*per_layer)]


def classifier_scores(model, processor, batch, plan: Plan, base: dict, detector: str) -> tuple[list[dict], list[float]]:
    """Per question: the classifier's report on `plan` (`classifier_report`) under sink detector `detector`, and
    the share of the unplanted heads it classified sink."""
    config = hap.HAPConfig(method="none", **{**base, "sink_detector": detector})
    _, state = run_batch(model, processor, batch, config, trace=True, max_new_tokens=1)
    reports, false = [], []
    planted = set(plan.sink)
    for classes in classes_of(state, config):
        reports.append(classifier_report(plan, classes))
        heads = [(l, h) for l, row in enumerate(classes) for h, c in enumerate(row) if c]
        unplanted = [k for k in heads if k not in planted]
        false.append(sum(classes[l][h] == "sink" for l, h in unplanted) / max(1, len(unplanted)))
    return reports, false


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def evaluate(model, processor, batches: list, base: dict, args) -> dict:
    """Every kind x share: unpruned accuracy, every method at every budget, the classifier's scores."""
    text = model.config.text_config
    scene, question = batches[0][0]
    inputs = processor(images=scene.image, text=chat_prompt(processor, question.text), return_tensors="pt")
    T = inputs["input_ids"].shape[1]
    layers = hap_scoring_layers(model, base, min(args.retain), N_PATCHES, T - N_PATCHES)
    out = {"scoring_layers": layers, "accuracy": {}, "unpruned": {}, "classifier": {}, "false_sink_rate": {},
           "plans": {}}
    for kind in KINDS:
        for key in ("accuracy", "unpruned", "classifier", "false_sink_rate", "plans"):
            out[key][kind] = {}
        for i, share in enumerate(args.shares):
            plan = share_plan(layers, text.num_attention_heads, share, SEED + i, kind, strength=args.strength)
            out["plans"][kind][str(share)] = plan.to_json()
            correct: dict[tuple, list[bool]] = {}
            scores = {d: ([], []) for d in DETECTORS}
            with hap.plant(model, plan.sink, plan.dispersed, plan.sink_tokens, plan.strength):
                for batch in batches:
                    truth = [q.answer for _, q in batch]
                    runs = [("none", 1.0)] + [(m, r) for r in args.retain for m in args.methods]
                    for method, retain in runs:
                        config, priority = method_run(method, retain, base, batch)
                        answers, _ = run_batch(model, processor, batch, config, trace=False, priority=priority)
                        correct.setdefault((method, retain), []).extend(a == t for a, t in zip(answers, truth))
                    for detector in DETECTORS:
                        reports, false = classifier_scores(model, processor, batch, plan, base, detector)
                        scores[detector][0].extend(reports)
                        scores[detector][1].extend(false)
            out["unpruned"][kind][str(share)] = float(np.mean(correct[("none", 1.0)]))
            out["accuracy"][kind][str(share)] = {m: {str(r): float(np.mean(correct[(m, r)])) for r in args.retain}
                                                 for m in args.methods}
            out["classifier"][kind][str(share)] = {
                d: {"precision": mean([r[kind]["precision"] for r in reports]),
                    "recall": mean([r[kind]["recall"] for r in reports])} for d, (reports, _) in scores.items()}
            out["false_sink_rate"][kind][str(share)] = {d: mean(false) for d, (_, false) in scores.items()}
            print(f"{kind} {share:.2f}: unpruned {out['unpruned'][kind][str(share)]:.3f}, "
                  + ", ".join(f"{m} {v}" for m, v in out["accuracy"][kind][str(share)].items()), flush=True)
    return out


def _cell(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def markdown(r: dict) -> str:
    lines = [f"Held-out questions: {r['n_questions']} (seeds {r['seeds']}); planted in the scoring layers "
             f"{r['scoring_layers']} ({r['heads']} heads each), strength {r['strength']}, default sink tokens (the "
             f"most redundant visual token of each image). Cells: accuracy at retain 11.1% / 5.6%.", ""]
    for kind in KINDS:
        shares = list(r["accuracy"][kind])
        lines += [f"Planted {kind} heads, share of the scoring layers' heads:", "",
                  "| method | " + " | ".join(f"{float(s):.0%}" for s in shares) + " |",
                  "|---" * (len(shares) + 1) + "|",
                  "| unpruned (with the plan) | " + " | ".join(_cell(r["unpruned"][kind][s]) for s in shares) + " |"]
        for m in r["methods"]:
            lines.append(f"| {m} | " + " | ".join(
                " / ".join(_cell(v) for v in r["accuracy"][kind][s][m].values()) for s in shares) + " |")
        for d in DETECTORS:
            lines.append(f"| classifier ({d} sinks): precision / recall on the planted {kind} heads | " + " | ".join(
                f"{_cell(r['classifier'][kind][s][d]['precision'])} / {_cell(r['classifier'][kind][s][d]['recall'])}"
                for s in shares) + " |")
            lines.append(f"| unplanted heads classified sink ({d}) | "
                         + " | ".join(_cell(r["false_sink_rate"][kind][s][d]) for s in shares) + " |")
        lines.append("")
    return "\n".join(lines)


def plots(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    retains = list(next(iter(next(iter(r["accuracy"]["sink"].values())).values())))
    fig, axes = plt.subplots(len(KINDS), len(retains), figsize=(5.2 * len(retains), 3.8 * len(KINDS)), squeeze=False)
    for row, kind in enumerate(KINDS):
        shares = list(r["accuracy"][kind])
        xs = [100 * float(s) for s in shares]
        for col, retain in enumerate(retains):
            ax = axes[row][col]
            ax.plot(xs, [r["unpruned"][kind][s] for s in shares], "k--", label="unpruned (with the plan)")
            for m in r["methods"]:
                ax.plot(xs, [r["accuracy"][kind][s][m][retain] for s in shares], marker="o", label=m)
            ax.set_xticks(xs)
            ax.set_xlabel(f"planted {kind} heads, % of the scoring layers' heads")
            ax.set_ylabel("held-out accuracy")
            ax.set_title(f"planted {kind} heads, retain {float(retain):.1%}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{Path(r['model']).name}: what if heads differed? ({r['n_questions']} held-out questions, "
                 "planted heads, not the model's own)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    model, processor, items, batches, base = load_run(args, KNOB_FLAGS)
    t0 = time.perf_counter()
    report = {"model": args.model, "seeds": args.seeds, "n_questions": len(items), "config": base,
              "strength": args.strength, "methods": args.methods, "heads": model.config.text_config.num_attention_heads,
              **evaluate(model, processor, batches, base, args)}
    report["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heterogeneity.json").write_text(json.dumps(report, indent=1))
    (args.out / "heterogeneity.md").write_text(markdown(report))
    plots(report, args.out / "heterogeneity.png")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
