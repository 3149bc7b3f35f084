"""What if heads differed? Accuracy of every pruner as planted sink (or dispersed) heads take a growing share of
the scoring layers' heads (`hap.plant`, docs/method.md §14), on held-out scenes.

    python -m analysis.heterogeneity --seeds 500000:500060 --per-scene 2 --out results/heterogeneity
    python -m analysis.heterogeneity --seeds 500000:500060 --per-scene 2 --no-massive --kinds sink \
        --out results/heterogeneity/no-massive

For each kind (sinks parked on 1 and on 4 sink tokens per image: `--sink-tokens`, the most redundant visual tokens of
each image; dispersed heads) and each share (25, 50, 75% of the heads of every scoring layer, drawn with a fixed seed
per share, the same heads for every kind; share 0 plants nothing and is run once), the plan is planted for the whole
run and: the unpruned accuracy with the plan (what the plan itself costs the model), the accuracy of every method at
each budget (`hap.METHODS` but "none" and the two that cannot run here: SparseVLM's smallest budget on the 6-layer
decoder is above 11.1% and AutoPrune prunes one prompt at a time; plus `hap_paper`, the paper's HAP on the run's
schedule), and the classifier's precision / recall on the plan from the unpruned traced prompt rows, under the paper's
norm sink test and under the attention-consensus one. Planted sink tokens carry a massive activation (`hap.plant`'s
`massive=True`, as real sinks do) unless `--no-massive`. The scoring layers are those whose maps score HAP's cuts
(the run's knobs, the lookahead of a cut before layer 0 included). Every knob of `hap.knobs` but the method and the
budget is a flag, as in `analysis.benchmark`.

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
from hap.scoring.heads import HeadStats, classify
from hap.pruners import pruner_for
from hap.patch.decoder import decoder_shape
from hap.lab.plan import Plan, classifier_report, share_plan
from hap.runs.run import chat_prompt
from analysis.benchmark import KNOB_FLAGS, SCHEDULE, load_run, method_run, run_batch, run_parser
from analysis.scenes import N_PATCHES

SHARES = (0.0, 0.25, 0.5, 0.75)
RETAINS = (0.111, 0.056)
SINK_TOKENS = (1, 4)
UNRUNNABLE = ("none", "sparsevlm", "autoprune")  # the stock model; above 11.1% here; one prompt at a time
PAPER_UNIFORM = "hap_paper_uniform"  # the paper's HAP with uniform head averaging (T = inf): PAQ weighting's share
METHODS = (*(m for m in hap.METHODS if m not in UNRUNNABLE), "hap_paper", PAPER_UNIFORM)
DETECTORS = ("norm", "consensus")
SEED = 0  # the head draw of share i uses SEED + i


def parser() -> argparse.ArgumentParser:
    p = run_parser(__doc__, "500000:500200", "results/heterogeneity", RETAINS, KNOB_FLAGS)
    p.set_defaults(per_scene=1)
    p.add_argument("--shares", type=float, nargs="+", default=list(SHARES))
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--strength", type=float, default=0.9)
    p.add_argument("--sink-tokens", type=int, nargs="+", default=list(SINK_TOKENS),
                   help="sink tokens per image of the sink plans (one plan kind per count)")
    p.add_argument("--kinds", nargs="+", default=["sink", "dispersed"], choices=["sink", "dispersed"])
    p.add_argument("--no-massive", dest="massive", action="store_false",
                   help="planted sink tokens without the massive activation (hap.plant(massive=False))")
    return p


def kinds_of(args) -> list[tuple[str, str, int | None]]:
    """(key, planted class, sink tokens per image) of each plan kind of the run: `sink_<count>` per count, then
    `dispersed`."""
    kinds = [(f"sink_{c}", "sink", c) for c in args.sink_tokens] if "sink" in args.kinds else []
    return kinds + ([("dispersed", "dispersed", None)] if "dispersed" in args.kinds else [])


def hap_scoring_layers(model, base: dict, retain: float, num_visual: int, text_tokens: int) -> list[int]:
    """The layers whose prompt-row maps score HAP's cuts with the run's knobs at `retain` (`hap.planning.budget.plan`)."""
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


def method_config(name: str, retain: float, base: dict, batch) -> tuple[hap.HAPConfig, torch.Tensor | None]:
    """(config, priority) of a method of this run: `analysis.benchmark.method_run`'s, or PAPER_UNIFORM (the paper's
    HAP on the run's schedule with every head weighted alike: what the paper's PAQ weighting adds is hap_paper minus
    it)."""
    if name == PAPER_UNIFORM:
        return hap.HAPConfig.paper(retain=retain, temperature=math.inf, **{k: base[k] for k in SCHEDULE}), None
    return method_run(name, retain, base, batch)


def run_plan(model, processor, batches: list, plan: Plan, base: dict, args) -> dict:
    """One plan planted for the whole run: unpruned accuracy, every method at every budget, the classifier's scores
    on the plan's heads of each class (`classifier[class][detector]`) under each detector."""
    correct: dict[tuple, list[bool]] = {}
    scores = {d: ([], []) for d in DETECTORS}
    with hap.plant(model, plan.sink, plan.dispersed, plan.sink_tokens, plan.strength, plan.massive):
        for batch in batches:
            truth = [q.answer for _, q in batch]
            runs = [("none", 1.0)] + [(m, r) for r in args.retain for m in args.methods]
            for method, retain in runs:
                config, priority = method_config(method, retain, base, batch)
                answers, _ = run_batch(model, processor, batch, config, trace=False, priority=priority)
                correct.setdefault((method, retain), []).extend(a == t for a, t in zip(answers, truth))
            for detector in DETECTORS:
                reports, false = classifier_scores(model, processor, batch, plan, base, detector)
                scores[detector][0].extend(reports)
                scores[detector][1].extend(false)
    return {"unpruned": float(np.mean(correct[("none", 1.0)])),
            "accuracy": {m: {str(r): float(np.mean(correct[(m, r)])) for r in args.retain} for m in args.methods},
            "classifier": {kind: {d: {"precision": mean([r[kind]["precision"] for r in reports]),
                                      "recall": mean([r[kind]["recall"] for r in reports])}
                                  for d, (reports, _) in scores.items()} for kind in ("sink", "dispersed")},
            "false_sink_rate": {d: mean(false) for d, (_, false) in scores.items()},
            "plan": plan.to_json()}


