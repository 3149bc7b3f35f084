"""Fidelity benchmark on held-out synthetic scenes: accuracy vs budget for HAP and every baseline,
PAQ against ground-truth grounding, and kept-token recall of the queried object.

    python -m analysis.benchmark --model assets/tiny-llava --seeds 500000:500200 --out results/benchmark

Every method runs through the same executor and the same FLOPs accounting at each budget (the
layer-averaged retained fraction). The small model has 6 decoder layers, so budgets as low as
0.056 are reachable only when the first cut comes before layer 0 (`--first-layers 0`, the library
default on a decoder this shallow): layers [0, K) would otherwise keep all 144 tokens and alone
average more than the budget.

Every knob of `hap.knobs` but the method and the budget is a flag, shared by every method of the run
(the HAP+ ones shape `hap` only, docs/method.md §10). Besides `hap.METHODS`, `--methods` takes
`hap_paper` (`hap.HAPConfig.paper()` on the run's schedule: first_layers, groups, decay), `hap_static` (the run's HAP
with head_weight="static": the model's static head importance in place of PAQ) and `oracle`
(analysis only: the uniform scores with the question's answering patches ranked first at every cut
through `hap.patched(..., priority=...)`; a question with no answering patch gets plain uniform) and
`oracle_causal` (the same with the tokens of highest causal token importance first, `hap.token_importance`: a
ceiling that needs no scene metadata).
`--methods all` runs every method of the registry (`hap.runs.keeps.pruning`: the method knob's choices but none), so a
method added to the registry joins the table by itself. The default budgets are 11.1% and 5.6% and the papers'
64 / 128 / 192-of-576 equivalents (retain 0.111, 0.222, 0.333), each table column naming the equivalent; the held-out
table of every method:

    python -m analysis.benchmark --model assets/tiny-llava --seeds 500000:500100 --per-scene 9 \
        --methods all hap_paper --accuracy-only --out results/frontier

The per-kind tables (a row per question kind, then simple and cluttered scenes, `SCENE_KINDS`, then every question;
a column per method; one table per budget) close benchmark.md and are written alone as by_kind.md and, one row per
kind, method and budget, by_kind.csv; `--by-kind results/frontier/benchmark.json` prints them from a stored run.
The validation sweep of a HAP+ setting against the paper, e.g.

    python -m analysis.benchmark --model assets/tiny-llava --seeds 400000:400100 --retain 0.111 0.056 \
        --methods hap hap_paper uniform --head-weight paq_visual --out results/sweep

Outputs in --out: benchmark.json (binding keys: accuracy[method][retain], relative[method][retain],
accuracy_by_type[method][retain][kind], kept_recall[method][retain], grounding_spearman, n_questions,
n_by_type[kind] (questions of each kind), scene_kinds (simple / cluttered -> "a-b objects"), n_by_scene[kind],
unpruned_by_scene[kind], accuracy_by_scene[method][retain][kind] (each kind's accuracy weighted by its questions gives
the overall one), refused[method] (why the model refuses it, `hap.patch.refusal`: never run, NaN in its rows),
norm_ratio: per decoder layer, the median over questions of max / median L2 norm of the visual tokens'
input hidden states, causal_spearman: mean over questions of Spearman(PAQ, exact ablation importance) over the
scored heads, causal_token_precision: mean over questions with answering patches of the share of answering
patches among the |answering| tokens of highest causal token importance; hap.causal),
causal_token_precision_by_type (the same per question kind, kinds with answering patches only), head utility
(hap.utility, the run's rows, keep ceil(N / 9), every cut layer: utility_spearman: mean over questions of
Spearman(PAQ, head utility) over the scored heads; utility_best_head, utility_uniform, utility_paq: mean over
questions of the share of cut layers whose cut by the best single head, the plain head average, the PAQ weighting
keeps the answer token the most likely; utility_spearman_within_layers, the Spearman among each layer's heads; each
also `_by_type`, per question kind), benchmark.md (tables), by_kind.md, by_kind.csv, accuracy.png,
paq_grounding.png.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import hap
from hap import causal, utility
from hap.causal import spearman
from hap.knobs import knob
from hap.methods import load_plugins, pruner_class
from hap.patch.decoder import decoder_shape
from hap.planning.budget import smallest_retain
from hap.runs.keeps import pruning, refusal
from hap.runs.run import chat_prompt, template_tail
from hap.views.ground_truth import head_grounding
from analysis.scenes import MAX_OBJECTS, MIN_OBJECTS, N_PATCHES, QTYPES, heldout_items

load_plugins()  # the pruners named in HAP_PRUNERS join `--methods` (and `all`)
RETAINS = (1.0, 0.333, 0.222, 0.111, 0.056)  # 0.333 / 0.222 / 0.111: the papers' 192 / 128 / 64 of 576 tokens
PAPER_TOKENS = {"0.333": 192, "0.222": 128, "0.111": 64}  # retain -> the equivalent count of LLaVA-1.5's 576 tokens
METHODS = ("hap", "uniform", "fastv", "pdrop", "random")  # the default comparison
STATIC = "hap_static"  # HAP with the model's static head importance in place of PAQ (head_weight="static")
CHOICES = (*pruning(), "hap_paper", STATIC, "oracle", "oracle_causal", "all")  # all: every method of the registry (`pruning`)
SCENE_KINDS = {"simple": (MIN_OBJECTS, 4), "cluttered": (5, MAX_OBJECTS)}  # scenes by their objects: (fewest, most)
KNOB_FLAGS = tuple(k.name for k in hap.KNOBS if k.name not in ("method", "retain", "flops_ratio"))  # every method's
SCHEDULE = ("first_layers", "groups", "decay")  # the knobs `hap_paper` takes from the run


def batch_inputs(processor, batch) -> dict:
    """The left-padded processor inputs of a batch of (scene, question)."""
    processor.tokenizer.padding_side = "left"
    return processor(
        images=[scene.image for scene, _ in batch],
        text=[chat_prompt(processor, q.text) for _, q in batch],
        padding=True,
        return_tensors="pt",
    )


def run_batch(model, processor, batch, config: hap.HAPConfig, trace: bool, max_new_tokens: int = 3,
              priority: torch.Tensor | None = None):
    """Greedy answers for a batch of (scene, question) under `config` (and `priority [batch, visual]`, see
    `hap.patched`); returns (answers, PruneState)."""
    inputs = batch_inputs(processor, batch)
    tail = template_tail(processor)
    with hap.patched(model, config, trace=trace, priority=priority, tail=tail) as patch, torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1] :]
    answers = [s.strip() for s in processor.batch_decode(new, skip_special_tokens=True)]
    return answers, patch.state


def layer_recall(state, sample: int, target: np.ndarray) -> float:
    """Share of the queried object's patches present in each decoder layer, averaged over the layers
    (the same layer average as the retained-token budget, so schedules compare fairly); a recycled cluster mean
    (SparseVLM, AutoPrune) counts as no patch."""
    if state is None or state.schedule is None:
        return 1.0
    present = np.ones(state.schedule.num_layers)
    for (start, end), cut in zip(state.schedule.ranges, state.cuts):
        kept = cut.kept[sample] if cut.recycled is None else cut.kept[sample][~cut.recycled[sample]]  # patches only
        present[start:end] = target[kept.numpy()].sum() / target.sum()
    return float(present.mean())


@torch.inference_mode()
def norm_ratios(model, processor, batch) -> np.ndarray:
    """max / median L2 norm of the visual tokens' input hidden states, `[questions, layers]` (the stock model:
    a ratio far above 1 means a massive-activation sink token)."""
    inputs = batch_inputs(processor, batch)
    hidden = model(**inputs, output_hidden_states=True).hidden_states[:-1]  # the input of each decoder layer
    visual = inputs["input_ids"] == model.config.image_token_id
    B = visual.shape[0]
    norms = torch.stack([h[visual].view(B, -1, h.shape[-1]).float().norm(dim=-1) for h in hidden], 1)  # [B, L, N]
    return (norms.max(-1).values / norms.median(-1).values).numpy()


def method_run(name: str, retain: float, base: dict, batch,
               tokens: torch.Tensor | None = None) -> tuple[hap.HAPConfig, torch.Tensor | None]:
    """(config, priority) of benchmark method `name`: a `hap.METHODS` entry, `hap_paper` (the paper's HAP on
    the run's schedule), `hap_static` (the run's HAP with head_weight="static"), `oracle` (uniform scores, the
    question's answering patches first) or `oracle_causal` (uniform scores, the highest causal token importance
    `tokens [batch, visual]` first)."""
    if name == "oracle_causal":
        return hap.HAPConfig(method="uniform", retain=retain, **base), tokens
    if name == "hap_paper":
        return hap.HAPConfig.paper(retain=retain, **{k: base[k] for k in SCHEDULE}), None
    if name == STATIC:
        return hap.HAPConfig(**{**base, "head_weight": "static"}, retain=retain), None
    if name == "oracle":
        priority = torch.from_numpy(np.stack([q.target_mask for _, q in batch])).float()
        return hap.HAPConfig(method="uniform", retain=retain, **base), priority
    return hap.HAPConfig(method=name, retain=retain, **base), None


def grounding(state, batch) -> dict[str, np.ndarray]:
    """Per question and head: PAQ, class parts and grounding ratios from an unpruned traced pass.

    grounding ratio = share of the head's visual attention on the queried object's patches /
    the object's share of the patches (1 = no preference); `other` is the same on the scene's
    other objects. Returns arrays `[questions, layers, heads]` (NaN where a question has no target).
    """
    traced = state.tracer.layers
    layers = sorted(traced)
    dist = torch.stack([traced[l].head_attention for l in layers], 1).numpy()  # [B, L, H, N]
    out = {k: torch.stack([getattr(traced[l], k) for l in layers], 1).numpy()
           for k in ("paq", "sink_share", "dispersion", "visual_share")}
    def ratio(masks: list[np.ndarray]) -> np.ndarray:
        rows = [head_grounding(d, m) for d, m in zip(dist, masks)]
        return np.stack([np.full(dist.shape[1:3], np.nan) if r is None else r for r in rows])

    out["target"] = ratio([q.target_mask for _, q in batch])
    out["other"] = ratio([q.other_mask for _, q in batch])
    return out


def run_parser(doc: str, seeds: str, out: str, retains: tuple[float, ...], knobs: tuple[str, ...]) -> argparse.ArgumentParser:
    """The flags of a run on scenes: --model, --seeds (default `seeds`), --per-scene, --out, --retain, the knob
    flags `knobs` (unset: the library default, first_layers 0 on the 6-layer model), --batch-size, --threads."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--model", default="assets/tiny-llava")
    p.add_argument("--seeds", default=seeds, help="scene seeds A:B")
    p.add_argument("--per-scene", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--retain", type=float, nargs="+", default=list(retains))
    for name in knobs:
        knob(name).add_to(p)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    return p


def parser() -> argparse.ArgumentParser:
    p = run_parser(__doc__, "500000:500200", "results/benchmark", RETAINS, KNOB_FLAGS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=CHOICES)
    p.add_argument("--by-kind", type=Path, metavar="JSON",
                   help="only print the per-kind tables of a stored run's benchmark.json (no model run)")
    p.add_argument("--accuracy-only", action="store_true",
                   help="only accuracy and kept recall (no grounding, norms, causal truth or head utility): a new "
                        "method's rows beside a stored full run")
    return p


@dataclass
class Tally:
    """What `evaluate` gathers over the batches."""

    correct: dict[tuple[str, float], list[bool]] = field(default_factory=lambda: defaultdict(list))
    recall: dict[tuple[str, float], list[float]] = field(default_factory=lambda: defaultdict(list))
    heads: dict[str, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))  # grounding(...) parts
    heads_other: dict[str, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))  # the same from
    #                                                                             the other rows (`other_rows`)
    norms: list[np.ndarray] = field(default_factory=list)  # norm_ratios(...) [questions, layers] per batch
    causal_rho: list[float] = field(default_factory=list)  # per question: Spearman(PAQ, ablation importance)
    causal_precision: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # per kind, per
    #                                                                  question with a target: token precision
    utility: dict[str, list[dict[str, float]]] = field(default_factory=lambda: defaultdict(list))  # per kind, per
    #                                                          question: `utility_row` (UTILITY_KEYS -> value)
    refused: dict[str, str] = field(default_factory=dict)  # method -> why the model does not take it (never run)

    def add(self, key: tuple[str, float], batch, answers: list[str], state) -> None:
        """One pruned run of `batch`: correctness of each answer, kept recall of each question with a target."""
        self.correct[key] += [a == q.answer for a, (_, q) in zip(answers, batch)]
        self.recall[key] += [layer_recall(state, b, q.target_mask) for b, (_, q) in enumerate(batch)
                             if q.target_mask.any()]


