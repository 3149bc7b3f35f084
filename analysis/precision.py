"""Half precision against float32 on one model: answers, kept tokens, PAQ and causal importance, held-out questions.

    python -m analysis.precision --model assets/tiny-llava --seeds 500000:500100 --per-scene 7 --out results/precision

For each dtype of `--dtypes` (the float32 checkpoint's weights cast, on the CPU), every question of the kinds the
model learned (`LEARNED`) is answered under each configuration of `--configs` (`none`: the stock model; `hap`: the
defaults; `hap_paper`: `HAPConfig.paper()`; every baseline by name, at the model's default budget), in left-padded
batches as the benchmark runs them (`analysis.benchmark.run_batch`), and compared with float32:

- `agreement`: the share of questions with float32's answer (and `accuracy` against the truth, per dtype);
- `jaccard`: |A & B| / |A | B| of the original visual indices kept at each cut, mean over questions and cuts;
- `paq_max_diff`, `paq_mean_diff`, `class_agreement`: the largest and the mean PAQ difference over heads and
  questions and the share of heads of the same class, on the unpruned model traced (every layer over every token:
  after a cut, PAQ is taken over the tokens kept, which may differ);
- on the first `--causal` questions: Spearman of exact ablation and of attribution head importance with float32's,
  and the overlap of the ceil(N / 9) most important visual tokens (`hap.causal.token_importance`'s score).

Writes `precision.json` and `precision.md` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import hap
from analysis.benchmark import run_batch
from analysis.scenes import QTYPES, Question, Scene, heldout_items
from hap import causal
from hap.scoring.heads import HeadStats, classify
from hap.runs.trace import STATS
from hap.utility import default_keep

LEARNED = tuple(k for k in QTYPES if k not in ("relation", "letter"))  # at chance on the shipped model (its card)
DTYPES = ("bfloat16", "float16")
CONFIGS = ("none", "hap", "hap_paper")  # the default comparison; any method of hap.METHODS may be added
BATCH = 16

Item = tuple[Scene, Question]


def config_for(name: str) -> hap.HAPConfig:
    """`hap` the defaults, `hap_paper` the paper's HAP, any other name a method of `hap.METHODS` with its defaults."""
    return hap.HAPConfig.paper() if name == "hap_paper" else hap.HAPConfig(method=name)


def answers(model, processor, items: Sequence[Item], name: str, batch: int = BATCH) -> dict:
    """{"answers": [q], "kept": [q][cuts] original indices} of configuration `name`; with `name` "none" (traced) also
    "paq" [q, layers, heads] and "classes" [q][layers][heads]."""
    config, traced = config_for(name), name == "none"
    out: dict = {"answers": [], "kept": [], "paq": [], "classes": []}
    for start in range(0, len(items), batch):
        chunk = list(items[start:start + batch])
        said, state = run_batch(model, processor, chunk, config, trace=traced)
        out["answers"] += said
        out["kept"] += [[c.kept[i].numpy() for c in (state.cuts if state else [])] for i in range(len(chunk))]
        if traced:
            layers = [state.tracer.layers[l] for l in sorted(state.tracer.layers)]
            c = state.config
            classes = [classify(HeadStats(*(getattr(t, k) for k in STATS)), c.tau_sink, c.tau_disp) for t in layers]
            out["paq"] += list(torch.stack([t.paq for t in layers], 1).numpy())  # [B] of [L, H]
            out["classes"] += [[per_layer[i] for per_layer in classes] for i in range(len(chunk))]
    return out


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a & b| / |a | b| of two index sets (1.0 for two empty ones)."""
    union = len(np.union1d(a, b))
    return len(np.intersect1d(a, b)) / union if union else 1.0


def compared(ref: dict, half: dict, truth: list[str]) -> dict:
    """Agreement of one configuration's half-precision run `half` with float32's `ref` (see the module docstring)."""
    same = [a == b for a, b in zip(ref["answers"], half["answers"])]
    cuts = [jaccard(a, b) for ka, kb in zip(ref["kept"], half["kept"]) for a, b in zip(ka, kb)]
    out = {"agreement": float(np.mean(same)), "differ": int(len(same) - sum(same)),
           "accuracy": float(np.mean([a == t for a, t in zip(half["answers"], truth)])),
           "jaccard": float(np.mean(cuts)) if cuts else None, "jaccard_min": float(np.min(cuts)) if cuts else None}
    if ref["paq"]:
        diff = np.abs(np.stack(ref["paq"]) - np.stack(half["paq"]))
        out["paq_max_diff"], out["paq_mean_diff"] = float(diff.max()), float(diff.mean())
        pairs = [(x, y) for r, h in zip(ref["classes"], half["classes"]) for lr, lh in zip(r, h) for x, y in zip(lr, lh)]
        out["class_agreement"] = float(np.mean([x == y for x, y in pairs]))
    return out


def importance(model, processor, items: Sequence[Item]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(exact ablation [L, H], attribution [L, H], token importance [N]) of each item."""
    out = []
    for scene, q in items:
        inputs = causal.prepare(model, processor, scene.image, q.text)
        out.append((causal.ablation(model, inputs)[2], *causal.gradients(model, inputs)[2:]))
    return out


