"""PAQ readings against head utility, on validation scenes (docs/method.md §12).

    python -m analysis.paq_readings --model assets/tiny-llava --seeds 400000:400030 --rows last \
        --out results/causal/paq_readings.json

PAQ today is a focus score, (1 - sink share)(1 - normalised entropy). The paper's title says "via cross-modal
alignment"; each reading of `READINGS` is one way to read that, a pure function of what one traced unpruned prefill
(and, for `contrast`, a second one with a neutral prompt) gives per layer, `LayerView` -> `[heads]`. Per question
the script measures head utility once (`hap.utility`, rows `--rows`, keep ceil(N / 9)) and every reading, then
Spearman(reading, utility) over the scored heads (pooled over layers, as `utility_spearman`) and within each layer
(`hap.utility.within_layers`: the heads one layer's weighting chooses between). Two baselines that are no reading of
an input: `depth` (the layer index: a later cut leaves fewer layers on the kept tokens, so utility grows with depth
and pooled Spearman rewards any reading that does) and `prior` (the mean utility of each head over the other half of
the questions: a per-model head prior calibrated on validation scenes, cross-fitted). Writes the JSON and prints the
table (markdown).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import hap
from hap import utility
from hap.causal import paq_spearman, prepare
from hap.patch import attention_outputs, decoder_of
from hap.runs.run import template_tail
from analysis.scenes import QTYPES, heldout_items

NEUTRAL = "what is in the image ?"  # the prompt `contrast` compares a head's map with
TOP = 16  # tokens compared by `contrast` (keep ceil(144 / 9))


@dataclass
class LayerView:
    """What the readings see of one layer for one question (float64 numpy)."""

    layer: int
    dist: np.ndarray  # [heads, N] each head's prompt-row attention renormalised over the image (hap.scoring.heads)
    paq: np.ndarray  # [heads] today's PAQ (focus)
    visual_share: np.ndarray  # [heads] mu
    written: np.ndarray  # [heads, N] ||W_O^h v_v||: the norm of what head h writes from visual token v
    similarity: np.ndarray  # [N] cosine of the last prompt row's normed hidden state with each visual token's, >= 0
    neutral: np.ndarray  # [heads, N] `dist` under the neutral prompt


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each row of `a [heads, N]` with `b [N]` or with the same row of `b [heads, N]` -> `[heads]`."""
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)


def focus(v: LayerView) -> np.ndarray:
    """Today's PAQ: (1 - sink share)(1 - normalised entropy), a sharp non-sink map wherever it looks."""
    return v.paq


def visual(v: LayerView) -> np.ndarray:
    """Visual share times focus: a sharp map of a head that looks at the image at all."""
    return v.visual_share * v.paq


def visual_share(v: LayerView) -> np.ndarray:
    """The share of the prompt rows' attention on the image (mu)."""
    return v.visual_share


def consensus(v: LayerView) -> np.ndarray:
    """Agreement with the layer's consensus: cosine of the head's map with the mean map of the layer's heads."""
    return cosine(v.dist, v.dist.mean(0))


def similarity(v: LayerView) -> np.ndarray:
    """Agreement with a text-to-image similarity map from the layer's own hidden states: cosine of the head's map
    with max(0, cos(x_last, x_v)) over the visual tokens v (x: the layer's normed input)."""
    return cosine(v.dist, v.similarity)


def value_focus(v: LayerView) -> np.ndarray:
    """Focus of what the head writes: 1 - normalised entropy of attention x ||W_O^h v_v|| (Kobayashi et al. 2020)."""
    w = v.dist * v.written
    w = w / np.maximum(w.sum(-1, keepdims=True), 1e-30)
    entropy = -(w * np.log(np.maximum(w, 1e-30))).sum(-1) / math.log(w.shape[-1])
    return 1 - entropy


def value_mass(v: LayerView) -> np.ndarray:
    """How much the head writes from the image: visual share x sum_v attention x ||W_O^h v_v||."""
    return v.visual_share * (v.dist * v.written).sum(-1)


def contrast(v: LayerView) -> np.ndarray:
    """Prompt grounding: the share of the head's top tokens that change when the question is replaced by a neutral
    one (a head that looks at the same place whatever is asked scores 0)."""
    tops = np.argsort(-v.dist, kind="stable")[:, :TOP], np.argsort(-v.neutral, kind="stable")[:, :TOP]
    return np.array([1 - len(set(a) & set(b)) / TOP for a, b in zip(*tops)])


def depth(v: LayerView) -> np.ndarray:
    """No reading: the layer index (baseline: utility grows with depth)."""
    return np.full(v.dist.shape[0], float(v.layer))


READINGS: dict[str, Callable[[LayerView], np.ndarray]] = {
    "focus": focus, "visual": visual, "visual_share": visual_share, "consensus": consensus,
    "similarity": similarity, "value_focus": value_focus, "value_mass": value_mass, "contrast": contrast,
    "depth": depth,
}


@torch.no_grad()
def traced(model, inputs: dict, rows: str, tail: int) -> tuple[dict, tuple]:
    """(the tracer's layers, the decoder layers' input hidden states) of one unpruned traced prefill."""
    with hap.patched(model, hap.HAPConfig(method="none", rows=rows), trace=True, tail=tail) as patch:
        out = model(**inputs, output_hidden_states=True, use_cache=False)
    return patch.state.tracer.layers, out.hidden_states