def evaluate(model, processor, batches: list, base: dict, methods: list[str], retains: list[float],
             extras: bool = True) -> Tally:
    """Answer every batch unpruned (traced, for the head grounding) and with each method at each budget; without
    `extras` only the accuracy and the kept recall (no grounding, norms, causal truth or head utility)."""
    if not extras and "oracle_causal" in methods:
        raise ValueError("oracle_causal ranks by the causal token importance, which --accuracy-only skips")
    tally = Tally()
    tally.refused = {m: why for m in methods if m in hap.METHODS
                     and (why := refusal(model, hap.HAPConfig(method=m, **base))) is not None}
    for batch in batches:
        truth = [q.answer for _, q in batch]
        answers, state = run_batch(model, processor, batch, hap.HAPConfig(method="none", **base), trace=extras)
        tally.correct[("none", 1.0)] += [x == y for x, y in zip(answers, truth)]
        tokens = extras_of(model, processor, batch, base, state, tally) if extras else None
        for retain in retains:
            for method in (m for m in methods if m not in tally.refused):  # a refused one: NaN, named in the report
                config, priority = method_run(method, retain, base, batch, tokens)
                if not reachable(model, config):
                    continue  # out of reach: no accuracy at this budget (a NaN in the report)
                for part in split(batch, config):
                    answers, state = run_batch(model, processor, part, config, trace=False, priority=priority)
                    tally.add((method, retain), part, answers, state)
    return tally


