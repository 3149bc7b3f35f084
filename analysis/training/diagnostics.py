"""Head-heterogeneity diagnostics of a LLaVA-style model on scene questions (logged while training).

For a fixed list of (scene, question) items, one eager forward each gives, per decoder layer:
  * the max / median L2 norm of the visual tokens' input hidden states, and where the max sits
    (a stable position means a norm-level sink is forming);
  * each head's visual distribution (prompt rows after the image, renormalised over the 144
    visual tokens): the share of head/question pairs with > 0.3 of it on one token, the most
    frequent arg-max position, a histogram of normalised entropy;
  * PAQ and head classes (docs/method.md §2-3) with the norm sink test and with the
    attention-consensus sink test (`consensus_sinks`);
  * Spearman(PAQ, ground-truth grounding) over heads;
  * the share of each head's visual attention on the fixed marker patch (visual token 0, the one token
    every image shares), over all questions and over the image-irrelevant ``text`` kind alone: a head
    that parks where it has nothing to read puts its attention there;
  * where attention parks outside the image: per layer, the share of the prompt rows' attention on the
    text before the image, on the image, and on the text after it (the question), and the largest
    hidden-state norm of any prompt token over the median visual norm with the token holding it
    (a massive activation on ``<s>`` is a text sink the visual norm test cannot see);
and a pruning probe: keep 8 visual tokens (hidden from every query, positions unchanged), ranked
by the PAQ-weighted fused map, by the uniform head average, or by the ground truth (oracle).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from analysis.scenes import MARKER_PATCH, Question, Scene
from hap.causal import spearman
from hap.scoring.fusion import fusion_weights
from hap.views.ground_truth import head_grounding
from hap.scoring.heads import classify, consensus_sinks, head_stats, sink_tokens, visual_distribution
from hap.runs.run import chat_prompt

PROBE_TOKENS = 8
PROBE_TEMPERATURE = 0.1
FOCUS = 0.3  # a head "focuses" on a token holding more than this share of its visual attention


def _forward(model, processor, scene: Scene, question: Question, mask: torch.Tensor | None = None):
    """(input ids [T], the model's output) for one question, on the CPU whatever device the model is on; without
    `mask` the output holds every layer's attentions and hidden states."""
    inputs = processor(images=[scene.image], text=[chat_prompt(processor, question.text)],
                       return_tensors="pt").to(model.device)
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = mask.to(model.device)
    out = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                output_attentions=mask is None, output_hidden_states=mask is None, **kwargs)
    on_cpu = {k: v.cpu() if torch.is_tensor(v) else tuple(t.cpu() for t in v)
              for k, v in out.items() if torch.is_tensor(v) or isinstance(v, tuple)}  # the cache left behind
    return inputs["input_ids"][0].cpu(), type(out)(**on_cpu)


