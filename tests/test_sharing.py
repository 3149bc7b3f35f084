"""HAP_APP_SHARE: the runs of a request share the image's vision pass (per client), the method is timed on its traced
run, the sweep shares what it can; the shared path gives the answers, kept tokens, figures and sweep of the unshared
one. And the causal section's `auto` on a CPU keeps to its budget, saying what it chose."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from app_model import ROOT

from app import causal as causal_section
from app import handler
from app.models import LOADED
from app.pipeline import staged
from app.settings import Settings, knob_defaults
from hap import utility, views
from hap.runs.features import FeatureCache
from hap.patch.decoder import decoder_shape
from tiny_models import tiny_llava

SHIPPED = "assets/tiny-llava"
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the square ?"
IMAGE = {"path": str(SCENE), "orig_name": SCENE.name, "meta": {"_type": "gradio.FileData"}}


def test_the_share_setting_reads_0_or_1_and_defaults_to_on():
    assert Settings.from_env({}).share and Settings.from_env({"HAP_APP_SHARE": "1"}).share
    assert not Settings.from_env({"HAP_APP_SHARE": "0"}).share
    with pytest.raises(ValueError, match="HAP_APP_SHARE='maybe' must be 0 or 1"):
        Settings.from_env({"HAP_APP_SHARE": "maybe"})


def _analyze(share: bool, session: str) -> dict:
    server = handler.Handler(Settings(models=[SHIPPED], share=share))
    return server.analyze(IMAGE, PROMPT, SHIPPED, causal="ablation", request=SimpleNamespace(session_hash=session),
                          **knob_defaults(SHIPPED))


@pytest.mark.slow
def test_the_shared_analysis_is_the_unshared_one_with_one_vision_pass_per_client():
    LOADED.features.clear()  # what earlier tests' clients left
    plain = _analyze(False, "a")
    assert LOADED.features == {}  # nothing kept where the sharing is off
    shared = _analyze(True, "a")
    cache = LOADED.features["a"]
    assert cache.misses == 1 and cache.hits >= 3  # unpruned, method, uniform, the causal and utility passes
    p, s = plain["summary"], shared["summary"]
    for key in ("answer", "retained_tokens", "flops_ratio", "head_class", "groups", "paq"):
        assert s[key] == p[key], key
    assert {k: v["answer"] for k, v in s["runs"].items()} == {k: v["answer"] for k, v in p["runs"].items()}
    assert (p["runs"]["pruned"]["traced"], s["runs"]["pruned"]["traced"]) == (False, False)  # timed untraced
    assert (p["timings"]["decode_batch"], s["timings"]["decode_batch"]) == (1, 3)  # the answers decoded as one batch
    assert np.allclose(s["causal"]["head_importance"], p["causal"]["head_importance"], atol=1e-5)
    assert s["head_utility"]["values"] == p["head_utility"]["values"]
    for view in views.VIEWS:  # every figure of the page, as plotly draws it
        assert shared[view.name].to_json() == plain[view.name].to_json(), view.name
    _analyze(True, "b")  # another client: its own vision pass
    assert LOADED.features["b"].misses == 1 and LOADED.features["a"].misses == 1
    _analyze(True, "a")  # a follow-up of client a: read, not encoded
    assert LOADED.features["a"].misses == 1


def test_auto_on_a_cpu_keeps_head_utility_within_its_budget_and_says_why():
    model, _ = tiny_llava(layers=24)
    shape, heads = decoder_shape(model), model.config.text_config.num_attention_heads

    def cost(layers: list[int]) -> float:
        return utility.cost(shape, 729, 20, heads, layers=layers)

    left = causal_section.CPU_PREFILLS - causal_section.ATTRIBUTION_PREFILLS
    kept, why = causal_section.cpu_layers(model, [1, 8, 15], 729, 20)
    assert cost(kept) <= left < cost([1, 8, 15])  # what fits, and not everything does
    assert kept == sorted(kept) and "Set `causal` to attribution" in why and "layers 1, 8, 15" in why
    everything, nothing_said = causal_section.cpu_layers(model, [22], 729, 20, budget=100.0)
    assert everything == [22] and nothing_said == ""
    none_fit, said = causal_section.cpu_layers(model, [1], 729, 20, budget=3.0)
    assert none_fit == [] and "head utility at no layer" in said


def test_the_progress_bar_says_when_the_image_is_encoded_and_when_it_is_reused():
    said = []
    cache = FeatureCache(2)
    cache.get(("earlier request",), lambda: 0)  # counts before this request do not count
    stage = staged(lambda fraction, desc: said.append(desc), cache)
    stage(0.1, "first run")
    cache.get(("this image",), lambda: 1)
    stage(0.5, "second run")
    assert said == ["first run · one vision pass for all runs", "second run · image features reused"]
    plain = staged(lambda fraction, desc: said.append(desc), None)
    plain(0.1, "run")
    assert said[-1] == "run"
