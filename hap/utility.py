"""Head utility: each head's attention map as a token scorer, judged by the answer (docs/method.md §12).

PAQ exists to weight the heads whose maps pick the right tokens; head utility measures that on the stock model. For
every layer l < L - 1 and head h, one cut entering layer l + 1 keeps the `keep` visual tokens that head (l, h)'s
attention from the prompt rows scores highest (s_v = ||A[l, h][:, v]||_2, the library's selection rule), with
nothing merged and every other setting as the library's single-cut schedule (groups=1, first_layers=l+1, kept
tokens at their original positions, later layers on them only). The utility is the probability the pruned model
gives the unpruned model's greedy first answer token. The last layer has no layer after it to cut into (NaN).

At the same cut (same keep, same rows) two reference lines: the plain average of layer l's heads and their
softmax(PAQ / T) weighting (PAQ from the unpruned run, every token present, as HAP's first cut sees it): would
another weighting have kept the answer?

How it runs: one traced unpruned forward gives the answer token and every head's map (`hap.runs.trace`); then, per
layer l, the one-cut schedule with its kept set forced through the pruner's `priority` (H + 2 rows: the heads' top
sets and the two references). The batch-1 input fans out at the cut (`PruneState.start`): the layers before it run
once for all rows, the layers after it on `batch_size` rows per forward.

Cost in unpruned prefills (L layers, H heads, N visual and t text tokens, k kept, c(n) a layer's cost on n tokens):
1 for the traced forward, then per scored layer l (l + 1) / L for the shared layers plus (H + 2) (L - l - 1) / L x
c(k + t) / c(N + t); over all layers about L / 2 + (H + 2) L / 2 x c(k + t) / c(N + t), less with `layers=`
(`cost`: FLOPs; measured by `python -m analysis.causal_speed`, docs/method.md §12).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .causal import default_mode, head_layout, paq_spearman, prepare
from .config import HAPConfig
from .methods import RANDOM, UNIFORM
from .patch import patched
from .planning.flops import DecoderShape, layer_flops
from .runs.inputs import DEFAULT_LIMITS, InputLimits
from .runs.run import conversation, question_lead, template_tail
from .scoring.fusion import select_top

UTILITY_BATCH = 34  # pruned variants per forward (a 32-head layer and its two references)


@dataclass
class HeadUtility:
    """One input's head utility; `[layers, ...]` float CPU, NaN (False) on the layers not scored (the last one,
    those left out by `layers=`)."""

    values: torch.Tensor  # [layers, heads] p(answer) after the cut entering l + 1 by head (l, h)'s map alone
    keeps: torch.Tensor  # bool [layers, heads] the answer token is still the most likely one after that cut
    uniform: torch.Tensor  # [layers] p(answer) after the same cut by the plain average of layer l's heads
    uniform_keeps: torch.Tensor  # bool [layers]
    paq_weighted: torch.Tensor  # [layers] p(answer) after the same cut by softmax(PAQ / T) over layer l's heads
    paq_keeps: torch.Tensor  # bool [layers]
    paq: torch.Tensor  # [layers, heads] PAQ of the unpruned run from the same rows
    keep: int  # visual tokens each cut keeps
    rows: str  # the prompt rows that scored the tokens and PAQ
    answer_token: int  # the unpruned model's greedy first answer token
    answer_text: str
    answer_prob: float  # its probability without pruning
    seconds: float

    @property
    def scored(self) -> list[int]:
        """The layers whose heads were scored."""
        return [int(l) for l in torch.isfinite(self.uniform).nonzero().flatten()]

    def answer_kept(self) -> dict[str, int]:
        """Of the scored cuts, how many keep the answer the most likely token when the tokens are chosen by the best
        single head, the uniform average, the PAQ weighting."""
        s = self.scored
        return {"best_head": int(self.keeps[s].any(1).sum()), UNIFORM: int(self.uniform_keeps[s].sum()),
                "paq_weighted": int(self.paq_keeps[s].sum())}


def default_keep(num_visual: int) -> int:
    """The tokens a utility cut keeps by default: ceil(N / 9) (16 of 144, 64 of 576)."""
    return math.ceil(num_visual / 9)


def one_cut(layer: int, keep: int, num_visual: int, num_layers: int) -> HAPConfig:
    """The library's single-cut schedule entering `layer` (groups=1, first_layers=layer) keeping exactly `keep` of
    `num_visual` tokens: its retain is that schedule's layer average. The kept set comes from a priority; the random
    policy captures nothing and only breaks ties below it."""
    retain = (layer * num_visual + (num_layers - layer) * keep) / (num_layers * num_visual)
    return HAPConfig(method=RANDOM, groups=1, first_layers=layer, retain=retain)


def top_sets(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """1 on each row's `keep` highest scores (ties: the lower index), else 0: `scores [rows, N]` -> `[rows, N]`."""
    chosen = select_top(scores, keep)
    return torch.zeros_like(scores).scatter_(1, chosen, 1.0)