def extras_of(model, processor, batch, base: dict, state, tally: Tally) -> torch.Tensor:
    """The unpruned traced run's head grounding (both row choices), norm ratios, causal truth and head utility of
    `batch` into `tally`; returns the causal token importance `[questions, visual]` (the oracle_causal priority)."""
    for k, v in grounding(state, batch).items():
        tally.heads[k].append(v)
    other = hap.HAPConfig(method="none", **{**base, "rows": other_rows(base["rows"])})
    _, state_other = run_batch(model, processor, batch, other, trace=True)
    for k, v in grounding(state_other, batch).items():
        tally.heads_other[k].append(v)
    tally.norms.append(norm_ratios(model, processor, batch))
    tokens = causal_truth(model, processor, batch, tally.heads["paq"][-1], tally)
    for scene, question in batch:
        found = utility.utility(model, processor, scene.image, question.text, rows=base["rows"],
                                config=hap.HAPConfig(**base))
        tally.utility[question.qtype].append(utility_row(found))
    return tokens


def reachable(model, config: hap.HAPConfig) -> bool:
    """Whether `config`'s budget is reachable on `model` (the official methods cannot prune before layer 0, so on the
    6-layer model layer 0 alone averages 1/6 of the tokens: `hap.planning.budget.smallest_retain`)."""
    shape = decoder_shape(model)
    return config.retain is None or config.retain >= smallest_retain(config, shape, N_PATCHES) - 1e-12


