"""Choice of the token-importance method (docs/method.md §11): each candidate's precision at |answering| on
validation scenes, per question kind, and its cost as a multiple of one prefill.

    python -m analysis.token_methods --model assets/tiny-llava --seeds 400000:400100 --per-scene 3 \
        --out results/causal/token_methods.json

Candidates (`candidates`): every score of `hap.causal.TOKEN_SCORES` (one forward and one backward,
`hap.causal.gradients`; `hap.causal.TOKEN_SCORE` is the one `hap.token_importance` uses), integrated gradients
(`IG_STEPS` points from a zero visual baseline, one batched forward and backward) and grouped occlusion (each
`BLOCK` x `BLOCK` square of patches replaced by the mean visual embedding: the drop in log p, one batched forward),
all explaining the stock model's greedy first answer token. `chance` is the expected precision of a random ranking
(|answering| / visual tokens).

Questions: every validation question with answering patches; `precision` is the mean over the grounded kinds
(`GROUNDED`: the answer lives in the queried objects, dot or letter; not the background, nor a relation between two
objects), `precision_by_kind` covers every kind with answering patches. Cost: the median over the questions of a
candidate's seconds / those of one unpruned prefill of the same inputs (timed just before).
Writes --out (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

import hap
from analysis.causal_speed import prefill
from analysis.scenes import N_PATCHES, QTYPES, heldout_items
from hap import causal

GROUNDED = ("color", "shape", "exist", "count", "letter", "dot")
IG_STEPS = 8
BLOCK = 2  # occlusion squares of BLOCK x BLOCK patches


@dataclass(frozen=True)
class Candidate:
    """A token-importance method: `scores(model, inputs) -> [visual]` (higher = more important) and its
    definition in words."""

    name: str
    definition: str
    scores: Callable[[object, dict], torch.Tensor]


def visual_positions(model, inputs: dict) -> torch.Tensor:
    """`[visual]` positions of the image tokens in batch-1 `inputs`."""
    return (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]


def integrated_gradients(model, inputs: dict, steps: int = IG_STEPS) -> torch.Tensor:
    """`[visual]` |x_v . mean_k d log p(a) / d x_v at (k / steps) x_v|, k = 1..steps (Sundararajan et al. 2017,
    zero baseline on the visual embeddings x_v, the text unchanged; right Riemann sum): one forward and one
    backward of `steps` copies, the last one the stock model whose greedy token is a."""
    visual = visual_positions(model, inputs)
    taken: list[torch.Tensor] = []

    def scaled(x: torch.Tensor) -> torch.Tensor:  # [1, T, D] -> [steps, T, D]
        y = x.expand(steps, -1, -1).clone()
        y[:, visual] *= (torch.arange(1, steps + 1, device=x.device) / steps).to(x)[:, None, None]
        taken.append(y.detach().requires_grad_(True))
        return taken[0]

    with torch.enable_grad(), causal.decoder_input(model, scaled):
        logp = model(**inputs, logits_to_keep=1).logits[:, -1].float().log_softmax(-1)
        answer = int(logp[-1].argmax())
        (grad,) = torch.autograd.grad(logp[:, answer].sum(), taken[0])
    x = taken[0][-1, visual].detach().float()
    return (x * grad[:, visual].float().mean(0)).sum(-1).abs().cpu()


def blocks(n: int, block: int = BLOCK) -> torch.Tensor:
    """`[n]` block index of each token of a row-major square grid of n tokens (block x block squares)."""
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"{n} visual tokens are not a square grid")
    rows, cols = torch.arange(n) // side, torch.arange(n) % side
    return rows // block * -(-side // block) + cols // block


@torch.no_grad()
def occlusion(model, inputs: dict, block: int = BLOCK) -> torch.Tensor:
    """`[visual]` log p(a) - log p(a | the token's block x block square replaced by the mean visual embedding),
    a the stock model's greedy token: one forward of 1 + squares copies, the first the stock model."""
    visual = visual_positions(model, inputs)
    group = blocks(len(visual), block)
    n = int(group.max()) + 1

    def occluded(x: torch.Tensor) -> torch.Tensor:  # [1, T, D] -> [1 + n, T, D]
        y = x.expand(1 + n, -1, -1).clone()
        mean = x[0, visual].mean(0)
        for g in range(n):
            y[1 + g, visual[group == g]] = mean
        return y

    with causal.decoder_input(model, occluded):
        logp = model(**inputs, logits_to_keep=1).logits[:, -1].float().log_softmax(-1)
    answer = int(logp[0].argmax())
    return (logp[0, answer] - logp[1:, answer]).cpu()[group]


def candidates() -> list[Candidate]:
    """Every gradient-pass score of `hap.causal.TOKEN_SCORES`, then integrated gradients and grouped occlusion."""
    scores = [Candidate(name, (fn.__doc__ or "").split(":")[0].strip(),
                        lambda model, inputs, name=name: causal.gradients(model, inputs, name)[3])
              for name, fn in causal.TOKEN_SCORES.items()]
    return [*scores,
            Candidate("integrated_gradients", f"|integrated gradients|, {IG_STEPS} steps, zero baseline",
                      partial(integrated_gradients, steps=IG_STEPS)),
            Candidate("occlusion", f"drop of log p, {BLOCK}x{BLOCK} squares replaced by the mean token",
                      partial(occlusion, block=BLOCK))]


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """(fn(), seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def compare(model, processor, items: list, methods: list[Candidate]) -> tuple[dict, dict]:
    """Over the questions with answering patches: per method, per kind, the precisions at |answering| (and
    `chance`'s); per method (and `prefill`: one unpruned prefill, timed first), the seconds of each question."""
    precision: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    seconds: dict[str, list[float]] = defaultdict(list)
    for scene, question in items:
        target, kind = question.target_mask, question.qtype
        if not target.any():
            continue
        inputs = causal.prepare(model, processor, scene.image, question.text)
        precision["chance"][kind].append(float(target.mean()))
        seconds["prefill"].append(timed(partial(prefill, model, inputs))[1])
        for method in methods:
            tokens, s = timed(partial(method.scores, model, inputs))
            precision[method.name][kind].append(causal.token_precision(tokens, target))
            seconds[method.name].append(s)
    return precision, seconds


def summary(precision: dict[str, dict[str, list[float]]], seconds: dict[str, list[float]],
            methods: list[Candidate]) -> dict:
    """Per method (and `chance`): precision over the grounded kinds and per kind; cost: the median over questions
    of its seconds / one prefill's, and its median seconds per question. The number of questions per kind."""
    kinds = [k for k in QTYPES if k in precision["chance"]]
    counts = {k: len(precision["chance"][k]) for k in kinds}
    prefills = np.array(seconds["prefill"])
    rows = {}
    for name, definition in [*((m.name, m.definition) for m in methods), ("chance", "random ranking, expected")]:
        grounded = [p for k in GROUNDED for p in precision[name].get(k, [])]
        rows[name] = {
            "definition": definition,
            "precision": float(np.mean(grounded)) if grounded else None,
            "precision_by_kind": {k: float(np.mean(precision[name][k])) for k in kinds},
            "cost_prefills": float(np.median(np.array(seconds[name]) / prefills)) if name in seconds else None,
            "seconds_per_question": float(np.median(seconds[name])) if name in seconds else None,
        }
    return {"questions_by_kind": counts, "grounded_kinds": [k for k in GROUNDED if k in counts],
            "prefill_seconds": float(np.median(prefills)), "chosen": causal.TOKEN_SCORE, "methods": rows}


def markdown(r: dict) -> str:
    """The report as a markdown table: a row per method, precision over the grounded kinds, per kind, cost."""
    kinds = list(r["questions_by_kind"])
    lines = [f"Validation seeds {r['seeds']} ({r['per_scene']} questions per scene), {r['model']}; precision at "
             f"|answering| over the grounded kinds ({', '.join(r['grounded_kinds'])}: "
             f"{sum(r['questions_by_kind'][k] for k in r['grounded_kinds'])} questions), then per kind "
             f"(questions); cost in unpruned prefills ({r['prefill_seconds'] * 1e3:.0f} ms each)", "",
             "| method | precision | " + " | ".join(f"{k} ({r['questions_by_kind'][k]})" for k in kinds)
             + " | cost (prefills) |", "|---" * (len(kinds) + 3) + "|"]
    for name, row in r["methods"].items():
        label = f"{name} (chosen)" if name == r["chosen"] else name
        cost = "-" if row["cost_prefills"] is None else f"{row['cost_prefills']:.1f}"
        lines.append(f"| {label} | {_cell(row['precision'])} | "
                     + " | ".join(_cell(row["precision_by_kind"][k]) for k in kinds) + f" | {cost} |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/tiny-llava")
    p.add_argument("--seeds", default="400000:400100", help="validation scene seeds A:B")
    p.add_argument("--per-scene", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results/causal/token_methods.json"))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    a, b = (int(v) for v in args.seeds.split(":"))
    model, processor = hap.load_model(args.model, device="cpu")
    methods = candidates()
    items = list(heldout_items(range(a, b), args.per_scene))
    report = {"model": args.model, "seeds": args.seeds, "per_scene": args.per_scene, "num_visual": N_PATCHES,
              **summary(*compare(model, processor, items, methods), methods)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