def scored_layers(layers: Iterable[int] | None, num_layers: int) -> list[int]:
    """The layers to score: every one with a layer after it (None), else `layers` in order, the last layer left out
    (NaN); ValueError outside the decoder."""
    chosen = range(num_layers) if layers is None else sorted(set(layers))
    bad = [l for l in chosen if isinstance(l, bool) or not isinstance(l, (int, np.integer)) or not 0 <= l < num_layers]
    if bad:
        raise ValueError(f"layers={bad} are outside the decoder's layers 0..{num_layers - 1}")
    return [int(l) for l in chosen if l < num_layers - 1]


def auto_layers(model, cuts: Iterable[int] = ()) -> list[int] | None:
    """The layers to score by default: every one (None) where exact ablation is cheap (`hap.causal.default_mode`),
    else the layers just before `cuts` (a run's cut layers; the middle layer without one), a few of them being
    affordable on a large model where all are not."""
    if default_mode(model) == "ablation":
        return None
    before = sorted({c - 1 for c in cuts if c > 0})
    return before or [head_layout(model)[0] // 2 - 1]


def utility(model, processor, image, prompt: str, keep: int | None = None, rows: str = "last",
            history: Sequence[tuple[str, str]] = (), layers: Iterable[int] | None = None,
            config: HAPConfig | None = None, batch_size: int = UTILITY_BATCH,
            limits: InputLimits = DEFAULT_LIMITS) -> HeadUtility:
    """Head utility of one image and prompt (`history`: earlier turns, the rows are the new question's), with
    its two reference lines; `layers` a subset of the layers to score (default: all but the last), `config` the PAQ
    knobs of the reference weighting (temperature, sink detector; default `HAPConfig()`), its rows replaced by
    `rows`. ValueError on bad input, a keep outside [1, N] or a patched model."""
    t0 = time.perf_counter()
    prompt, history, _ = conversation(processor, prompt, history, limits)
    inputs = prepare(model, processor, image, prompt, limits, history)
    found = measure(model, inputs, keep, rows, layers, config, batch_size, template_tail(processor),
                    question_lead(processor, history))
    return replace(found, answer_text=processor.decode([found.answer_token], skip_special_tokens=False),
                   seconds=time.perf_counter() - t0)


def measure(model, inputs: dict, keep: int | None = None, rows: str = "last", layers: Iterable[int] | None = None,
            config: HAPConfig | None = None, batch_size: int = UTILITY_BATCH, tail: int = 0,
            lead: int = 0) -> HeadUtility:
    """`utility` of batch-1 processor `inputs` on the model's device (`tail`, `lead`: see `hap.patch.apply`); the
    answer's text is left empty."""
    t0 = time.perf_counter()
    config = replace(config or HAPConfig(), method="none", rows=rows)
    L, H = head_layout(model)
    chosen = scored_layers(layers, L)
    with patched(model, config, trace=True, tail=tail, lead=lead) as patch, torch.inference_mode():
        probs = model(**inputs, logits_to_keep=1, use_cache=False).logits[0, -1].float().softmax(-1)
    answer, traced, N = int(probs.argmax()), patch.state.tracer.layers, patch.state.num_visual
    keep = default_keep(N) if keep is None else keep
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or not 1 <= keep <= N:
        raise ValueError(f"keep={keep!r} must be an integer in [1, {N}] (the visual tokens)")
    p, kept = torch.full((L, H + 2), math.nan), torch.zeros(L, H + 2, dtype=torch.bool)
    for l in chosen:
        t = traced[l]
        priority = top_sets(torch.cat([t.head_maps[0], t.uniform_map, t.fused_map]), int(keep))  # [H + 2, N]
        p[l], kept[l] = answer_after(model, inputs, one_cut(l + 1, int(keep), N, L), priority, answer, batch_size)
    paq = torch.full((L, H), math.nan)
    for l, t in traced.items():
        paq[l] = t.paq[0]
    return HeadUtility(p[:, :H], kept[:, :H], p[:, H], kept[:, H], p[:, H + 1], kept[:, H + 1], paq, int(keep), rows,
                       answer, "", float(probs[answer].cpu()), time.perf_counter() - t0)


def cost(shape: DecoderShape, num_visual: int, text_tokens: int, heads: int, keep: int | None = None,
         layers: Iterable[int] | None = None) -> float:
    """FLOPs of `measure` in unpruned prefills (`hap.planning.budget` accounting) on a decoder of `shape` and `heads` heads:
    the traced unpruned forward, then per scored layer l the layers 0..l once and layers l+1.. on keep + text tokens
    for H + 2 variants (the attention capture and the output head left out)."""
    keep = default_keep(num_visual) if keep is None else keep
    L = shape.layers
    full, cut = layer_flops(num_visual + text_tokens, shape), layer_flops(keep + text_tokens, shape)
    per_layer = [(l + 1) * full + (heads + 2) * (L - l - 1) * cut for l in scored_layers(layers, L)]
    return 1.0 + sum(per_layer) / (L * full)


@torch.inference_mode()
def answer_after(model, inputs: dict, cut: HAPConfig, priority: torch.Tensor, answer: int,
                 batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(p(answer) [rows], bool [rows] whether it stays the most likely token) after the cut `cut` keeps each row of
    `priority [rows, N]`'s tokens ranked first, `batch_size` rows per forward of the batch-1 `inputs`."""
    p, top = [], []
    for part in priority.split(batch_size):
        with patched(model, cut, priority=part):
            probs = model(**inputs, logits_to_keep=1, use_cache=False).logits[:, -1].float().softmax(-1).cpu()
        p.append(probs[:, answer])
        top.append(probs.argmax(-1) == answer)
    return torch.cat(p), torch.cat(top)


def head_utility(model, processor, image, prompt: str, keep: int | None = None, rows: str = "last",
                 history: Sequence[tuple[str, str]] = (), layers: Iterable[int] | None = None) -> torch.Tensor:
    """`[layers, heads]` float CPU: for each layer l < L - 1 and head h, the probability of the unpruned model's
    greedy first answer token after one cut entering layer l + 1 that keeps the `keep` visual tokens (default
    ceil(N / 9)) head (l, h)'s attention from the prompt `rows` scores highest (the library's single-cut schedule,
    nothing merged); NaN on the last layer and the layers left out of `layers`. `utility` gives the reference lines
    too."""
    return utility(model, processor, image, prompt, keep, rows, history, layers).values


def within_layers(paq, values) -> float | None:
    """Mean over the layers of Spearman(PAQ, utility) among the layer's heads (`[layers, heads]` each; layers where
    it is undefined left out; None when it is nowhere defined): the heads a layer's weighting chooses between.
    Across layers utility mostly grows with depth (a later cut leaves fewer layers on the kept tokens), which the
    pooled Spearman also measures."""
    rhos = [paq_spearman(p, v) for p, v in zip(np.asarray(paq, float), np.asarray(values, float))]
    rhos = [r for r in rhos if r is not None]
    return float(np.mean(rhos)) if rhos else None


def to_json(u: HeadUtility) -> dict:
    """The `head_utility` entry of the `/analyze` and CLI JSON: values [layers][heads] and the references per layer
    (null where not scored), keep, Spearman(PAQ, utility) over the scored heads and within layers (`within_layers`;
    null when undefined), and what they were measured on."""
    def plain(values: torch.Tensor) -> list:
        return [None if math.isnan(v) else v for v in values.tolist()]

    return {
        "values": [plain(row) for row in u.values],
        "keep": u.keep,
        "spearman": paq_spearman(u.paq, u.values),
        "spearman_within_layers": within_layers(u.paq, u.values),
        UNIFORM: plain(u.uniform),
        "paq_weighted": plain(u.paq_weighted),
        "best_head": plain(u.values.amax(1)),  # NaN propagates: null on the layers not scored
        "answer_kept": {**u.answer_kept(), "cuts": len(u.scored)},
        "rows": u.rows,
        "answer_token": u.answer_token,
        "answer_text": u.answer_text,
        "answer_prob": u.answer_prob,
        "paq": [plain(row) for row in u.paq],
        "seconds": u.seconds,
    }