def split(batch: list, config: hap.HAPConfig) -> list[list]:
    """`batch` as it runs under `config`: in pieces of the method's `max_batch` prompts (AutoPrune's one: its schedule
    follows each prompt's mutual information), else whole."""
    most = pruner_class(config.method).max_batch or len(batch)
    return [batch[i:i + most] for i in range(0, len(batch), most)]


def causal_truth(model, processor, batch, paq: np.ndarray, tally: Tally) -> torch.Tensor:
    """Per question of `batch`: exact ablation importance against its PAQ `[questions, layers, heads]` and the
    precision of its causal token importance at |answering| (into `tally`). Returns the token importance
    `[questions, visual]` (the `oracle_causal` priority)."""
    rows = []
    for (scene, question), head_paq in zip(batch, paq):
        inputs = causal.prepare(model, processor, scene.image, question.text)
        importance = causal.ablation(model, inputs)[2]
        tokens = causal.gradients(model, inputs)[3]
        rho = causal.paq_spearman(head_paq, importance)
        if rho is not None:
            tally.causal_rho.append(rho)
        if question.target_mask.any():
            tally.causal_precision[question.qtype].append(causal.token_precision(tokens, question.target_mask))
        rows.append(tokens)
    return torch.stack(rows)


UTILITY_KEYS = ("utility_spearman", "utility_best_head", "utility_uniform", "utility_paq",
                "utility_spearman_within_layers")