def _keep_mask(length: int, image: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Float [1, 1, T, T] causal mask hiding the visual tokens not in `keep` from every query."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    hidden = image[~torch.isin(torch.arange(len(image)), keep)]
    allowed[:, hidden] = False
    allowed |= torch.eye(length, dtype=torch.bool)
    return torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Run the block with eager attention (the one that returns attention weights), then restore the model's own."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


@torch.no_grad()
def diagnose(model, processor, items: list[tuple[Scene, Question]], rho: float = 10.0,
             tau_sink: float = 0.5, tau_disp: float = 0.9) -> dict:
    """Every diagnostic of the module docstring for `items` (see there); plain JSON-able dict."""
    was_training = model.training
    model.eval()
    with eager_attention(model):
        image_id = model.config.image_token_id
        answer_ids = [processor.tokenizer.convert_tokens_to_ids(q.answer) for _, q in items]
        per_item = []
        for scene, q in items:
            ids, out = _forward(model, processor, scene, q)
            image = (ids == image_id).nonzero()[:, 0]
            rows = torch.arange(int(image[-1]) + 1, len(ids))
            attn = torch.stack([a[0][:, rows][:, :, image] for a in out.attentions])  # [L, H, P, V]
            hidden = torch.stack([h[0, image] for h in out.hidden_states[:-1]])  # [L, V, d]
            valid = torch.ones(1, len(rows), dtype=torch.bool)
            dist = torch.stack([visual_distribution(a[None], valid)[0] for a in attn])  # [L, H, V]
            consensus = consensus_sinks(dist.flatten(0, 1))
            stats = {}
            for name, detector in (("norm", lambda l: sink_tokens(hidden[l][None], rho)[0]),
                                   ("consensus", lambda l: consensus)):
                per_layer = [head_stats(attn[l][None], valid, detector(l)[None]) for l in range(len(attn))]
                stats[name] = {
                    "paq": torch.stack([s.paq[0] for s in per_layer]),  # [L, H]
                    "classes": [classify(s, tau_sink, tau_disp)[0] for s in per_layer],
                    "dispersion": torch.stack([s.dispersion[0] for s in per_layer]),
                }
            all_norms = torch.stack([h[0].float().norm(dim=-1) for h in out.hidden_states[:-1]])  # [L, T]
            per_item.append(dict(ids=ids, image=image, dist=dist, norms=all_norms[:, image], all_norms=all_norms,
                                 stats=stats, consensus=consensus.nonzero()[:, 0].tolist(), question=q,
                                 parking=_parking(out.attentions, image, rows)))
        result = _summarise(per_item)
        result |= _outside_image(per_item, processor.tokenizer)
        result["probe"] = _probe(model, processor, items, per_item, answer_ids)
    model.train(was_training)
    return result


def _parking(attentions: tuple[torch.Tensor, ...], image: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`[L, 3]`: the prompt rows' attention mass (mean over heads and rows) on the text before the image,
    on the image, and on the text after it; `attentions` per layer `[1, H, T, T]`, `image` the visual
    positions (contiguous), `rows` the prompt rows after the image."""
    first, last = int(image[0]), int(image[-1])
    a = torch.stack([att[0][:, rows] for att in attentions]).float()  # [L, H, P, T]
    parts = (a[..., :first].sum(-1), a[..., first:last + 1].sum(-1), a[..., last + 1:].sum(-1))
    return torch.stack([p.mean((1, 2)) for p in parts], -1)


def _outside_image(per_item: list[dict], tokenizer) -> dict:
    """Per layer: median over items of the largest prompt-token norm / median visual norm, the token most
    often holding it ("<s>", "visual 0", ...), and the mean attention parking shares of `_parking`."""
    massive = []
    for l in range(per_item[0]["all_norms"].shape[0]):
        ratios, where = [], Counter()
        for p in per_item:
            n = p["all_norms"][l]
            ratios.append(float(n.max() / p["norms"][l].median()))
            top = int(n.argmax())
            hit = (p["image"] == top).nonzero()
            where[f"visual {int(hit[0])}" if len(hit) else tokenizer.convert_ids_to_tokens(int(p["ids"][top]))] += 1
        massive.append({"ratio": round(float(np.median(ratios)), 2), "token": where.most_common(1)[0][0]})
    parking = torch.stack([p["parking"] for p in per_item]).mean(0)  # [L, 3]
    return {"massive_per_layer": massive,
            "row_attention_per_layer": [dict(zip(("before_image", "image", "after_image"),
                                                 (round(float(x), 3) for x in row))) for row in parking]}


def _summarise(per_item: list[dict]) -> dict:
    layers = per_item[0]["norms"].shape[0]
    norm_ratio, argmax_pos = [], []
    for l in range(layers):
        ratios = [float(p["norms"][l].max() / p["norms"][l].median()) for p in per_item]
        where = Counter(int(p["norms"][l].argmax()) for p in per_item).most_common(1)[0]
        norm_ratio.append(round(float(np.median(ratios)), 3))
        argmax_pos.append({"position": where[0], "share": round(where[1] / len(per_item), 3)})
    dists = torch.stack([p["dist"] for p in per_item])  # [Q, L, H, V]
    top = dists.max(-1)
    focus_pos = Counter(int(i) for i in top.indices[top.values > FOCUS].flatten())
    out: dict = {
        "norm_ratio_per_layer": norm_ratio,
        "norm_argmax_per_layer": argmax_pos,
        "share_focused_on_one_token": round(float((top.values > FOCUS).float().mean()), 3),
        "focus_positions": dict(focus_pos.most_common(5)),
        "consensus_sinks": dict(Counter(i for p in per_item for i in p["consensus"]).most_common(5)),
    }
    for name in ("norm", "consensus"):
        classes = Counter(c for p in per_item for layer in p["stats"][name]["classes"] for c in layer)
        total = sum(classes.values())
        out[f"classes_{name}"] = {c: round(classes[c] / total, 3) for c in ("sink", "dispersed", "optimal")}
    out["marker_attention"] = marker_attention(dists, [p["question"].qtype for p in per_item])
    disp = torch.stack([p["stats"]["norm"]["dispersion"] for p in per_item]).flatten().numpy()
    out["entropy_histogram"] = np.histogram(disp, bins=10, range=(0, 1))[0].tolist()
    paq, ground = [], []
    for p in per_item:
        g = head_grounding(p["dist"].numpy(), p["question"].target_mask)
        if g is not None:
            paq.append(p["stats"]["consensus"]["paq"].numpy()), ground.append(g)
    if paq:
        out["grounding_spearman"] = round(spearman(np.mean(paq, 0).ravel(), np.mean(ground, 0).ravel()), 3)
    return out


def marker_attention(dists: torch.Tensor, kinds: list[str]) -> dict:
    """`dists [Q, L, H, V]` (each head's visual distribution per question), `kinds` the Q question kinds ->
    the share on visual token 0 (`MARKER_PATCH`) of the busiest head (mean over questions, with its
    [layer, head]) and the mean over heads, for all questions and for the ``text`` kind (present only when
    asked); ``uniform`` is 1 / V, what a head spreading evenly puts there."""
    def reading(d: torch.Tensor) -> dict:
        share = d[..., MARKER_PATCH].mean(0)  # [L, H]
        value, index = share.flatten().max(0)
        return {"busiest": round(float(value), 3), "head": list(divmod(int(index), share.shape[1])),
                "mean": round(float(share.mean()), 3)}

    out = {"uniform": round(1 / dists.shape[-1], 4), "all": reading(dists)}
    text = torch.tensor([k == "text" for k in kinds])
    if text.any():
        out["text"] = reading(dists[text])
    return out


def fused_scores(dist: torch.Tensor, paq: torch.Tensor, temperature: float) -> torch.Tensor:
    """`dist [L, H, V]`, `paq [L, H]` -> `[V]`: heads weighted by softmax(PAQ / T) over all heads
    (T = inf: the uniform average)."""
    w = fusion_weights(paq[None], temperature)[0]  # [L, H], summing to 1
    return (w[..., None] * dist).sum((0, 1))


def _probe(model, processor, items, per_item: list[dict], answer_ids: list[int]) -> dict:
    """Accuracy of the first answer token with `PROBE_TOKENS` visual tokens kept, by ranking."""
    hits = Counter()
    for (scene, q), p, want in zip(items, per_item, answer_ids):
        paq = p["stats"]["consensus"]["paq"]
        uniform = fused_scores(p["dist"], paq, math.inf)
        target = torch.from_numpy(q.target_mask).float()
        rankings = {"paq": fused_scores(p["dist"], paq, PROBE_TEMPERATURE), "uniform": uniform,
                    "oracle": target * 10 + uniform}
        for name, score in rankings.items():
            keep = score.topk(PROBE_TOKENS).indices
            mask = _keep_mask(len(p["ids"]), p["image"], keep)
            _, out = _forward(model, processor, scene, q, mask)
            hits[name] += int(out.logits[0, -1].argmax()) == want
    return {name: round(hits[name] / len(items), 3) for name in ("paq", "uniform", "oracle")}


def table(records: list[dict], fractions: tuple[float, ...] | None = (0.3, 0.6, 1.0)) -> str:
    """Markdown table of the logged diagnostics nearest to each fraction of stage-2 training time
    (each record once; ``fractions=None``: every record).

    `records`: the lines of a training run's diagnostics.jsonl (step, minutes, fraction, accuracy,
    diagnostics, and in newer runs the follow-up accuracy)."""
    rows = ["| training | step | accuracy (min kind) | follow-up accuracy | max/median norm per layer "
            "| focused on one token | classes norm / consensus (sink, dispersed, optimal) "
            "| Spearman(PAQ, grounding) | probe @8: PAQ / uniform / oracle "
            "| largest prompt-token norm / median visual (where) | row attention before / on / after the image "
            "| marker patch, busiest head: all / text questions (uniform) |",
            "|---" * 12 + "|"]
    chosen = records if fractions is None else [min(records, key=lambda r: abs(r["fraction"] - f))
                                                 for f in fractions]
    for r in {r["step"]: r for r in chosen}.values():
        d, acc = r["diagnostics"], r["accuracy"]
        kinds = {k: v for k, v in acc.items() if k not in ("overall", "n")}

        def classes(name: str) -> str:
            return ", ".join(f"{d[f'classes_{name}'][c]:.2f}" for c in ("sink", "dispersed", "optimal"))

        rows.append(
            f"| {r['fraction']:.0%} ({r['minutes']:.0f} min) | {r['step']} | {acc['overall']:.3f} "
            f"({min(kinds.values()):.2f}) | {r.get('followup', float('nan')):.3f} "
            f"| {' '.join(f'{x:.1f}' for x in d['norm_ratio_per_layer'])} "
            f"| {d['share_focused_on_one_token']:.2f} | {classes('norm')} / {classes('consensus')} "
            f"| {d.get('grounding_spearman', float('nan')):.2f} "
            f"| {d['probe']['paq']:.2f} / {d['probe']['uniform']:.2f} / {d['probe']['oracle']:.2f} "
            f"| {_massive_cell(d)} | {_parking_cell(d)} | {_marker_cell(d)} |")
    return "\n".join(rows)


def _massive_cell(d: dict) -> str:
    """The largest ratio over layers and its token, or "–" in logs written before this diagnostic."""
    if "massive_per_layer" not in d:
        return "–"
    top = max(d["massive_per_layer"], key=lambda m: m["ratio"])
    return f"{top['ratio']:.1f} ({top['token']})"


def _marker_cell(d: dict) -> str:
    """The busiest head's share on the marker patch, all questions / text questions, or "–" in older logs."""
    if "marker_attention" not in d:
        return "–"
    m = d["marker_attention"]
    text = f"{m['text']['busiest']:.2f}" if "text" in m else "–"
    return f"{m['all']['busiest']:.2f} / {text} ({m['uniform']:.3f})"


def _parking_cell(d: dict) -> str:
    """Mean over layers of the three parking shares, or "–" in logs written before this diagnostic."""
    if "row_attention_per_layer" not in d:
        return "–"
    shares = [np.mean([r[k] for r in d["row_attention_per_layer"]]) for k in ("before_image", "image", "after_image")]
    return " / ".join(f"{x:.2f}" for x in shares)


def main(argv: list[str] | None = None) -> None:
    """`python -m analysis.training.diagnostics --log RUN/diagnostics.jsonl` prints the training table;
    `--model DIR --per-kind N` runs the diagnostics on held-out scenes of a saved model."""
    import argparse
    import json

    from transformers import AutoProcessor, LlavaForConditionalGeneration

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="a training run's diagnostics.jsonl")
    parser.add_argument("--every", action="store_true", help="with --log: every logged checkpoint")
    parser.add_argument("--model", help="a saved model folder")
    parser.add_argument("--per-kind", type=int, default=30)
    parser.add_argument("--start", type=int, default=510_000, help="first held-out seed")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.log:
        with open(args.log) as f:
            print(table([json.loads(line) for line in f if line.strip()], None if args.every else (0.3, 0.6, 1.0)))
    if args.model:
        from analysis.training.train_model import diagnostic_items

        processor = AutoProcessor.from_pretrained(args.model)
        model = LlavaForConditionalGeneration.from_pretrained(args.model)
        print(json.dumps(diagnose(model, processor, diagnostic_items(args.per_kind, args.start)), indent=1))


if __name__ == "__main__":
    main()