@torch.no_grad()
def views(model, processor, image, prompt: str, rows: str) -> list[LayerView]:
    """Every layer's `LayerView` of one question (two traced prefills: the question, the neutral prompt)."""
    tail = template_tail(processor)
    inputs = prepare(model, processor, image, prompt)
    layers, hidden = traced(model, inputs, rows, tail)
    neutral, _ = traced(model, prepare(model, processor, image, NEUTRAL), rows, tail)
    visual_tokens = inputs["input_ids"][0] == model.config.image_token_id
    out = []
    for l, (block, o_proj) in enumerate(zip(decoder_of(model).layers, attention_outputs(model))):
        x = block.input_layernorm(hidden[l][0]).double()  # [T, D]
        attn = block.self_attn
        H, d = len(layers[l].paq[0]), attn.head_dim
        values = attn.v_proj(block.input_layernorm(hidden[l][0])).double()[visual_tokens]  # [N, kv * d]
        values = values.view(values.shape[0], -1, d).repeat_interleave(H // (values.shape[-1] // d), 1)  # [N, H, d]
        w_o = o_proj.weight.double().view(-1, H, d)  # [D, H, d]
        written = torch.einsum("nhd,ehd->hne", values, w_o).norm(dim=-1)  # [H, N]
        sim = torch.nn.functional.cosine_similarity(x[visual_tokens], x[-1][None], dim=-1).clamp_min(0)
        t = layers[l]
        out.append(LayerView(l, t.head_attention[0].double().numpy(), t.paq[0].double().numpy(),
                             t.visual_share[0].double().numpy(), written.numpy(), sim.numpy(),
                             neutral[l].head_attention[0].double().numpy()))
    return out


def spearmans(scores: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """(pooled, within-layer) Spearman of `[layers, heads]` scores with utility, NaN where undefined."""
    pooled, within = paq_spearman(scores, values), utility.within_layers(scores, values)
    return (math.nan if pooled is None else pooled), (math.nan if within is None else within)


def evaluate(model, processor, items: list, rows: str) -> dict[str, dict]:
    """Per reading (and the `prior` baseline): mean pooled and within-layer Spearman with head utility, per kind."""
    found = []
    for scene, question in items:
        u = utility.utility(model, processor, scene.image, question.text, rows=rows)
        per_layer = views(model, processor, scene.image, question.text, rows)
        scores = {name: np.stack([fn(v) for v in per_layer]) for name, fn in READINGS.items()}
        found.append((question.qtype, u.values.double().numpy(), scores))
    half = len(found) // 2
    for i, (_, _, scores) in enumerate(found):  # cross-fitted: each half's prior from the other half's utility
        other = found[half:] if i < half else found[:half]
        scores["prior"] = np.mean([values for _, values, _ in other], 0)
    table: dict[str, dict] = {}
    for name in [*READINGS, "prior"]:
        rows_by_kind = defaultdict(list)
        for kind, values, scores in found:
            rows_by_kind[kind].append(spearmans(scores[name], values))
        every = [r for kind in rows_by_kind.values() for r in kind]
        table[name] = {"pooled": mean([r[0] for r in every]), "within_layers": mean([r[1] for r in every]),
                       "pooled_by_type": {k: mean([r[0] for r in rows_by_kind[k]]) for k in QTYPES
                                          if k in rows_by_kind}}
    return table


def mean(values: list[float]) -> float | None:
    """The mean of the defined values (None where none is: `depth` within a layer)."""
    values = [v for v in values if not math.isnan(v)]
    return float(np.mean(values)) if values else None


def markdown(report: dict) -> str:
    kinds = list(report["readings"]["focus"]["pooled_by_type"])
    lines = [f"PAQ readings vs head utility: {report['n_questions']} questions (seeds {report['seeds']}, "
             f"rows={report['rows']}); mean per question of Spearman(reading, utility), pooled over the layers' "
             "heads and within each layer", "",
             "| reading | pooled | within layers | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 3) + "|"]
    ordered = sorted(report["readings"].items(), key=lambda kv: -(kv[1]["within_layers"] or -2.0))
    for name, r in ordered:
        cells = " | ".join(f"{r['pooled_by_type'][k]:+.2f}" for k in kinds)
        within = "-" if r["within_layers"] is None else f"{r['within_layers']:+.3f}"
        lines.append(f"| {name} | {r['pooled']:+.3f} | {within} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/tiny-llava")
    p.add_argument("--seeds", default="400000:400030", help="validation scene seeds A:B")
    p.add_argument("--per-scene", type=int, default=3)
    p.add_argument("--rows", default="last", choices=hap.knobs.ROWS)
    p.add_argument("--out", type=Path)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    a, b = (int(v) for v in args.seeds.split(":"))
    model, processor = hap.load_model(args.model, device="cpu")
    items = list(heldout_items(range(a, b), args.per_scene))
    t0 = time.perf_counter()
    report = {"model": args.model, "seeds": args.seeds, "rows": args.rows, "n_questions": len(items),
              "readings": evaluate(model, processor, items, args.rows), "seconds": time.perf_counter() - t0}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
