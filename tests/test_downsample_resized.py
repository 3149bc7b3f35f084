"""`downsample` on dynamic resolution (Qwen2-VL, Qwen3-VL): the image itself resized before the processor so that it
emits the budget's count of visual tokens, the decoder running every one of them, and the result reported against
the original image's unpruned run (docs/method.md §7). The expectations are computed here from the processor and
the pixels, not from `hap.run`'s path."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from PIL import Image
from tiny_models import noise_image, qwen_vl_folder
from tiny_zoo_recent import qwen3_vl

import hap
from hap.planning.flops import prefill_flops
from hap.planning.budget import plan
from hap.runs.inputs import DEFAULT_LIMITS
from hap.runs.features import FeatureCache, reusing_features
from hap.patch.decoder import decoder_shape
from hap.patch.processors import processor_options
from hap.pruners.downsample import resized_size
from hap.runs.run import chat_prompt

PROMPT = "what is in the picture ?"
IMAGE = noise_image(3, (200, 150))  # width x height
TALL = noise_image(4, (112, 252))  # 9 x 4 = 36 tokens: a square count that is no square grid
LOW = {"min_pixels": 28 * 28, "max_pixels": 336 * 336}  # the folder pins min = max pixels: the run frees them


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    torch.manual_seed(0)
    folder = qwen_vl_folder(tmp_path_factory.mktemp("qwen-ds") / "q", layers=2, side=112)
    return hap.load_model(str(folder), device="cpu")


def expected(model, processor, options: dict, retain: float, settings: tuple[int, int, int, int], image=IMAGE):
    """(the unpruned result, the budget's count, the resized image, its stock processor output) by hand."""
    full = hap.run(model, processor, image, PROMPT, hap.HAPConfig(method="none"), 3, options=options)
    shape = decoder_shape(model)
    schedule = plan(hap.HAPConfig(method="downsample", retain=retain), shape, full.num_visual, full.text_tokens)
    k = (schedule.planned or schedule.kept)[0]
    height, width = resized_size(image.height, image.width, k, *settings)
    small = image.resize((width, height), Image.Resampling.BICUBIC)
    with processor_options(model, processor, options):
        inputs = processor(images=small, text=chat_prompt(processor, PROMPT), return_tensors="pt")
    return full, k, small, inputs


def check_counts_and_indices(model, result, full, k, inputs, merge: int):
    """The decoder ran the processor's count on the resized image, within one token row of the budget; each of its
    tokens is reported at the original token under its top-left corner; retain and FLOPs count what ran."""
    _, h, w = (int(v) // m for v, m in zip(inputs["image_grid_thw"][0], (1, merge, merge)))
    n = h * w
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == n
    assert k - w < n <= k  # within one row (w tokens) of the budget
    assert result.visual_per_layer == [n] * model.config.text_config.num_hidden_layers
    assert result.num_visual == full.num_visual and result.text_tokens == full.text_tokens
    assert result.visual_grid == full.visual_grid and result.layout == full.layout  # the original image's, drawn
    rows, cols = full.visual_grid
    corner = [int(Fraction(i, h) * rows) * cols + int(Fraction(j, w) * cols) for i in range(h) for j in range(w)]
    assert len(result.groups) == 1 and result.groups[0].kept == corner and result.groups[0].layers[0] == 0
    assert len(set(corner)) == n and all(0 <= v < full.num_visual for v in corner)
    L = model.config.text_config.num_hidden_layers
    shape = decoder_shape(model)
    ratio = prefill_flops([n] * L, full.text_tokens, shape) / prefill_flops([full.num_visual] * L, full.text_tokens,
                                                                             shape)
    assert result.flops_ratio == pytest.approx(ratio) and result.retain == pytest.approx(n / full.num_visual)
    present = ~result.maps.layer[0].isnan()  # the traced maps lie on the original grid, at the tokens that ran
    assert present.nonzero().flatten().tolist() == sorted(corner)


@pytest.mark.parametrize("image", [IMAGE, TALL], ids=["7x5", "9x4"])
def test_qwen2_vl_resizes_the_image_to_the_budget_and_answers_as_the_stock_model_on_it(qwen, image):
    model, processor = qwen
    config = hap.HAPConfig(method="downsample", retain=0.3)
    result = hap.run(model, processor, image, PROMPT, config, 3, options=LOW)
    full, k, small, inputs = expected(model, processor, LOW, 0.3, (14, 2, 28 * 28, 336 * 336), image)
    check_counts_and_indices(model, result, full, k, inputs, 2)
    assert any(f"resized the image from {image.width}x{image.height}" in note for note in result.notes)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, num_beams=1)
    assert result.answer == processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_run_together_and_the_feature_cache_take_the_resized_image_apart(qwen):
    """Beside other methods one input's runs share, downsample's smaller image is its own: the same answer and kept
    tokens as alone, and the feature cache computes its features (never the original image's)."""
    model, processor = qwen
    configs = [hap.HAPConfig(method=m, retain=0.3, groups=1, first_layers=0) for m in ("none", "downsample", "hap")]
    alone = hap.run(model, processor, IMAGE, PROMPT, configs[1], 3, options=LOW)
    cache = FeatureCache()
    with reusing_features(model, cache):
        together = hap.run_together(model, processor, IMAGE, PROMPT, [(c, False) for c in configs], 3, options=LOW)
    assert cache.misses == 2 and cache.hits == 1  # the original image's features, once for none and hap
    assert together[1].answer == alone.answer and together[1].groups[0].kept == alone.groups[0].kept
    assert together[1].flops_ratio == alone.flops_ratio


def test_what_cannot_resize_is_refused_by_name(qwen):
    """The checkpoint's pixel floor (min = max pixels) leaves nothing to shrink: a ValueError naming min_pixels, and
    the keeps view lists it refused; a patch alone cannot resize an image; the sweep has it out of reach below 1.0."""
    from hap.runs.sweep import sweep

    from hap.runs.keeps import keeps

    model, processor = qwen
    config = hap.HAPConfig(method="downsample", retain=0.3)
    with pytest.raises(ValueError, match="min_pixels=12544"):
        hap.run(model, processor, IMAGE, PROMPT, config, 2)
    found = keeps(model, processor, IMAGE, PROMPT, config, 2, methods=("downsample", "fastv"))
    assert "min_pixels" in found.refused["downsample"] and "fastv" in found.methods
    with pytest.raises(ValueError, match="resizes the image before the processor: run it through hap.run"):
        with hap.patched(model, config):
            pass
    out = sweep(model, processor, IMAGE, PROMPT, hap.HAPConfig(first_layers=0, groups=1), 2, DEFAULT_LIMITS,
                shared=True)
    row = out["methods"]["downsample"]
    assert "downsample" not in out["refused"] and out["retain"][0] == 1.0
    assert row["answers"][0] == out["unpruned"]["answer"] and row["answers"][1:] == [None] * (len(out["retain"]) - 1)


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
def test_the_sweep_runs_downsample_on_the_image_resized_for_each_budget(qwen, shared):
    """In the sweep, downsample's runs take the image resized for their budget, batched beside the runs of the
    original image (shorter prompts): each answer is `hap.run`'s, each probability the unpruned answer's forced on
    the resized image's own prefill."""
    from hap.runs.sweep import answer_probability, short_answer, sweep

    from hap.runs.run import for_config, prepare

    model, processor = qwen
    config = hap.HAPConfig(first_layers=0, groups=1)
    with processor_options(model, processor, LOW), reusing_features(model, FeatureCache() if shared else None):
        out = sweep(model, processor, IMAGE, PROMPT, config, 3, DEFAULT_LIMITS, shared=shared)
        assert "downsample" not in out["refused"]
        reference = processor.tokenizer(out["unpruned"]["answer"], add_special_tokens=False).input_ids
        p = prepare(model, processor, IMAGE, PROMPT, 3, DEFAULT_LIMITS, ())
        for i in (1, 3):
            cfg = hap.HAPConfig(method="downsample", first_layers=0, groups=1, retain=out["retain"][i])
            q = for_config(model, processor, p, cfg)
            assert q.prompt_len < p.prompt_len  # the smaller image's prompt
            alone = hap.run(model, processor, IMAGE, PROMPT, cfg, 3, trace=False)
            assert out["methods"]["downsample"]["answers"][i] == short_answer(alone.answer)
            assert out["methods"]["downsample"]["answer_prob"][i] == pytest.approx(
                answer_probability(model, q, cfg, reference), rel=1e-4)


def test_qwen3_vl_resizes_to_the_budget_too():
    model, processor = qwen3_vl(layers=2)
    options = {"min_pixels": 32 * 32}
    result = hap.run(model, processor, IMAGE, PROMPT, hap.HAPConfig(method="downsample", retain=0.4), 2,
                     options=options)
    full, k, _, inputs = expected(model, processor, options, 0.4, (16, 2, 32 * 32, 256 * 256))
    check_counts_and_indices(model, result, full, k, inputs, 2)
