"""hap.runs.features: one vision pass per image. With the cache the model's outputs are exactly the uncached ones, the
tower runs once per image, never hands one image's, dtype's or model's features to another, and the model is
stock after the block."""

from __future__ import annotations

import pytest
import torch

import hap
from hap.runs.features import FeatureCache, detached, fingerprint, reusing_features
from tiny_models import CASES, noise_image, tiny_llava


def tower_calls(model) -> list[int]:
    """A counter of the vision tower's forwards (a hook, removed by the caller's model going away)."""
    calls = []
    tower = getattr(model.model, "vision_tower", None) or model.model.visual
    tower.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_cached_features_give_exactly_the_stock_logits_and_run_the_tower_once(case):
    model, make = CASES[case]()
    inputs = make(["what color is it ?"], [0])
    with torch.inference_mode():
        stock = model(**inputs).logits
    calls = tower_calls(model)
    cache = FeatureCache()
    with reusing_features(model, cache), torch.inference_mode():
        first = model(**inputs).logits
        second = model(**inputs).logits
        with hap.patched(model, hap.HAPConfig(method="hap", retain=0.5, first_layers=1, groups=1)):
            pruned = model(**inputs).logits
    assert torch.equal(first, stock) and torch.equal(second, stock)
    assert len(calls) == 1 and (cache.hits, cache.misses) == (2, 1)
    with hap.patched(model, hap.HAPConfig(method="hap", retain=0.5, first_layers=1, groups=1)), torch.inference_mode():
        assert torch.equal(model(**inputs).logits, pruned)  # the pruned run reads the same features


def test_generate_and_the_gradient_path_use_the_cache():
    model, processor = tiny_llava()
    image = noise_image(3)
    calls = tower_calls(model)
    plain = hap.run(model, processor, image, "what color ?", hap.HAPConfig(method="none"), max_new_tokens=3)
    with reusing_features(model, FeatureCache()) as cache:
        runs = [hap.run(model, processor, image, "what color ?", hap.HAPConfig(method=m), max_new_tokens=3)
                for m in ("none", "hap", "uniform")]
        found = hap.token_importance(model, processor, image, "what color ?")
    assert runs[0].answer == plain.answer and len(calls) == 2  # one pass without the cache, one with it
    assert cache.misses == 1 and cache.hits == 3
    assert torch.isfinite(torch.as_tensor(found)).all()  # autograd through cached features works


def test_different_images_dtypes_and_models_never_share_features():
    model, make = CASES["llava"]()
    other, _ = CASES["llava"](layers=2)
    a, b = make(["q"], [0]), make(["q"], [1])
    cache = FeatureCache(size=8)
    with torch.inference_mode():
        for m, inputs in ((model, a), (model, b), (other, a)):
            with reusing_features(m, cache):
                m(**inputs)
        half = {**a, "pixel_values": a["pixel_values"].to(torch.bfloat16)}
        model.to(torch.bfloat16)
        with reusing_features(model, cache):
            model(**half)
    assert cache.misses == 4 and cache.hits == 0


def test_the_cache_keeps_its_size_most_recent_first():
    cache = FeatureCache(size=2)
    for key in ("a", "b", "a", "c"):
        cache.get(key, lambda: torch.zeros(1))
    assert list(cache.entries) == ["a", "c"] and (cache.hits, cache.misses) == (1, 3)
    with pytest.raises(ValueError, match="size=0 must be an integer >= 1"):
        FeatureCache(size=0)


def test_a_copy_is_handed_out_and_keys_follow_the_bytes():
    cache = FeatureCache()
    got = cache.get("k", lambda: {"x": torch.ones(2)})
    got["x"].add_(1)
    assert torch.equal(cache.get("k", lambda: None)["x"], torch.ones(2))
    t = torch.arange(4.0)
    assert fingerprint(t) == fingerprint(t.clone()) != fingerprint(t + 1e-6)
    assert fingerprint(t) != fingerprint(t.double())
    with torch.inference_mode():
        inner = torch.ones(2)
    assert not detached(inner).is_inference()


def test_visionzip_runs_the_tower_itself_and_the_model_is_stock_after_the_block():
    model, make = CASES["llava"]()
    inputs = make(["what ?"], [0])
    config = hap.HAPConfig(method="visionzip", retain=0.2)
    with hap.patched(model, config), torch.inference_mode():
        stock = model(**inputs).logits
    calls = tower_calls(model)
    with reusing_features(model, FeatureCache()) as cache, torch.inference_mode():
        model(**inputs)
        with hap.patched(model, config):
            assert torch.equal(model(**inputs).logits, stock)
    assert len(calls) == 2 and cache.misses == 1  # the VisionZip run read the tower's [CLS] cues itself
    assert "get_image_features" not in vars(model.model)
    with pytest.raises(RuntimeError, match="boom"), reusing_features(model, FeatureCache()):
        raise RuntimeError("boom")
    assert "get_image_features" not in vars(model.model)
    with reusing_features(model, FeatureCache()), pytest.raises(RuntimeError, match="do not nest"):
        with reusing_features(model, FeatureCache()):
            pass
