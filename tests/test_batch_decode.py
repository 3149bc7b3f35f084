"""Answers decoded as one batch (`hap.patch.batch`, `hap.runs.run.run_together`, the shared sweep): each run's greedy tokens
and logits are those it gets decoded alone, on every family whose layers allow it, for methods that keep positions,
renumber them, merge with a bias, recycle, or cut before layer 0; the rest decode alone, saying why."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import llava_case, llava_qwen2_case, noise_image, qwen_vl_case
from tiny_zoo import ZOO as NEXT
from tiny_zoo import SIZES
from tiny_zoo import inputs as zoo_inputs
from tiny_zoo import picture
from tiny_zoo_more import ZOO as MORE
from tiny_zoo_recent import gemma3, qwen3_vl
from transformers.cache_utils import DynamicCache

import hap
from hap.patch import apply, batch, refusal, remove, visual_tokens
from hap.runs.run import run, run_batch, run_together

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


UNEQUAL = {  # family -> (builder, two (height, width) image sizes of different visual-token counts)
    "llava-next": (NEXT["llava-next"], ((112, 112), (112, 224))),
    "llava-onevision": (NEXT["llava-onevision"], ((336, 280), (112, 112))),
    "internvl": (MORE["internvl"], ((112, 112), (112, 336))),
    "idefics3": (MORE["idefics3"], ((112, 112), (112, 224))),
    "qwen3-vl": (qwen3_vl, ((100, 170), (200, 200))),
}
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


def method_jobs(model, inputs: dict, methods: list[str]) -> list[tuple[dict, hap.HAPConfig]]:
    """(inputs, config) of each method of `methods` that `model` does not refuse."""
    return [(inputs, c) for c in (replace(BASE, method=m) for m in methods) if refusal(model, c) is None]


def batched_error(model, jobs: list[tuple[dict, hap.HAPConfig]], steps: int = STEPS) -> float:
    """Max |logit difference| over the continued steps of `jobs` (a batch-1 input and a config each) decoded together
    and alone: each job prefills alone, then `batch.decode` continues them as one batch; the greedy tokens must be
    the same."""
    alone = [_alone(model, inputs, config, steps) for inputs, config in jobs]
    runs = []
    for inputs, config in jobs:
        patch = apply(model, config)
        try:
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
        finally:
            remove(model)
        deltas = getattr(model.model, "rope_deltas", None)
        runs.append(batch.Prefilled(patch, out.cache, out.sequences, None if deltas is None else deltas.clone()))
    with torch.inference_mode():
        together = batch.decode(model, runs, steps - 1, return_dict_in_generate=True, output_logits=True)
    T, error = max(run.prompt_len for run in runs), 0.0
    for i, one in enumerate(alone):
        assert torch.equal(together.sequences[i, T:], one.sequences[0, runs[i].prompt_len:]), jobs[i][1].method
        for step, logits in enumerate(one.logits[1:]):
            error = max(error, float((together.logits[step][i] - logits[0]).abs().max()))
    return error


@pytest.mark.parametrize("family", FAMILIES)
def test_answers_decoded_together_are_those_decoded_alone(family):
    model, make = FAMILIES[family](layers=6)
    assert batch.refusal(model) is None
    jobs = method_jobs(model, make([QUESTION]), METHODS)
    methods = [config.method for _, config in jobs]
    assert batched_error(model, jobs) < 1e-5
    assert {"none", "hap", "uniform", "fastv", "random"} <= set(methods)  # keep positions (and merge), or cut at 0
    if family in ("llava", "llava-next", "internvl"):  # renumbered positions, recycled tokens
        assert {"pdrop", "sparsevlm"} <= set(methods)


def test_the_batch_holds_each_run_s_cache_left_padded_with_its_merge_bias():
    def run_of(lengths: list[int], bias: torch.Tensor | None = None) -> batch.Prefilled:
        cache = DynamicCache([(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)) for n in lengths])
        state = None if bias is None else type("State", (), {"bias_at": lambda self, layer: bias if layer else None,
                                                             "segment_index": {}})()
        return batch.Prefilled(type("Patch", (), {"state": state})(), cache, torch.zeros(1, 11, dtype=torch.long))

    short, full = run_of([9, 5], torch.tensor([[0.5, 0.0, -1.0, 0.0, 2.0]])), run_of([10, 10])
    merged, masks = batch.merge_caches([short, full], prompt_len=10)
    assert [layer.keys.shape[2] for layer in merged.layers] == [10, 10]  # layer 0 as long as the prompt
    low = torch.finfo(torch.float32).min
    assert masks[0][0].tolist() == [low] + [0.0] * 9 and masks[0][1].tolist() == [0.0] * 10
    assert masks[1][0].tolist() == [low] * 5 + [0.5, 0.0, -1.0, 0.0, 2.0]
    assert torch.equal(merged.layers[1].keys[0, :, 5:], short.cache.layers[1].keys[0])
    assert not merged.layers[1].keys[0, :, :5].any()
    assert torch.equal(merged.layers[1].values[1], full.cache.layers[1].values[0])


def test_layers_that_slide_a_window_and_planted_heads_decode_alone_saying_why():
    mistral, _ = NEXT["llava-next-mistral"]()
    gemma, processor = gemma3()
    for model in (mistral, gemma):
        assert "slide a window" in batch.refusal(model)
    configs = [(replace(BASE, method="hap"), True), (replace(BASE, method="none"), False)]
    picture = noise_image(1, (100, 170))
    together = run_together(gemma, processor, picture, QUESTION, configs, max_new_tokens=4)
    assert [r.timings["decode_batch"] for r in together] == [1, 1]
    alone = [run(gemma, processor, picture, QUESTION, config, 4, trace).answer for config, trace in configs]
    assert [r.answer for r in together] == alone
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


@pytest.mark.parametrize("planted", [False, True])
def test_a_replayed_run_is_timed_untraced_and_its_replay_is_the_traced_run(planted):
    """`run_together(..., replay=0)`: the run is untraced (no maps) and decoded with the others; its traced replay,
    appended last and not decoded, holds the maps, kept tokens and answer of `run` traced; a head-lab plan (each run
    decoded alone) too."""
    model, processor = hap.load_model(str(SHIPPED), device="cpu")
    image, prompt = SHIPPED.parent / "examples" / "scene_600000.png", QUESTION
    configs = [(hap.HAPConfig(), False), (hap.HAPConfig(method="none"), False)]
    with hap.plant(model, [(0, 1)], []) if planted else nullcontext():
        timed, other, replay = run_together(model, processor, image, prompt, configs, max_new_tokens=8, replay=0)
        want = run(model, processor, image, prompt, configs[0][0], 8, trace=True)
    assert timed.maps.head.isnan().all() and not replay.maps.head.isnan().all()
    assert (timed.timings["decode_batch"], replay.timings["decode_batch"]) == ((1, 1) if planted else (2, 0))
    got_json, want_json = replay.to_json(), want.to_json()
    got_json.pop("timings"), want_json.pop("timings")
    assert got_json == want_json and timed.answer == replay.answer == want.answer


@pytest.mark.parametrize("family", UNEQUAL)
def test_images_of_different_sizes_decode_together_each_with_its_own_budget(family):
    """Two images whose visual-token counts differ (prompts of different lengths, left-padded in the batch), each
    pruned to its own count's budget, plus a second method on the first and PyramidDrop's renumbered positions on the
    second where the family takes it: the tokens and logits of each alone."""
    build, sizes = UNEQUAL[family]
    model, processor = build(layers=6)
    questions = [QUESTION, "is there a red circle in the picture ?"]
    jobs = [(zoo_inputs(processor, [q], [size], [seed]), replace(BASE, method="hap"))
            for seed, (q, size) in enumerate(zip(questions, sizes))]
    counts = [int(visual_tokens(model, inputs).sum()) for inputs, _ in jobs]
    lengths = [inputs["input_ids"].shape[1] for inputs, _ in jobs]
    assert counts[0] != counts[1] and lengths[0] != lengths[1]
    extra = [(jobs[0][0], replace(BASE, method="fastv")), *method_jobs(model, jobs[1][0], ["pdrop"])]  # renumbered
    assert batched_error(model, [*jobs, *extra]) < 1e-5


def test_run_batch_gives_each_image_the_result_of_run_alone():
    model, processor = NEXT["llava-next"]()
    images = [picture(size, seed) for seed, size in enumerate(UNEQUAL["llava-next"][1])]
    prompts = [QUESTION, "is there a red circle in the picture ?"]
    config = replace(BASE, method="hap")
    results = run_batch(model, processor, images, prompts, config, max_new_tokens=5, trace=True)
    assert results[0].num_visual != results[1].num_visual
    for image, prompt, got in zip(images, prompts, results):
        want = run(model, processor, image, prompt, config, 5, trace=True)
        assert got.timings["decode_batch"] == 2 and got.retained_tokens <= 0.4 * got.num_visual + 1e-6
        got_json, want_json = got.to_json(), want.to_json()
        got_json.pop("timings"), want_json.pop("timings")
        assert got_json == want_json
    with pytest.raises(ValueError, match="one prompt per image: got 2 images and 1 prompts"):
        run_batch(model, processor, images, prompts[:1], config)
    with pytest.raises(ValueError, match="hap.run_batch"):
        batch_input = zoo_inputs(processor, prompts, list(UNEQUAL["llava-next"][1]))
        with hap.patched(model, config), torch.no_grad():
            model(**batch_input)


def test_a_growing_cache_layer_writes_in_place_and_grows_past_its_room():
    """`batch.GrowingLayer`: the keys and values `DynamicLayer` would hold after each update, written into the
    buffer's free slots while there is room (no copy of the layer), concatenated once it is full."""
    from transformers.cache_utils import DynamicLayer

    from hap.patch.batch import GrowingLayer

    torch.manual_seed(0)
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    grown = GrowingLayer(torch.cat([keys, torch.zeros(2, 3, 2, 4)], 2), torch.cat([values, torch.zeros(2, 3, 2, 4)], 2),
                         5)
    plain = DynamicLayer()
    plain.update(keys, values)
    buffer = grown.key_buffer
    for step in range(4):
        new_keys, new_values = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        got, want = grown.update(new_keys, new_values), plain.update(new_keys, new_values)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and grown.get_seq_length() == 6 + step
        assert (grown.key_buffer is buffer) == (step < 2)  # room for two tokens, then a grown buffer