def utility_row(found: utility.HeadUtility) -> dict[str, float]:
    """One question's head-utility figures (UTILITY_KEYS): Spearman(PAQ, utility) over the scored heads, the shares
    of its cut layers whose cut by the best single head, the plain head average, the PAQ weighting keeps the answer
    token the most likely, and the Spearman within layers (`hap.utility.within_layers`); NaN where undefined."""
    rho, within = causal.paq_spearman(found.paq, found.values), utility.within_layers(found.paq, found.values)
    kept, n = found.answer_kept(), len(found.scored)
    return dict(zip(UTILITY_KEYS, (math.nan if rho is None else rho, kept["best_head"] / n, kept["uniform"] / n,
                                   kept["paq_weighted"] / n, math.nan if within is None else within)))


def utility_report(rows: dict[str, list[dict[str, float]]]) -> dict:
    """UTILITY_KEYS averaged over every question (Spearman: over those where it is defined), and `<key>_by_type`
    over each kind's questions."""
    def mean(values: list[float]) -> float | None:
        values = [v for v in values if not math.isnan(v)]
        return float(np.mean(values)) if values else None

    every = [row for kind in rows.values() for row in kind]
    report = {key: mean([row[key] for row in every]) for key in UTILITY_KEYS}
    report.update({f"{key}_by_type": {kind: mean([row[key] for row in rows[kind]]) for kind in QTYPES if kind in rows}
                   for key in UTILITY_KEYS})
    return report


