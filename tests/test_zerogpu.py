"""ZeroGPU through a stand-in `spaces` module: `/analyze`'s comparison and causal calls and `/sweep` go through its GPU
decorator, each asking for a duration that fits its work (app/zerogpu.py)."""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from functools import wraps

import pytest
import torch
from app_model import ROOT

import hap
from analysis.speed import random_vlm
from app import zerogpu
from app.pipeline import MAX_NEW_TOKENS
from app.settings import Settings, knob_defaults
from hap.runs.inputs import DEFAULT_LIMITS, load_image
from hap.runs.run import build_inputs

SHIPPED = "assets/tiny-llava"
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the square ?"


def stand_in_spaces(calls: list) -> types.ModuleType:
    """A `spaces` module whose `GPU(duration=f)` runs the function after asking `f` with the same arguments, and
    records (function name, seconds asked, seconds taken)."""

    def GPU(duration):  # noqa: N802 (spaces' name)
        def decorate(fn):
            @wraps(fn)
            def on_gpu(*args, **kwargs):
                asked = duration(*args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    calls.append((fn.__name__, asked, time.perf_counter() - t0))
            return on_gpu
        return decorate

    module = types.ModuleType("spaces")
    module.GPU = GPU
    return module


def fresh_copy(module: str, name: str) -> types.ModuleType:
    """A fresh copy of app/`module`.py imported as `name` (in the app package), with the modules as they are now."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "app" / f"{module}.py")
    copy = importlib.util.module_from_spec(spec)
    sys.modules[name] = copy
    spec.loader.exec_module(copy)
    return copy


@pytest.fixture(scope="module")
def on_zerogpu():
    """(a fresh copy of app/handler.py whose GPU parts are a fresh copy of app/pipeline.py imported with the stand-in
    `spaces` present, the recorded calls). The model is the app's one (`app.models.LOADED`)."""
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "spaces", stand_in_spaces(calls))
        mp.setitem(sys.modules, "app._pipeline_on_zerogpu", None)
        mp.setitem(sys.modules, "app._handler_on_zerogpu", None)
        mp.setitem(sys.modules, "app.pipeline", fresh_copy("pipeline", "app._pipeline_on_zerogpu"))
        handler = fresh_copy("handler", "app._handler_on_zerogpu")  # its `from .pipeline import` reads the copy
    yield handler, calls


def test_analysis_causal_and_sweep_ask_zerogpu_for_what_they_need(on_zerogpu):
    handler, calls = on_zerogpu
    app = handler.Handler(Settings(models=[SHIPPED]))
    image = {"path": str(SCENE), "orig_name": SCENE.name, "meta": {"_type": "gradio.FileData"}}
    out = app.analyze(image, PROMPT, SHIPPED, **knob_defaults(SHIPPED))
    assert out["summary"]["answer"] and out["summary"]["causal"]["mode"] == "ablation"
    swept = {k: v for k, v in knob_defaults(SHIPPED).items() if k not in handler.SWEPT}
    assert app.sweep(image, PROMPT, SHIPPED, **swept)["sweep"]["unpruned"]["answer"]
    assert [name for name, _, _ in calls] == ["gpu_compare", "gpu_causal", "gpu_sweep"]
    model = handler.LOADED.model
    inputs = {"gpu_compare": zerogpu.answers(3, 1, MAX_NEW_TOKENS, together=True),  # HAP_APP_SHARE=1
              "gpu_sweep": zerogpu.sweep_work(32, shared=True, together=True)}
    for name, asked, took in calls:
        assert isinstance(asked, int) and zerogpu.MIN_S <= asked and took < asked, (name, asked, took)
        if name in inputs:  # the prompt's own tokens: 144 visual, the text of the chat template
            assert asked == zerogpu.seconds(model, 144, text_tokens(handler), inputs[name])
    assert dict((n, a) for n, a, _ in calls)["gpu_sweep"] >= dict((n, a) for n, a, _ in calls)["gpu_compare"]
    assert inputs["gpu_sweep"].passes > inputs["gpu_compare"].passes  # the tiny model's both ask for the minimum


def text_tokens(handler) -> int:
    inputs, _, _ = build_inputs(handler.LOADED.processor, load_image(SCENE), PROMPT, DEFAULT_LIMITS)
    return inputs["input_ids"].shape[1] - 144


def test_durations_follow_the_model_size_and_the_work():
    """A 7B sweep (LLaVA-1.5-7B's shape, on the meta device) is no 60 s call; it asks for more than the analysis, and
    the tiny model's sweep for less; exact ablation asks for more than attribution."""
    big = random_vlm("llava-7b", None, torch.bfloat16, "meta")
    tiny, _ = hap.load_model(str(ROOT / SHIPPED), device="cpu")
    sweep, analysis = zerogpu.sweep_work(32), zerogpu.answers(4, 1, 32)
    assert 120 < zerogpu.seconds(big, 576, 40, sweep) < 600
    assert zerogpu.seconds(big, 576, 40, analysis) < zerogpu.seconds(big, 576, 40, sweep)
    assert zerogpu.seconds(tiny, 144, 12, sweep) < zerogpu.seconds(big, 576, 40, sweep) / 2
    assert zerogpu.seconds(big, 4096, 40, analysis) > zerogpu.seconds(big, 576, 40, analysis)  # quadratic attention

    def causal(model, setting: str) -> zerogpu.Work:
        return zerogpu.causal_work(zerogpu.Call(model, {"setting": setting, "cuts": [1, 3, 5]}, 144, 12))

    assert causal(tiny, "ablation").passes > causal(tiny, "attribution").passes > 3
    assert causal(tiny, "off") == zerogpu.Work(0, 0)
