"""A budget sweep on one input: every pruning method at budgets from 1.0 down to the smallest the model
reaches, with its greedy answer and the probability it gives the unpruned answer (docs/method.md §4, §7). A method
the model refuses by name (VisionZip without a [CLS] token, PyramidDrop on Qwen2-VL's M-RoPE) is left out and listed
with the reason.

The budget is `retain` (the layer-averaged fraction of visual tokens kept, §4.1); the other knobs stay as
given. The smallest budget is the one every method can honour on this decoder: the first K layers keep every
token and every later layer at least one (`hap.budget.smallest_retain` on the model's shape). SparseVLM and
AutoPrune (`OFFICIAL`) run their official schedules, whose first cut comes after layer 0, so their floor is at least
1 / layers: they do not set the grid, and at a budget below their floor they have no answer (None, "out of reach"). The answer comes from
`hap.run` (untraced), cut at its end (`short_answer`: end of sequence, end of line, or `ANSWER_WORDS` words), the
unpruned one included, since a pruned run may ramble on until the token limit. The probability of the
unpruned answer is teacher-forced: the product of the pruned model's next-token probabilities of that (cut)
answer's tokens, generated on the pruned cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

import hap
from hap.budget import OFFICIAL
from hap.budget import smallest_retain as floor_retain
from hap.inputs import InputLimits, load_image
from hap.patch import refusal
from hap.patch.decoder import decoder_shape
from hap.run import build_inputs

POINTS = 6  # budgets from 1.0 down to the smallest, evenly spaced on a log scale
METHODS = [m for m in hap.METHODS if m != "none"]  # every method that prunes
GRID = [m for m in METHODS if m not in OFFICIAL]  # the methods whose floors set the grid's smallest budget
ANSWER_WORDS = 3  # an answer is cut after this many words


def short_answer(text: str, words: int = ANSWER_WORDS) -> str:
    """`text` cut at the end of the answer: its first line, at most `words` words (generation already stopped at
    the end of the sequence); "" for an empty answer."""
    if words < 1:
        raise ValueError(f"words={words} must be at least 1")
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()[:words]) if lines else ""


def smallest_retain(config: hap.HAPConfig, shape: hap.DecoderShape, num_visual: int,
                    methods: Sequence[str] = GRID) -> float:
    """The smallest retain every method of `methods` reaches on `shape`: the largest of their floors (the first K
    full layers keep every token, every later layer one; `hap.budget.smallest_retain`)."""
    return max(floor_retain(replace(config, method=m, retain=None, flops_ratio=None), shape, num_visual)
               for m in methods)


def budgets(config: hap.HAPConfig, shape: hap.DecoderShape, num_visual: int, points: int = POINTS,
            methods: Sequence[str] = GRID) -> list[float]:
    """`points` retains from 1.0 down to `smallest_retain` of `methods`, evenly spaced on a log scale."""
    return [float(r) for r in np.geomspace(1.0, smallest_retain(config, shape, num_visual, methods), points)]


def refused(model, config: hap.HAPConfig) -> dict[str, str]:
    """{method: why} for the METHODS `model` does not take (`hap.patch.refusal`: visionzip without a [CLS] token,
    pdrop on Qwen2-VL's M-RoPE)."""
    why = {m: refusal(model, replace(config, method=m, retain=None, flops_ratio=None)) for m in METHODS}
    return {m: w for m, w in why.items() if w is not None}


def answer_probability(model, inputs, config: hap.HAPConfig, answer_ids: list[int]) -> float | None:
    """Probability the model pruned by `config` gives the tokens `answer_ids` after the prompt of `inputs`
    (each token forced in turn on the pruned cache); None for an empty answer."""
    if not answer_ids:
        return None
    start = inputs["input_ids"].shape[1]
    with hap.patched(model, config), torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=len(answer_ids), do_sample=False, num_beams=1,
                             output_logits=True, return_dict_in_generate=True,
                             prefix_allowed_tokens_fn=lambda _, ids: [answer_ids[ids.shape[-1] - start]])
    logp = sum(float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, answer_ids))
    return float(np.exp(logp))


def reference_config(config: hap.HAPConfig) -> hap.HAPConfig:
    """`config` as the stock model (method none)."""
    return replace(config, method="none", retain=None, flops_ratio=None)


def sweep(model, processor, image, prompt: str, config: hap.HAPConfig, max_new_tokens: int, limits: InputLimits,
          on_step: Callable[[float, str], None] | None = None) -> dict:
    """`{"retain": [R], "methods": {name: {"answers": [R], "answer_prob": [R]}}, "unpruned": {...}, "refused": {name:
    why}}` for every method of METHODS the model takes (`refused`) at `budgets(...)`, `config`'s other knobs unchanged
    (its method and budget are replaced); None for both where a budget is below a method's floor (out of reach)."""
    step = on_step or (lambda fraction, description: None)
    image = load_image(image, limits)

    def answer(cfg: hap.HAPConfig) -> tuple[str, int]:
        """(the answer cut at its end, the visual tokens the model saw)."""
        run = hap.run(model, processor, image, prompt, cfg, max_new_tokens=max_new_tokens, trace=False,
                      limits=limits)
        return short_answer(run.answer), run.num_visual

    step(0.0, "unpruned reference answer")
    reference, num_visual = answer(reference_config(config))
    answer_ids = processor.tokenizer(reference, add_special_tokens=False).input_ids
    inputs, _, _ = build_inputs(processor, image, prompt, limits)
    inputs = inputs.to(next(model.parameters()).device)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    refusals = refused(model, config)
    methods = [m for m in METHODS if m not in refusals]
    shape = decoder_shape(model)
    retains = budgets(config, shape, num_visual, methods=[m for m in methods if m in GRID] or methods)
    stock = answer_probability(model, inputs, reference_config(config), answer_ids)
    out = {"retain": retains, "methods": {m: {"answers": [], "answer_prob": []} for m in methods},
           "unpruned": {"answer": reference, "answer_prob": stock}, "refused": refusals}
    for i, method in enumerate(methods):
        step(i / len(methods), f"{method}: {len(retains)} budgets")
        floor = floor_retain(replace(config, method=method, retain=None, flops_ratio=None), shape, num_visual)
        for retain in retains:
            cfg = replace(config, method=method, retain=retain, flops_ratio=None)
            reach = retain >= floor - 1e-12  # else out of reach (an official schedule below its floor)
            out["methods"][method]["answers"].append(answer(cfg)[0] if reach else None)
            out["methods"][method]["answer_prob"].append(answer_probability(model, inputs, cfg, answer_ids)
                                                         if reach else None)
    return out