def load_run(args: argparse.Namespace, names: tuple[str, ...]) -> tuple:
    """(model, processor, items, batches, knobs) of a run's arguments (--model, --seeds, --per-scene,
    --batch-size, --threads and the knob flags `names`, resolved for the model's decoder)."""
    torch.set_num_threads(args.threads)
    a, b = (int(v) for v in args.seeds.split(":"))
    model, processor = hap.load_model(args.model, device="cpu")
    items = list(heldout_items(range(a, b), args.per_scene))
    batches = [items[i : i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    given = hap.HAPConfig(**{name: getattr(args, name) for name in names if getattr(args, name) is not None})
    resolved = given.resolved(model.config.text_config.num_hidden_layers)
    return model, processor, items, batches, {name: getattr(resolved, name) for name in names}


def chosen(names: list[str]) -> list[str]:
    """`--methods` with `all` replaced by every method of the registry (`hap.runs.keeps.pruning`), each once, in order."""
    return list(dict.fromkeys(m for name in names for m in (pruning() if name == "all" else [name])))


def scene_kind(scene) -> str:
    """The SCENE_KINDS entry of `scene`: simple or cluttered by its number of objects."""
    return next(kind for kind, (low, high) in SCENE_KINDS.items() if low <= len(scene.objects) <= high)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.by_kind is not None:
        report = json.loads(args.by_kind.read_text())
        print(by_kind_markdown(report))
        return report
    methods = chosen(args.methods)
    model, processor, items, batches, base = load_run(args, KNOB_FLAGS)
    t0 = time.perf_counter()
    tally = evaluate(model, processor, batches, base, methods, args.retain, extras=not args.accuracy_only)
    seconds = time.perf_counter() - t0
    correct, recall = tally.correct, tally.recall

    qtypes = [q.qtype for _, q in items]
    scenes = [scene_kind(scene) for scene, _ in items]

    def acc(key, qtype=None, labels=qtypes) -> float:
        values = [c for c, t in zip(correct[key], labels) if qtype is None or t == qtype]
        return float(np.mean(values)) if values else math.nan

    unpruned = acc(("none", 1.0))
    accuracy = {m: {str(r): acc((m, r)) for r in args.retain} for m in methods}
    report = {
        "model": args.model,
        "seeds": args.seeds,
        "n_questions": len(items),
        "config": base,
        "unpruned_accuracy": unpruned,
        "unpruned_by_type": {t: acc(("none", 1.0), t) for t in QTYPES},
        "accuracy": accuracy,
        "relative": {m: {r: v / unpruned if unpruned else math.nan for r, v in row.items()}
                     for m, row in accuracy.items()},
        "accuracy_by_type": {m: {str(r): {t: acc((m, r), t) for t in QTYPES} for r in args.retain} for m in methods},
        "n_by_type": {t: qtypes.count(t) for t in QTYPES},
        "scene_kinds": {kind: f"{low}-{high} objects" for kind, (low, high) in SCENE_KINDS.items()},
        "n_by_scene": {kind: scenes.count(kind) for kind in SCENE_KINDS},
        "unpruned_by_scene": {kind: acc(("none", 1.0), kind, scenes) for kind in SCENE_KINDS},
        "accuracy_by_scene": {m: {str(r): {kind: acc((m, r), kind, scenes) for kind in SCENE_KINDS}
                                  for r in args.retain} for m in methods},
        "num_visual": N_PATCHES,
        "retained_tokens": {str(r): r * N_PATCHES for r in args.retain},
        "kept_recall": {m: {str(r): float(np.mean(recall[(m, r)])) if recall[(m, r)] else math.nan
                            for r in args.retain} for m in methods},
        "refused": tally.refused,
        "seconds": seconds,
    }
    if not args.accuracy_only:
        report.update({
            "norm_ratio": np.median(np.concatenate(tally.norms), 0).tolist(),
            "causal_spearman": float(np.mean(tally.causal_rho)) if tally.causal_rho else None,
            "causal_token_precision": float(np.mean(sum(tally.causal_precision.values(), [])))
            if tally.causal_precision else None,
            "causal_token_precision_by_type": {t: float(np.mean(tally.causal_precision[t])) for t in QTYPES
                                               if t in tally.causal_precision},
            **utility_report(tally.utility),
        })
        report.update(head_report({k: np.concatenate(v) for k, v in tally.heads.items()},
                                  {k: np.concatenate(v) for k, v in tally.heads_other.items()}, hap.HAPConfig(**base)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmark.json").write_text(json.dumps(report, indent=1))
    (args.out / "benchmark.md").write_text(markdown(report))
    (args.out / "by_kind.md").write_text(by_kind_markdown(report))
    (args.out / "by_kind.csv").write_text(by_kind_csv(report))
    plots(report, args.out)
    print(markdown(report))
    return report


def other_rows(rows: str) -> str:
    """The prompt rows the head statistics of a run scoring with `rows` are compared with: all prompt rows if
    the run scores with the last one, else the last one."""
    return "prompt" if rows == "last" else "last"


def head_means(h: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each `grounding` array averaged over the questions that have answering patches -> `[layers, heads]`."""
    has_target = ~np.isnan(h["target"][:, 0, 0])
    return {k: np.nanmean(v[has_target], 0) for k, v in h.items()}


def head_report(h: dict[str, np.ndarray], other: dict[str, np.ndarray], cfg: hap.HAPConfig) -> dict:
    """PAQ vs grounding truth across heads, both from the prompt rows of `cfg` (means over questions with a
    target), and by class; `other` is `grounding` of the same questions from the other rows (`other_rows`)."""
    has_target = ~np.isnan(h["target"][:, 0, 0])
    mean, mean_other = head_means(h), head_means(other)
    paq, target, other = mean["paq"].ravel(), mean["target"].ravel(), mean["other"].ravel()
    sink = h["sink_share"] >= cfg.tau_sink
    dispersed = ~sink & (h["dispersion"] >= cfg.tau_disp)
    classes = {"sink": sink, "dispersed": dispersed, "optimal": ~sink & ~dispersed}
    by_class = {}
    for name, mask in classes.items():
        sel = mask & has_target[:, None, None]
        by_class[name] = {
            "share_of_head_questions": float(mask.mean()),
            "mean_grounding": float(np.nanmean(h["target"][sel])) if sel.any() else None,
        }
    top = np.argsort(-target)[: max(1, len(target) // 4)]
    L, H = mean["paq"].shape
    return {
        "grounding_spearman": spearman(paq, target),
        "grounding_rows": cfg.rows,
        "grounding_spearman_other_rows": {"rows": other_rows(cfg.rows),
                                          "spearman": spearman(mean_other["paq"].ravel(), mean_other["target"].ravel())},
        "grounding_spearman_per_question": float(np.nanmean([
            spearman(h["paq"][i].ravel(), h["target"][i].ravel()) for i in np.flatnonzero(has_target)
        ])),
        "head_paq": mean["paq"].tolist(),
        "head_grounding": mean["target"].tolist(),
        "head_grounding_other": mean["other"].tolist(),
        "head_visual_share": mean["visual_share"].tolist(),
        "best_heads": [f"L{i // H}h{i % H}" for i in top],
        "best_heads_grounding_target": float(target[top].mean()),
        "best_heads_grounding_other": float(other[top].mean()),
        "classes": by_class,
        "sink_definition": f"sink tokens by the {cfg.sink_detector} detector (norm: hidden-state norm > {cfg.sink_rho} x "
                           f"median; consensus: <= {cfg.consensus_tokens} tokens holding >= {cfg.consensus_share} of the "
                           f"visual attention of >= {cfg.consensus_quorum} of a layer's heads); sink head: sink share >= "
                           f"{cfg.tau_sink}; "
                           f"dispersed: entropy ratio >= {cfg.tau_disp}; PAQ from rows={cfg.rows}",
    }


def budget_label(retain: str, tokens: float) -> str:
    """A budget's column head: "retain 0.111 (16 tok; 64 of 576)" (the papers' equivalent where there is one)."""
    paper = f"; {PAPER_TOKENS[retain]} of 576" if retain in PAPER_TOKENS else ""
    return f"retain {retain} ({tokens:.0f} tok{paper})"


def markdown(r: dict) -> str:
    head = "| method | " + " | ".join(budget_label(k, v) for k, v in r["retained_tokens"].items()) + " |"
    rule = "|---" * (len(r["retained_tokens"]) + 1) + "|"
    lines = [f"Held-out questions: {r['n_questions']} (seeds {r['seeds']}), unpruned accuracy "
             f"{r['unpruned_accuracy']:.3f}; cells: accuracy (relative to unpruned) / recall of the "
             "queried object's patches among the tokens present, averaged over decoder layers", "", head, rule]
    refused = r.get("refused", {})
    for m, row in r["accuracy"].items():
        missing = "refused" if m in refused else "out of reach"
        cells = [missing if math.isnan(v) else f"{v:.3f} ({r['relative'][m][k]:.3f}) / {r['kept_recall'][m][k]:.2f}"
                 for k, v in row.items()]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [f"\n{m}: refused by the model, not run ({why})." for m, why in refused.items()]
    if "head_paq" in r:
        lines += extras_markdown(r)
    return "\n".join(lines) + "\n" + by_kind_markdown(r)


def kind_rows(r: dict) -> list[tuple[str, str, int | None, float, dict[str, dict[str, float]]]]:
    """The per-kind rows of a report: (label, key, questions, unpruned accuracy, {method: {retain: accuracy}}) of each
    question kind, then each scene kind (simple / cluttered; a report without them: none), then every question."""
    rows = [(kind, kind, r.get("n_by_type", {}).get(kind), r["unpruned_by_type"][kind],
             {m: {k: v[kind] for k, v in by.items()} for m, by in r["accuracy_by_type"].items()})
            for kind in r["unpruned_by_type"]]
    rows += [(f"{kind} scenes ({r['scene_kinds'][kind]})", kind, r["n_by_scene"][kind], r["unpruned_by_scene"][kind],
              {m: {k: v[kind] for k, v in by.items()} for m, by in r["accuracy_by_scene"].items()})
             for kind in r.get("scene_kinds", {})]
    return rows + [("all", "all", r["n_questions"], r["unpruned_accuracy"], r["accuracy"])]


def by_kind_markdown(r: dict) -> str:
    """Accuracy per question kind and per scene kind at each budget: one table per budget, a row per kind (its
    questions in brackets), a column per method, the unpruned one first."""
    methods, lines = list(r["accuracy"]), []
    for retain, tokens in r["retained_tokens"].items():
        lines += ["", f"Accuracy by kind at {budget_label(retain, tokens)}", "",
                  "| kind (questions) | unpruned | " + " | ".join(methods) + " |", "|---" * (len(methods) + 2) + "|"]
        lines += [f"| {label} ({'-' if n is None else n}) | {_cell(unpruned)} | "
                  + " | ".join(_cell(by[m][retain]) for m in methods) + " |"
                  for label, _, n, unpruned, by in kind_rows(r)]
    return "\n".join(lines) + "\n"


def by_kind_csv(r: dict) -> str:
    """The per-kind rows as CSV: kind, questions, method, retain, accuracy (the unpruned model as method none at
    retain 1.0)."""
    lines = ["kind,questions,method,retain,accuracy"]
    for _, key, n, unpruned, by in kind_rows(r):
        lines.append(f"{key},{'' if n is None else n},none,1.0,{unpruned}")
        lines += [f"{key},{'' if n is None else n},{m},{retain},{value}" for m, row in by.items()
                  for retain, value in row.items()]
    return "\n".join(lines) + "\n"


def extras_markdown(r: dict) -> list[str]:
    """The lines of a full run's grounding, norm, causal and head-utility figures."""
    return [
        "",
        f"Spearman(PAQ, grounding) across {len(r['head_paq']) * len(r['head_paq'][0])} heads: "
        f"{r['grounding_spearman']:.3f} (PAQ from rows={r['grounding_rows']}); "
        f"{r['grounding_spearman_other_rows']['spearman']:.3f} (from rows={r['grounding_spearman_other_rows']['rows']}); "
        f"mean per-question Spearman {r['grounding_spearman_per_question']:.3f}.",
        f"Best-grounded heads ({', '.join(r['best_heads'])}): grounding ratio {r['best_heads_grounding_target']:.2f} "
        f"on the queried object vs {r['best_heads_grounding_other']:.2f} on the other objects.",
        "Head classes (share of head x question pairs, mean grounding): " + "; ".join(
            f"{k} {v['share_of_head_questions']:.2f}, "
            + ("-" if v["mean_grounding"] is None else f"{v['mean_grounding']:.2f}") for k, v in r["classes"].items()
        ),
        "Visual hidden-state norm, max / median per decoder layer (median over questions): "
        + ", ".join(f"{v:.1f}" for v in r["norm_ratio"]) + ".",
        f"Causal truth (hap.causal): mean per-question Spearman(PAQ, exact ablation importance) "
        f"{_cell(r['causal_spearman'])}; precision of causal token importance at |answering| "
        f"{_cell(r['causal_token_precision'])} ("
        + ", ".join(f"{k} {v:.3f}" for k, v in r["causal_token_precision_by_type"].items()) + ").",
        f"Head utility (hap.utility, one cut after each layer keeping ceil(N / 9) tokens by one map): mean per-question "
        f"Spearman(PAQ, utility) {_cell(r['utility_spearman'])}; share of cuts keeping the answer by the best single "
        f"head {_cell(r['utility_best_head'])}, the uniform average {_cell(r['utility_uniform'])}, the PAQ weighting "
        f"{_cell(r['utility_paq'])}; Spearman within layers (the heads one layer's weighting chooses between; "
        f"across layers utility mostly grows with depth) {_cell(r['utility_spearman_within_layers'])}.",
        "", "| head utility | " + " | ".join(r["utility_spearman_by_type"]) + " |",
        "|---" * (len(r["utility_spearman_by_type"]) + 1) + "|",
        *(f"| {key.removeprefix('utility_')} | " + " | ".join(_cell(v) for v in r[f"{key}_by_type"].values()) + " |"
          for key in UTILITY_KEYS),
    ]


def _cell(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def plots(r: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    xs = list(r["retained_tokens"].values())
    drawn = {m: row for m, row in r["accuracy"].items() if not all(math.isnan(v) for v in row.values())}
    colors, markers, dashes = plt.get_cmap("tab20").colors, "os^Dvx<>P*", ("-", "--", "-.", ":")
    for i, (m, row) in enumerate(drawn.items()):  # 15 methods: colour, marker and dash each cycle
        ax.plot(xs, list(row.values()), marker=markers[i % len(markers)], ls=dashes[i % len(dashes)],
                color=colors[(2 * i + i // 10) % len(colors)], label=m)
    ax.axhline(r["unpruned_accuracy"], color="gray", ls="--", lw=1, label="unpruned")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(f"retained visual tokens (average over decoder layers, of {r['num_visual']})")
    ax.set_ylabel("held-out accuracy")
    not_run = [m for m in r["accuracy"] if m not in drawn]
    ax.set_title(f"{Path(r['model']).name}: accuracy vs budget ({r['n_questions']} questions)"
                 + (f"\nnot run here: {', '.join(not_run)} (refused or out of reach)" if not_run else ""), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    plt.close(fig)

    if "head_paq" not in r:
        return
    paq, grd = np.array(r["head_paq"]), np.array(r["head_grounding"])
    fig, ax = plt.subplots(figsize=(5, 4))
    sc = ax.scatter(paq.ravel(), grd.ravel(), c=np.repeat(np.arange(paq.shape[0]), paq.shape[1]), cmap="viridis")
    fig.colorbar(sc, label="decoder layer")
    ax.set_xlabel("PAQ (mean over questions)")
    ax.set_ylabel("grounding ratio on the queried object")
    ax.set_title(f"PAQ vs grounding truth, Spearman {r['grounding_spearman']:.2f}")
    fig.tight_layout()
    fig.savefig(out / "paq_grounding.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