def evaluate(model, processor, batches: list, base: dict, args) -> dict:
    """Every kind x share: unpruned accuracy, every method at every budget, the classifier's scores (share 0, where
    nothing is planted, runs once for every kind)."""
    text = model.config.text_config
    scene, question = batches[0][0]
    inputs = processor(images=scene.image, text=chat_prompt(processor, question.text), return_tensors="pt")
    T = inputs["input_ids"].shape[1]
    layers = hap_scoring_layers(model, base, min(args.retain), N_PATCHES, T - N_PATCHES)
    out = {"scoring_layers": layers, "accuracy": {}, "unpruned": {}, "classifier": {}, "false_sink_rate": {},
           "plans": {}}
    nothing = None
    for key, kind, count in kinds_of(args):
        for name in ("accuracy", "unpruned", "classifier", "false_sink_rate", "plans"):
            out[name][key] = {}
        for i, share in enumerate(args.shares):
            plan = share_plan(layers, text.num_attention_heads, share, SEED + i, kind, sink_tokens=count,
                              strength=args.strength, massive=args.massive)
            if plan.empty:
                nothing = nothing or run_plan(model, processor, batches, plan, base, args)
                row = nothing
            else:
                row = run_plan(model, processor, batches, plan, base, args)
            for name in ("accuracy", "unpruned", "false_sink_rate"):
                out[name][key][str(share)] = row[name]
            out["classifier"][key][str(share)] = row["classifier"][kind]
            out["plans"][key][str(share)] = plan.to_json()
            print(f"{key} {share:.2f}: unpruned {row['unpruned']:.3f}, "
                  + ", ".join(f"{m} {v}" for m, v in row["accuracy"].items()), flush=True)
    return out