def causal_agreement(ref: list, half: list) -> dict:
    """Mean Spearman of ablation and attribution head importance with float32's, and the mean overlap of the
    ceil(N / 9) most important visual tokens."""
    def top(t: torch.Tensor) -> set[int]:
        return set(torch.argsort(-t, stable=True)[: default_keep(len(t))].tolist())

    return {
        "questions": len(ref),
        "ablation_spearman": float(np.mean([causal.spearman(r[0].ravel(), h[0].ravel()) for r, h in zip(ref, half)])),
        "attribution_spearman": float(np.mean([causal.spearman(r[1].ravel(), h[1].ravel()) for r, h in zip(ref, half)])),
        "token_top_overlap": float(np.mean([len(top(r[2]) & top(h[2])) / len(top(r[2])) for r, h in zip(ref, half)])),
    }


def measure(model_path: str, items: Sequence[Item], dtypes: Sequence[str] = DTYPES,
            configs: Sequence[str] = CONFIGS, causal_questions: int = 0) -> dict:
    """The comparison of every dtype with float32 on `items` (see the module docstring), as JSON."""
    truth = [q.answer for _, q in items]
    runs, causal_runs, seconds = {}, {}, {}
    for dtype in ("float32", *dtypes):
        t0 = time.perf_counter()
        model, processor = hap.load_model(model_path, device="cpu", dtype=dtype)
        runs[dtype] = {name: answers(model, processor, items, name) for name in configs}
        causal_runs[dtype] = importance(model, processor, items[:causal_questions])
        seconds[dtype] = time.perf_counter() - t0
    ref = runs["float32"]
    out = {"model": model_path, "questions": len(items), "kinds": sorted({q.qtype for _, q in items}),
           "configs": list(configs), "seconds": seconds,
           "float32": {name: float(np.mean([a == t for a, t in zip(ref[name]["answers"], truth)])) for name in configs}}
    for dtype in dtypes:
        out[dtype] = {name: compared(ref[name], runs[dtype][name], truth) for name in configs}
        if causal_questions:
            out[dtype]["causal"] = causal_agreement(causal_runs["float32"], causal_runs[dtype])
    return out


def markdown(r: dict, command: str) -> str:
    """The report as a markdown table: one row per dtype and configuration."""
    lines = [f"# Half precision against float32: {r['model']}", "", "```bash", command, "```", "",
             f"{r['questions']} held-out questions ({', '.join(r['kinds'])}); float32 accuracy: "
             + ", ".join(f"{k} {v:.3f}" for k, v in r["float32"].items()) + ". Seconds per dtype (CPU): "
             + ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()) + ".", "",
             "| dtype | config | same answer as float32 | accuracy | kept-token Jaccard (mean / min) | PAQ diff (mean / max) "
             "| same head class |", "|---|---|---|---|---|---|---|"]
    for dtype in (k for k in r if k in ("bfloat16", "float16")):
        for name in r["configs"]:
            c = r[dtype][name]
            jac = "-" if c["jaccard"] is None else f"{c['jaccard']:.3f} / {c['jaccard_min']:.3f}"
            paq = f"{c['paq_mean_diff']:.4f} / {c['paq_max_diff']:.3f}" if "paq_max_diff" in c else "-"
            cls = f"{c['class_agreement']:.3f}" if "class_agreement" in c else "-"
            lines.append(f"| {dtype} | {name} | {c['agreement']:.3f} ({c['differ']} differ) | {c['accuracy']:.3f} "
                         f"| {jac} | {paq} | {cls} |")
    causal_rows = [(d, r[d]["causal"]) for d in ("bfloat16", "float16") if d in r and "causal" in r[d]]
    if causal_rows:
        lines += ["", "| dtype | questions | Spearman, exact ablation | Spearman, attribution | top ceil(N/9) tokens "
                      "shared |", "|---|---|---|---|---|"]
        lines += [f"| {d} | {c['questions']} | {c['ablation_spearman']:.3f} | {c['attribution_spearman']:.3f} "
                  f"| {c['token_top_overlap']:.3f} |" for d, c in causal_rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/tiny-llava")
    p.add_argument("--seeds", default="500000:500100", help="held-out seed range start:stop")
    p.add_argument("--per-scene", type=int, default=len(LEARNED))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=[*hap.METHODS, "hap_paper"])
    p.add_argument("--causal", type=int, default=20, help="questions whose causal importance is compared")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/precision")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start, stop = (int(v) for v in args.seeds.split(":"))
    items = list(heldout_items(range(start, stop), args.per_scene, LEARNED))
    report = measure(args.model, items, args.dtypes, args.configs, args.causal)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(report, indent=1))
    command = "python -m analysis.precision " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "precision.md").write_text(markdown(report, command))
    print(markdown(report, command))
    return report


if __name__ == "__main__":
    main()
