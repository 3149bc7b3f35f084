"""Half precision (bfloat16, float16) on the CPU through every path: float32's answers on the shipped model, no NaN or
inf beyond float32's (pruned tokens are NaN on the grid by design) on random LLaVA / Qwen2-VL / Qwen2.5-VL, the causal
gradients accumulated in float32 and scaled clear of float16's underflow, and `/analyze` through the app
(docs/method.md §13)."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

import hap
from analysis.precision import CONFIGS, LEARNED, measure
from analysis.scenes import heldout_items
from hap import causal
from hap.pruners import pruner_for
from tiny_models import CASES, noise_image, tiny_llava, uniform_importance

HALF = (torch.bfloat16, torch.float16)
ROOT = Path(__file__).resolve().parent.parent
SHIPPED = "assets/tiny-llava"
QUESTIONS = ["what color is the circle ?", "is there a red square in the image ?", "how many ?"]


def nonfinite(x) -> tuple[int, int]:
    """(NaN count, inf count) over every float in `x`: tensors, arrays, floats, and the dicts, lists, tuples,
    dataclasses and plotly figures holding them."""
    if hasattr(x, "to_plotly_json"):
        x = x.to_plotly_json()
    if is_dataclass(x) and not isinstance(x, type):
        x = [getattr(x, f.name) for f in fields(x)]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        counts = [nonfinite(v) for v in x]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        x = x.detach().float().numpy()
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return int(np.isnan(x).sum()), int(np.isinf(x).sum())
    if isinstance(x, float):
        return int(math.isnan(x)), int(math.isinf(x))
    return 0, 0


def test_half_precision_gives_float32s_answers_on_the_shipped_model():
    """>= 95% of held-out questions of the learned kinds answered as in float32 (unpruned, HAP's defaults, the paper's
    HAP; left-padded batches), kept tokens close (the larger measurement: results/precision/precision.md)."""
    items = list(heldout_items(range(500000, 500003), len(LEARNED), LEARNED))
    assert len(items) == 21 and {q.qtype for _, q in items} == set(LEARNED)
    report = measure(SHIPPED, items, configs=CONFIGS)
    for dtype in ("bfloat16", "float16"):
        for name in CONFIGS:
            c = report[dtype][name]
            assert c["agreement"] >= 0.95, (dtype, name, c)
            assert name == "none" or c["jaccard"] >= 0.8, (dtype, name, c)
        assert report[dtype]["none"]["class_agreement"] >= 0.98 and report[dtype]["none"]["paq_max_diff"] < 0.05


def configs() -> list[hap.HAPConfig]:
    return [hap.HAPConfig.paper(retain=0.3), *(hap.HAPConfig(method=m, retain=0.3) for m in hap.METHODS)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_method_on_a_left_padded_batch_is_finite(case, dtype):
    """Every method (and the paper's HAP), traced, on a left-padded batch of three prompts: finite logits at every
    step, finite head statistics and cut weights; the causal passes finite, attribution's gate gradients summed in
    float32 (not rounded to the model's dtype)."""
    model, make = CASES[case]()
    model.to(dtype)
    inputs = make(QUESTIONS)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    ran = 0
    for config in configs():
        if pruner_for(config).static_heads:  # hawk: a uniform static head importance (the model has no file)
            config = replace(config, head_importance=uniform_importance(model))
        try:
            patch = hap.patch(model, config, trace=True, tail=0)  # tail: the question's rows run to the prompt's end
        except ValueError:  # refused by name for this architecture (visionzip without [CLS], pdrop on M-RoPE)
            continue
        batch = inputs if config.method != "autoprune" else make(QUESTIONS[:1])  # autoprune: one prompt at a time
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
        try:
            with torch.inference_mode():
                out = model.generate(**batch, max_new_tokens=3, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        finally:
            hap.unpatch(model)
        ran += 1
        assert nonfinite(list(out.logits)) == (0, 0), config.method
        state = patch.state
        if state is not None:
            stats = [[getattr(t, k) for k in ("sink_share", "dispersion", "visual_share", "paq")]
                     for t in state.tracer.layers.values()]
            assert nonfinite(stats) == (0, 0) and nonfinite([(c.paq, c.weights) for c in state.cuts]) == (0, 0)
    assert ran >= len(hap.METHODS) - 11  # at most visionzip, autoprune, vispruner, cdpruner, scope, holov, prunesid,
    #   hiprune ([CLS]), pdrop, sparsevlm, divprune (renumbered M-RoPE) and downsample (resizing not built) refused
    one = make(QUESTIONS[:1])
    one["pixel_values"] = one["pixel_values"].to(dtype)
    answer, _, ablation = causal.ablation(model, one)
    grad_answer, _, attribution, tokens = causal.gradients(model, one)
    assert answer == grad_answer and nonfinite([ablation, attribution, tokens]) == (0, 0)
    assert bool((attribution.to(dtype).float() != attribution).any())  # a float32 sum, not a half-precision one


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_run_follow_ups_and_the_public_causal_api_in_half_precision(dtype):
    """`hap.run` (defaults, the paper's HAP, a follow-up), `head_importance` both modes and `token_importance` on a
    half-precision LLaVA: the NaN of the result are float32's (the pruned tokens), no inf."""
    image = noise_image(2)
    reference, processor = tiny_llava(layers=6)
    models = {torch.float32: reference, dtype: tiny_llava(layers=6)[0].to(dtype)}
    history = [("what color is the circle ?", "red")]
    runs = {d: [hap.run(m, processor, image, "is there a square ?", c, max_new_tokens=3, history=h)
                for c in (hap.HAPConfig(), hap.HAPConfig.paper()) for h in ((), history)] for d, m in models.items()}
    for ref, half in zip(runs[torch.float32], runs[dtype]):
        assert nonfinite(half) == (nonfinite(ref)[0], 0) and half.history == ref.history
        assert [len(g.kept) for g in half.groups] == [len(g.kept) for g in ref.groups]
    m = models[dtype]
    found = [hap.head_importance(m, processor, image, "what color ?", mode=mode) for mode in causal.MODES]
    found.append(hap.token_importance(m, processor, image, "what color ?"))
    assert nonfinite(found) == (0, 0) and all(t.dtype == torch.float32 for t in found)


def test_float16_token_gradients_do_not_underflow_on_a_confident_answer():
    """A background question the shipped model answers with p ~ 1: its token gradients (1e-11 to 1e-6 in float32)
    fell below float16's range (most were 0, Spearman with float32 0.25); scaled by `gradient_scale` they rank as
    float32's do."""
    scene, question = next((s, q) for s, q in heldout_items(range(500000, 500001), len(LEARNED), LEARNED)
                           if q.qtype == "background")
    found = {}
    for dtype in (torch.float32, torch.float16):
        model, processor = hap.load_model(str(ROOT / SHIPPED), device="cpu", dtype=dtype)
        answer, log_p, _, found[dtype] = causal.gradients(model, causal.prepare(model, processor, scene.image,
                                                                                question.text))
        assert causal.gradient_scale(log_p) >= 2**16  # confident: the scale is at work
    assert bool((found[torch.float16] > 0).all())
    assert causal.spearman(found[torch.float32], found[torch.float16]) > 0.95


def test_the_gradient_scale_is_a_power_of_two_that_grows_with_confidence():
    assert causal.gradient_scale(math.log(0.01)) == 1.0 and causal.gradient_scale(math.log(0.5)) == 2.0
    assert causal.gradient_scale(math.log1p(-2**-10)) == 2**10 and causal.gradient_scale(0.0) == 2**24


@pytest.fixture(scope="module")
def analyzed():
    """`/analyze` outputs (the handler in-process, attribution) on the shipped model in float32 and each half dtype;
    a prompt other than the scene's own, so no ground truth (whose NaN depend on the kept tokens)."""
    from app.handler import Handler
    from app.models import LOADED
    from app.settings import Settings, knob_defaults

    scene = ROOT / "assets" / "examples" / "scene_600000.png"
    image = {"path": str(scene), "orig_name": scene.name, "meta": {"_type": "gradio.FileData"}}
    handler, saved = Handler(Settings(models=[SHIPPED])), (LOADED.model, LOADED.processor, LOADED.name)
    out = {}
    try:
        for dtype in (torch.float32, *HALF):
            LOADED.model, LOADED.processor = hap.load_model(str(ROOT / SHIPPED), device="cpu", dtype=dtype)
            LOADED.name = SHIPPED
            out[dtype] = handler.analyze(image, "what shape is the red object ?", SHIPPED, causal="attribution",
                                         **knob_defaults(SHIPPED))
    finally:
        LOADED.model, LOADED.processor, LOADED.name = saved
    return out


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_analyze_through_the_app_in_half_precision(analyzed, dtype):
    ref, half = analyzed[torch.float32], analyzed[dtype]
    assert half.keys() == ref.keys() and "causal" in half["summary"]
    for name in ref:
        assert nonfinite(half[name]) == (nonfinite(ref[name])[0], 0), name
    assert half["summary"]["answer"] == ref["summary"]["answer"]