def _cell(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def title(key: str) -> str:
    """A plan kind's words: `sink_4` -> "sink heads parked on 4 sink tokens per image"."""
    if key.startswith("sink_"):
        count = int(key.split("_")[1])
        return f"sink heads parked on {count} sink token{'s' if count > 1 else ''} per image"
    return f"{key} heads"


GAPS = (("hap_paper", "uniform"), ("hap_paper", PAPER_UNIFORM))  # the paper's HAP against uniform averaging, and
#                                                                  against itself with uniform head weights


def gap(r: dict, a: str, b: str) -> dict:
    """Accuracy of method `a` minus method `b`, in points, per kind x share x retain."""
    return {k: {s: {t: 100 * (row[a][t] - row[b][t]) for t in row[b]} for s, row in shares.items()}
            for k, shares in r["accuracy"].items()}


def markdown(r: dict) -> str:
    sinks = "with a massive activation (hap.plant massive=True)" if r["massive"] else "without a massive activation"
    lines = [f"Held-out questions: {r['n_questions']} (seeds {r['seeds']}); planted in the scoring layers "
             f"{r['scoring_layers']} ({r['heads']} heads each), strength {r['strength']}; sink tokens (the most "
             f"redundant visual tokens of each image) {sinks}. Cells: accuracy at retain "
             + " / ".join(f"{float(t):.1%}" for t in r["retain"]) + ".", ""]
    gaps = {(a, b): gap(r, a, b) for a, b in GAPS if {a, b} <= set(r["methods"])}
    for kind, rows in r["accuracy"].items():
        shares = list(rows)
        lines += [f"Planted {title(kind)}, share of the scoring layers' heads:", "",
                  "| method | " + " | ".join(f"{float(s):.0%}" for s in shares) + " |",
                  "|---" * (len(shares) + 1) + "|",
                  "| unpruned (with the plan) | " + " | ".join(_cell(r["unpruned"][kind][s]) for s in shares) + " |"]
        for m in r["methods"]:
            lines.append(f"| {m} | " + " | ".join(
                " / ".join(_cell(v) for v in rows[s][m].values()) for s in shares) + " |")
        for (a, b), points in gaps.items():
            lines.append(f"| {a} - {b} (points) | " + " | ".join(
                " / ".join(f"{v:+.1f}" for v in points[kind][s].values()) for s in shares) + " |")
        planted = "sink" if kind.startswith("sink") else kind
        for d in DETECTORS:
            lines.append(f"| classifier ({d} sinks): precision / recall on the planted {planted} heads | "
                         + " | ".join(f"{_cell(r['classifier'][kind][s][d]['precision'])} / "
                                      f"{_cell(r['classifier'][kind][s][d]['recall'])}" for s in shares) + " |")
            lines.append(f"| unplanted heads classified sink ({d}) | "
                         + " | ".join(_cell(r["false_sink_rate"][kind][s][d]) for s in shares) + " |")
        lines.append("")
    return "\n".join(lines)


def plots(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds, retains = list(r["accuracy"]), [str(t) for t in r["retain"]]
    fig, axes = plt.subplots(len(kinds), len(retains), figsize=(5.2 * len(retains), 3.6 * len(kinds)), squeeze=False)
    for row, kind in enumerate(kinds):
        shares = list(r["accuracy"][kind])
        xs = [100 * float(s) for s in shares]
        for col, retain in enumerate(retains):
            ax = axes[row][col]
            ax.plot(xs, [r["unpruned"][kind][s] for s in shares], "k--", label="unpruned (with the plan)")
            for m in r["methods"]:
                ax.plot(xs, [r["accuracy"][kind][s][m][retain] for s in shares], marker="o", label=m,
                        linewidth=2.5 if m in ("hap_paper", "uniform") else 1.2)
            ax.set_xticks(xs)
            ax.set_xlabel("planted heads, % of the scoring layers' heads", fontsize=8)
            ax.set_ylabel("held-out accuracy", fontsize=8)
            ax.set_title(f"{title(kind)}, retain {float(retain):.1%}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    sinks = "massive sink tokens" if r["massive"] else "sink tokens without massive activation"
    fig.suptitle(f"{Path(r['model']).name}: what if heads differed? ({r['n_questions']} held-out questions, "
                 f"planted heads, {sinks})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    model, processor, items, batches, base = load_run(args, KNOB_FLAGS)
    t0 = time.perf_counter()
    report = {"model": args.model, "seeds": args.seeds, "n_questions": len(items), "config": base,
              "strength": args.strength, "massive": args.massive, "sink_tokens": args.sink_tokens,
              "retain": args.retain, "methods": args.methods,
              "heads": model.config.text_config.num_attention_heads, **evaluate(model, processor, batches, base, args)}
    report["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heterogeneity.json").write_text(json.dumps(report, indent=1))
    (args.out / "heterogeneity.md").write_text(markdown(report))
    plots(report, args.out / "heterogeneity.png")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
