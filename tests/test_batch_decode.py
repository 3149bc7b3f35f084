"""Answers decoded as one batch (`hap.patch.batch`, `hap.run.run_together`, the shared sweep): each run's greedy tokens
and logits are those it gets decoded alone, on every family whose layers allow it, for methods that keep positions,
renumber them, merge with a bias, recycle, or cut before layer 0; the rest decode alone, saying why."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import llava_case, llava_qwen2_case, noise_image, qwen_vl_case
from tiny_zoo import ZOO as NEXT
from tiny_zoo import SIZES
from tiny_zoo import inputs as zoo_inputs
from tiny_zoo_more import ZOO as MORE
from tiny_zoo_recent import gemma3, qwen3_vl
from transformers.cache_utils import DynamicCache

import hap
from hap.patch import apply, batch, refusal, remove
from hap.run import run, run_together

QUESTION = "what color is the square ?"
BASE = hap.HAPConfig(retain=0.4)
METHODS = ["none", "hap", "uniform", "fastv", "pdrop", "pdrop_ours", "visionzip", "sparsevlm", "autoprune", "random"]
STEPS = 6
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


def _zoo(build, size=(112, 112)):
    def case(layers: int = 6):
        model, processor = build(layers=layers)
        return model, lambda questions: zoo_inputs(processor, questions, [size])
    return case


FAMILIES = {  # family -> case(layers) -> (model, questions -> a batch-1 input)
    "llava": llava_case, "llava-qwen2": llava_qwen2_case, "qwen2-vl": qwen_vl_case,
    "llava-next": _zoo(NEXT["llava-next"], SIZES["llava-next"][0]),
    "llava-onevision": _zoo(NEXT["llava-onevision"], SIZES["llava-onevision"][0]),
    "internvl": _zoo(MORE["internvl"]), "idefics3": _zoo(MORE["idefics3"]),
    "qwen3-vl": _zoo(qwen3_vl, (100, 170)),
}


def _alone(model, inputs: dict, config: hap.HAPConfig, steps: int):
    apply(model, config)
    try:
        with torch.inference_mode():
            return model.generate(**inputs, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                                  output_logits=True)
    finally:
        remove(model)


def batched_error(model, inputs: dict, methods: list[str], steps: int = STEPS) -> tuple[float, list[str]]:
    """(max |logit difference| over the continued steps of every method run together and alone, the methods run):
    each method not refused on `model` prefills alone (batch 1), then `batch.decode` continues them as one batch; the
    greedy tokens must be the same."""
    configs = [c for c in (replace(BASE, method=m) for m in methods) if refusal(model, c) is None]
    alone = [_alone(model, inputs, config, steps) for config in configs]
    runs, firsts = [], []
    for config in configs:
        patch = apply(model, config)
        try:
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
        finally:
            remove(model)
        runs.append(batch.Prefilled(patch, out.cache))
        firsts.append(out.sequences)
    with torch.inference_mode():
        together = batch.decode(model, runs, torch.cat(firsts), inputs["input_ids"].shape[1], steps - 1,
                                return_dict_in_generate=True, output_logits=True)
    error = 0.0
    for i, one in enumerate(alone):
        assert torch.equal(together.sequences[i], one.sequences[0]), configs[i].method
        for step, logits in enumerate(one.logits[1:]):
            error = max(error, float((together.logits[step][i] - logits[0]).abs().max()))
    return error, [c.method for c in configs]


@pytest.mark.parametrize("family", FAMILIES)
def test_answers_decoded_together_are_those_decoded_alone(family):
    model, make = FAMILIES[family](layers=6)
    assert batch.refusal(model) is None
    error, methods = batched_error(model, make([QUESTION]), METHODS)
    assert error < 1e-5
    assert {"none", "hap", "uniform", "fastv", "random"} <= set(methods)  # keep positions (and merge), or cut at 0
    if family in ("llava", "llava-next", "internvl"):  # renumbered positions, recycled tokens
        assert {"pdrop", "sparsevlm"} <= set(methods)


def test_the_batch_holds_each_run_s_cache_left_padded_with_its_merge_bias():
    def run_of(lengths: list[int], bias: torch.Tensor | None = None) -> batch.Prefilled:
        cache = DynamicCache([(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)) for n in lengths])
        state = None if bias is None else type("State", (), {"bias_at": lambda self, layer: bias if layer else None,
                                                             "segment_index": {}})()
        return batch.Prefilled(type("Patch", (), {"state": state})(), cache)

    short, full = run_of([9, 5], torch.tensor([[0.5, 0.0, -1.0, 0.0, 2.0]])), run_of([10, 10])
    merged, masks = batch.merge_caches([short, full], prompt_len=10)
    assert [layer.keys.shape[2] for layer in merged.layers] == [10, 10]  # layer 0 as long as the prompt
    low = torch.finfo(torch.float32).min
    assert masks[0][0].tolist() == [low] + [0.0] * 9 and masks[0][1].tolist() == [0.0] * 10
    assert masks[1][0].tolist() == [low] * 5 + [0.5, 0.0, -1.0, 0.0, 2.0]
    assert torch.equal(merged.layers[1].keys[0, :, 5:], short.cache.layers[1].keys[0])
    assert not merged.layers[1].keys[0, :, :5].any() and torch.equal(merged.layers[1].values[1], full.cache.layers[1].values[0])


def test_layers_that_slide_a_window_and_planted_heads_decode_alone_saying_why():
    mistral, _ = NEXT["llava-next-mistral"]()
    gemma, processor = gemma3()
    for model in (mistral, gemma):
        assert "slide a window" in batch.refusal(model)
    configs = [(replace(BASE, method="hap"), True), (replace(BASE, method="none"), False)]
    picture = noise_image(1, (100, 170))
    together = run_together(gemma, processor, picture, QUESTION, configs, max_new_tokens=4)
    assert [r.timings["decode_batch"] for r in together] == [1, 1]
    assert [r.answer for r in together] == [run(gemma, processor, picture, QUESTION, c, 4, t).answer for c, t in configs]
    model, _ = llava_case()
    with hap.plant(model, sink=[(1, 0)]):
        assert "head-lab plan" in batch.refusal(model)
    assert batch.refusal(model) is None


def test_run_together_gives_the_results_of_run_one_by_one():
    """On the shipped model, whose answers end: the same answers, kept tokens, schedule and maps as `run`, the
    traced run too; with one new token, or one run, nothing is batched."""
    model, processor = hap.load_model(str(SHIPPED), device="cpu")
    image = SHIPPED.parent / "examples" / "scene_600004.png"
    prompt = "how many blue objects ?"
    configs = [(hap.HAPConfig(), True), (hap.HAPConfig(method="none"), False),
               (hap.HAPConfig(method="uniform"), False), (hap.HAPConfig(method="pdrop", retain=0.3), False)]
    together = run_together(model, processor, image, prompt, configs, max_new_tokens=12)
    for (config, trace), got in zip(configs, together):
        want = run(model, processor, image, prompt, config, 12, trace)
        assert got.timings["decode_batch"] == 4
        got_json, want_json = got.to_json(), want.to_json()
        for key in ("timings",):
            got_json.pop(key), want_json.pop(key)
        assert got_json == want_json, config.method
    assert {r.timings["decode_batch"] for r in run_together(model, processor, image, prompt, configs, 1)} == {1}
    assert run_together(model, processor, image, prompt, configs[:1])[0].timings["decode_batch"] == 1
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        run_together(model, processor, image, prompt, configs, 0)
