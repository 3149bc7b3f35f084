"""A budget sweep on one input: every pruning method at budgets from 1.0 down to the smallest the model
reaches, with its greedy answer and the probability it gives the unpruned answer (docs/method.md §4, §7). A method
the model refuses by name (VisionZip without a [CLS] token, PyramidDrop on Qwen2-VL's M-RoPE) is left out and listed
with the reason.

The budget is `retain` (the layer-averaged fraction of visual tokens kept, §4.1); the other knobs stay as
given. The smallest budget is the one every method can honour on this decoder: the first K layers keep every
token and every later layer at least one (`hap.planning.budget.smallest_retain` on the model's shape). SparseVLM and
AutoPrune run their official schedules and DART reads the layer before its cut (`own_floor`): their first cut comes
after layer 0, so their floor is at least 1 / layers: they do not set the grid, and at a budget below their floor
they have no answer (None, "out of reach"). Downsample on dynamic resolution (the Qwen2-VL family) runs on the image
resized for each budget (`hap.runs.run.for_config`); a budget the processor's pixel bounds cannot shrink the image to is
out of reach too. The answer comes from
`hap.run` (untraced), cut at its end (`short_answer`: end of sequence, end of line, or `ANSWER_WORDS` words), the
unpruned one included, since a pruned run may ramble on until the token limit. The probability of the
unpruned answer is teacher-forced: the product of the pruned model's next-token probabilities of that (cut)
answer's tokens, generated on the pruned cache.

`shared=True` (the app's default, HAP_APP_SHARE) gives the same answers and probabilities for less work (`tests/
test_sweep.py` compares the two): each generation stops once its cut answer is complete (`AnswerEnd`); where the
greedy answer begins with the unpruned answer's tokens, their probability is read from the same generation's logits
(the forced pass would compute exactly those logits again); and at a budget where a method's schedule keeps every
visual token in every layer (`keeps_everything`), its run is the stock model's, whose answer and probability are
the unpruned ones. The image's features come from the caller's `hap.runs.features` cache where there is one, and the
layers before each run's first cut are computed once (`hap.patch.prefix.sharing_layers`). Where the model allows a batch
(`hap.patch.batch.refusal`), every method's budgets are prefilled one by one and their answers continued as batches
of as many runs as `DECODE_BYTES` of padded KV cache holds (`batch_rows`), not one batch per method: a decode step
streams the weights once for every run in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

import hap
from hap.patch import batch, visual_tokens
from hap.patch.decoder import decoder_shape
from hap.patch.prefix import sharing_layers
from hap.planning.budget import plan, smallest_retain as floor_retain
from hap.pruners import pruner_class, pruner_for
from hap.runs.inputs import InputLimits
from hap.runs.keeps import pruning, refusal
from hap.runs.run import Prepared, eos_ids, for_config, generate, prefill_then_decode, prepare

POINTS = 6  # budgets from 1.0 down to the smallest, evenly spaced on a log scale
ANSWER_WORDS = 3  # an answer is cut after this many words
GRID_TOKENS = 2  # the most tokens a cut's rule may need to stay on the grid (VisionZip's [CLS] and a patch)
DECODE_BYTES = 2 * 2**30  # the KV caches of one batch of the sweep's runs, each padded to the unpruned one (`batch_rows`)


def own_floor(method: str) -> bool:
    """Whether `method`'s rule sets its own floor (the official schedules; DART's cut after layer 0 at the earliest,
    4 pivots at least; a rule that keeps more than GRID_TOKENS tokens at a cut, PruneSID's [CLS] and a group): off the
    grid of budgets."""
    pruner = pruner_class(method)
    return pruner.official or bool(pruner.min_full_layers) or pruner.min_tokens > GRID_TOKENS


def grid_methods() -> list[str]:
    """The methods whose floors set the grid's smallest budget: every method that prunes (`hap.runs.keeps.pruning`, read
    from the registry, registered pruners included) but those with their `own_floor`."""
    return [m for m in pruning() if not own_floor(m)]


def short_answer(text: str, words: int = ANSWER_WORDS) -> str:
    """`text` cut at the end of the answer: its first line, at most `words` words (generation already stopped at
    the end of the sequence); "" for an empty answer."""
    if words < 1:
        raise ValueError(f"words={words} must be at least 1")
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()[:words]) if lines else ""


def smallest_retain(config: hap.HAPConfig, shape: hap.DecoderShape, num_visual: int,
                    methods: Sequence[str] | None = None) -> float:
    """The smallest retain every method of `methods` (default: `grid_methods`) reaches on `shape`: the largest of
    their floors (the first K full layers keep every token, every later layer one; `hap.planning.budget.smallest_retain`)."""
    methods = grid_methods() if methods is None else methods
    return max(floor_retain(replace(config, method=m, retain=None, flops_ratio=None), shape, num_visual)
               for m in methods)


def budgets(config: hap.HAPConfig, shape: hap.DecoderShape, num_visual: int, points: int = POINTS,
            methods: Sequence[str] | None = None) -> list[float]:
    """`points` retains from 1.0 down to `smallest_retain` of `methods` (default: `grid_methods`), evenly spaced on
    a log scale."""
    return [float(r) for r in np.geomspace(1.0, smallest_retain(config, shape, num_visual, methods), points)]


def refused(model, config: hap.HAPConfig) -> dict[str, str]:
    """{method: why} for the methods that prune (`hap.runs.keeps.pruning`) that `model` does not take (`hap.runs.keeps.refusal`: visionzip without a [CLS] token,
    pdrop on Qwen2-VL's M-RoPE, a file a method needs that does not load)."""
    configs = {m: replace(config, method=m, retain=None, flops_ratio=None) for m in pruning()}
    why = {m: refusal(model, c) for m, c in configs.items()}
    return {m: w for m, w in why.items() if w is not None}


def answer_complete(text: str, words: int = ANSWER_WORDS) -> bool:
    """Whether generated `text` holds its whole cut answer (`short_answer`): a line break after some text, or more
    than `words` words (the first `words` can no longer change)."""
    text = text.strip()
    return "\n" in text or len(text.split()) > words


class AnswerEnd:
    """A stopping criterion for `generate`: stop each sample once the text it generated after position `start` holds
    the whole cut answer (`answer_complete`)."""

    def __init__(self, tokenizer, start: int, words: int = ANSWER_WORDS) -> None:
        self.tokenizer, self.start, self.words = tokenizer, start, words

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = [answer_complete(self.tokenizer.decode(row[self.start:], skip_special_tokens=True), self.words)
                for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def answer_length(tokenizer, ids: list[int], ends: set[int], words: int = ANSWER_WORDS) -> int:
    """Tokens of `ids` a generation stopped by `AnswerEnd` and the end of the sequence (`ends`) keeps."""
    return next((n for n in range(1, len(ids) + 1) if ids[n - 1] in ends or answer_complete(
        tokenizer.decode(ids[:n], skip_special_tokens=True), words)), len(ids))


def keeps_everything(config: hap.HAPConfig, shape: hap.DecoderShape, num_visual: int, text_tokens: int) -> bool:
    """Whether `config` runs as the stock model on this input: its schedule gives every layer the stock model's tokens
    (`full_layers`)."""
    return full_layers(config, shape, num_visual, text_tokens) == shape.layers


def answer_probability(model, p: Prepared, config: hap.HAPConfig, answer_ids: list[int]) -> float | None:
    """Probability the model pruned by `config` gives the tokens `answer_ids` after the prompt of `p` (as
    `hap.runs.run.for_config` prepares it for `config`), each token forced in turn on the pruned cache; None for an empty
    answer."""
    if not answer_ids:
        return None
    start = p.prompt_len
    _, out, _ = generate(model, p, config, False, len(answer_ids), output_logits=True, return_dict_in_generate=True,
                         prefix_allowed_tokens_fn=lambda _, ids: [answer_ids[ids.shape[-1] - start]])
    return forced_probability(out.logits, answer_ids)


def forced_probability(logits, answer_ids: list[int]) -> float:
    """exp(sum_i log softmax(logits[i])[answer_ids[i]]): `logits` one `[1, vocab]` tensor per generated step."""
    logp = sum(float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(logits, answer_ids))
    return float(np.exp(logp))


def generated_answer(model, processor, p: Prepared, config: hap.HAPConfig, max_new_tokens: int
                     ) -> tuple[str, list[int], tuple]:
    """One generation of `config` on `p` (as `hap.runs.run.for_config` prepares it) stopped at its answer's end
    (`AnswerEnd`): (the cut answer, the generated token ids, the logits of each step, `[1, vocab]` each)."""
    start = p.prompt_len
    _, out, _ = generate(model, p, config, False, max_new_tokens, output_logits=True, return_dict_in_generate=True,
                         stopping_criteria=[AnswerEnd(processor.tokenizer, start)])
    ids = out.sequences[0, start:].tolist()
    return short_answer(processor.decode(ids, skip_special_tokens=True)), ids, out.logits


def generated_together(model, processor, jobs: list[tuple[Prepared, hap.HAPConfig]], max_new_tokens: int,
                       on_prefill: Callable[[int], None] | None = None
                       ) -> tuple[list[tuple[str, list[int], list]], list[batch.Prefilled], list[torch.Tensor]]:
    """`generated_answer` of each `(prepared input, config)` job (the same answers and logits): one prefill each
    (`on_prefill(i)` called before job i's), the greedy answers continued as one batch (`hap.patch.batch`, prompts of
    different lengths left-padded to the longest) until each is complete, each row cut where it would have stopped
    alone. Also returns the prefills and their first logits `[1, vocab]`, for `forced_together`."""
    start = max(q.prompt_len for q, _ in jobs)
    done = prefill_then_decode(model, [(q, config, False) for q, config in jobs], max_new_tokens,
                               {"output_logits": True}, on_prefill, output_logits=True,
                               stopping_criteria=[AnswerEnd(processor.tokenizer, start)])
    first_logits = [out.logits[0] for out in done.outputs]
    rows, ends = [], set(eos_ids(model))
    for i in range(len(jobs)):
        ids = done.tokens[i].tolist()
        ids = ids[:answer_length(processor.tokenizer, ids, ends)]
        logits = [first_logits[i], *(step[i:i + 1] for step in done.logits)][:len(ids)]
        rows.append((short_answer(processor.decode(ids, skip_special_tokens=True)), ids, logits))
    return rows, done.runs, first_logits


def forced_together(model, runs: list[batch.Prefilled], first_logits: list[torch.Tensor], answer_ids: list[int]
                    ) -> list[float]:
    """`answer_probability` of `answer_ids` on each prefilled run (`generated_together`), forced on its own cache, the
    runs as one batch."""
    steps = ()
    if len(answer_ids) > 1:
        firsts = [torch.cat([run.first[:, :-1], run.first.new_tensor([answer_ids[:1]])], 1) for run in runs]
        T = max(run.prompt_len for run in runs)
        with torch.inference_mode():
            steps = batch.decode(model, runs, len(answer_ids) - 1, firsts, output_logits=True,
                                 return_dict_in_generate=True,
                                 prefix_allowed_tokens_fn=lambda _, ids: [answer_ids[ids.shape[-1] - T]]).logits
    return [forced_probability([first, *(step[i:i + 1] for step in steps)], answer_ids)
            for i, first in enumerate(first_logits)]


def read_probability(ids: list[int], logits, answer_ids: list[int]) -> float | None:
    """The probability of `answer_ids` from a generation's own logits where its tokens `ids` begin with them (the
    forced pass would compute exactly these logits), else None (not readable here)."""
    if not answer_ids or ids[:len(answer_ids)] != answer_ids:
        return None
    return forced_probability(logits, answer_ids)


def reference_config(config: hap.HAPConfig) -> hap.HAPConfig:
    """`config` as the stock model (method none)."""
    return replace(config, method="none", retain=None, flops_ratio=None)


def sweep(model, processor, image, prompt: str, config: hap.HAPConfig, max_new_tokens: int, limits: InputLimits,
          on_step: Callable[[float, str], None] | None = None, shared: bool = False) -> dict:
    """`{"retain": [R], "methods": {name: {"answers": [R], "answer_prob": [R]}}, "unpruned": {...}, "refused": {name:
    why}}` for every method that prunes (`hap.runs.keeps.pruning`) the model takes (`refused`) at `budgets(...)`, `config`'s other knobs unchanged
    (its method and budget are replaced); None for both where a budget is below a method's floor (out of reach).
    `shared`: the same figures for less work (module docstring)."""
    step = on_step or (lambda fraction, description: None)
    p = prepare(model, processor, image, prompt, max_new_tokens, limits, ())
    num_visual = int(visual_tokens(model, p.inputs)[0].sum())  # the image's own count (no newline tokens)
    text_tokens = p.prompt_len - num_visual
    together = shared and batch.refusal(model) is None

    def answer(cfg: hap.HAPConfig) -> str:
        """The answer cut at its end, from `hap.run` (untraced) as the page's runs give it."""
        return short_answer(hap.run(model, processor, p.picture, prompt, cfg, max_new_tokens=max_new_tokens,
                                    trace=False, limits=limits).answer)

    how = (" · image encoded once, layers before the cuts shared, answers stop at their end" if shared else "") + (
        ", decoded in batches" if together else "")
    step(0.0, "unpruned reference answer" + how)
    if shared:
        reference, ids, logits = generated_answer(model, processor, p, reference_config(config), max_new_tokens)
    else:
        reference = answer(reference_config(config))
    answer_ids = processor.tokenizer(reference, add_special_tokens=False).input_ids
    refusals = refused(model, config)
    methods = [m for m in pruning() if m not in refusals]
    shape = decoder_shape(model)
    retains = budgets(config, shape, num_visual, methods=[m for m in methods if not own_floor(m)] or methods)

    def probability(q: Prepared, cfg: hap.HAPConfig, ids: list[int] = (), logits=()) -> float | None:
        """Read from a generation's own logits where it allows, else teacher-forced on `q`."""
        read = read_probability(list(ids), logits, answer_ids)
        return read if read is not None else answer_probability(model, q, cfg, answer_ids)

    stock = probability(p, reference_config(config), *((ids, logits) if shared else ()))
    found: dict[tuple[str, float], tuple] = {}  # (method, retain) -> (answer, probability)
    jobs: list[Job] = []  # the runs that need a pruned generation of their own
    for method in methods:
        floor = floor_retain(replace(config, method=method, retain=None, flops_ratio=None), shape, num_visual)
        for retain in retains:
            cfg = replace(config, method=method, retain=retain, flops_ratio=None)
            if retain < floor - 1e-12:  # out of reach (an official schedule below its floor)
                found[method, retain] = (None, None)
                continue
            depth = full_layers(cfg, shape, num_visual, text_tokens)
            if shared and depth == shape.layers:  # the stock model's run (`keeps_everything`)
                found[method, retain] = (reference, stock)
                continue
            try:
                q = for_config(model, processor, p, cfg)
            except ValueError:  # the processor's pixel bounds cannot shrink the image to this budget
                found[method, retain] = (None, None)
                continue
            jobs.append(Job(method, retain, cfg, q, depth))
    jobs.sort(key=lambda job: (retains.index(job.retain), -job.depth))  # budget by budget, longest shared start first

    def starting(j: int) -> None:
        step(j / len(jobs), f"{jobs[j].method} at retain {jobs[j].retain:.3f} ({j + 1} of {len(jobs)} runs){how}")

    with sharing_layers(model, max((job.depth for job in jobs), default=0)) if shared else nullcontext():
        if together:
            rows = batch_rows(model, p.prompt_len)
            for start in range(0, len(jobs), rows):
                chunk = jobs[start:start + rows]
                found.update(zip(((job.method, job.retain) for job in chunk), answered(
                    model, processor, [(job.prepared, job.config) for job in chunk], max_new_tokens, answer_ids,
                    lambda j, start=start: starting(start + j))))
        else:
            for j, job in enumerate(jobs):
                starting(j)
                if shared:
                    text, ids, logits = generated_answer(model, processor, job.prepared, job.config, max_new_tokens)
                    found[job.method, job.retain] = (text, probability(job.prepared, job.config, ids, logits))
                else:
                    found[job.method, job.retain] = (answer(job.config), probability(job.prepared, job.config))
    return {"retain": retains, "unpruned": {"answer": reference, "answer_prob": stock}, "refused": refusals,
            "methods": {m: {"answers": [found[m, r][0] for r in retains],
                            "answer_prob": [found[m, r][1] for r in retains]} for m in methods}}


@dataclass
class Job:
    """One pruned run of the sweep: a method at a budget, on its prepared input (`hap.runs.run.for_config`)."""

    method: str
    retain: float
    config: hap.HAPConfig
    prepared: Prepared
    depth: int  # its leading decoder layers that run every visual token (`full_layers`)


def full_layers(config: hap.HAPConfig, shape: hap.DecoderShape, num_visual: int, text_tokens: int) -> int:
    """How many leading decoder layers run the stock model's tokens under `config`'s schedule: the layers its runs may
    share with the others of the input (`hap.patch.prefix`): those before its first drop, or before its first cut where
    the cuts write tokens of their own (`Pruner.rewrites`: VisionZip's, downsample's pooled ones below a budget of
    every token) or an official schedule recycles the dropped ones; 0 for a cut before layer 0; every layer for the
    stock model's run."""
    schedule = plan(config, shape, num_visual, text_tokens)
    if schedule is None:
        return shape.layers
    drop = next((i for i, n in enumerate(schedule.visual_per_layer) if n < num_visual), shape.layers)
    pruner = pruner_for(config)
    if pruner.official or any(pruner.rewrites(k, num_visual) for k in schedule.kept):
        return min(drop, schedule.cuts[0])
    return drop


def batch_rows(model, prompt_len: int, limit: int = DECODE_BYTES) -> int:
    """How many of the sweep's runs to prefill and continue as one batch: as many as keep the batch's KV caches, each
    padded to the unpruned cache of `prompt_len` tokens (`batch.merge_caches`), within `limit` bytes; at least one."""
    shape = decoder_shape(model)
    per_run = shape.layers * 2 * shape.kv_dim * prompt_len * next(model.parameters()).element_size()
    return max(1, limit // per_run)


def answered(model, processor, jobs: list[tuple[Prepared, hap.HAPConfig]], max_new_tokens: int,
             answer_ids: list[int], on_prefill: Callable[[int], None] | None = None) -> list[tuple[str, float | None]]:
    """(cut answer, probability of `answer_ids`) of each `(prepared input, config)` job, its answers generated
    together (`generated_together`), the probabilities read from their own logits where they allow, else forced
    together on the same prefills (`forced_together`). `on_prefill(i)`: called before job i's prefill."""
    rows, runs, first_logits = generated_together(model, processor, jobs, max_new_tokens, on_prefill)
    read = [read_probability(ids, logits, answer_ids) if answer_ids else None for _, ids, logits in rows]
    unread = [i for i, r in enumerate(read) if r is None and answer_ids]
    if unread:
        forced = forced_together(model, [runs[i] for i in unread], [first_logits[i] for i in unread], answer_ids)
        for i, value in zip(unread, forced):
            read[i] = value
    return [(text, value) for (text, _, _), value in zip(rows, read)]
