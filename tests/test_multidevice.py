"""HAP on a model split over devices by accelerate's hooks (what `device_map=` dispatch installs).

On the CPU, two honest emulations of a split: `cpu_offload` (every weight on the meta device, streamed in by
an AlignDevicesHook per module) and `dispatch_model` with half the decoder "on disk" (weights memory-mapped
from an offload folder, loaded by the hooks at each forward). HAP's pre-hooks call the layers' own norms and
q/k projections, which then run through those hooks too. With a GPU, the decoder is also split between
cuda:0 and the CPU, so the pruner's index tensors cross a real device boundary.
"""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (requirements.txt pins it)")

from accelerate import cpu_offload, dispatch_model  # noqa: E402
from tiny_models import inputs_for, tiny_llava  # noqa: E402

import hap  # noqa: E402

LAYERS = 6
QUESTIONS, SEEDS = ["What is in the image?", "Is there a dog on the left?"], [0, 1]  # left-padded batch of 2
PRUNED = hap.HAPConfig(retain=0.3, first_layers=1)
FULL = hap.HAPConfig(retain=1.0, first_layers=1)


def fresh():
    model, processor = tiny_llava(layers=LAYERS)  # the same seed: identical weights every call
    return model, inputs_for(processor, QUESTIONS, SEEDS)


@torch.no_grad()
def run(model, inputs, config: hap.HAPConfig | None):
    """(prefill logits, greedy continuation, kept visual indices) of one patched forward and generate."""
    if config is None:
        return model(**inputs).logits, model.generate(**inputs, max_new_tokens=4, do_sample=False), None
    with hap.patched(model, config) as patch:
        logits = model(**inputs).logits
        kept = patch.state.kept_orig.clone()
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    return logits, tokens, kept


@pytest.fixture(scope="module")
def unsplit():
    model, inputs = fresh()
    return {name: run(model, inputs, cfg) for name, cfg in (("stock", None), ("full", FULL), ("pruned", PRUNED))}


def decoder_map(where_late: str, where_early: str = "cpu") -> dict:
    """Layers [0, 3) on `where_early`, [3, 6) and the final norm on `where_late`, the rest on the CPU."""
    lm = "model.language_model"
    device_map = {"model.vision_tower": "cpu", "model.multi_modal_projector": "cpu", f"{lm}.embed_tokens": "cpu",
                  f"{lm}.rotary_emb": "cpu", f"{lm}.norm": where_late, "lm_head": "cpu"}
    for i in range(LAYERS):
        device_map[f"{lm}.layers.{i}"] = where_early if i < LAYERS // 2 else where_late
    return device_map


def check(model, inputs, unsplit, atol: float = 1e-5):
    logits, tokens, _ = run(model, inputs, FULL)
    assert logits.shape == unsplit["stock"][0].shape  # retain=1.0 keeps every token...
    torch.testing.assert_close(logits.cpu(), unsplit["stock"][0], atol=atol, rtol=1e-4)  # ...and equals stock
    assert torch.equal(tokens.cpu(), unsplit["stock"][1])
    logits, tokens, kept = run(model, inputs, PRUNED)
    ref_logits, ref_tokens, ref_kept = unsplit["pruned"]
    assert kept.shape == (2, 11) and torch.equal(kept.cpu(), ref_kept)  # the same tokens survive (rounded down)
    assert logits.shape == ref_logits.shape and logits.shape[1] < unsplit["stock"][0].shape[1]
    torch.testing.assert_close(logits.cpu(), ref_logits, atol=atol, rtol=1e-4)
    assert torch.equal(tokens.cpu(), ref_tokens)


def test_unsplit_reference_is_meaningful(unsplit):
    torch.testing.assert_close(unsplit["full"][0], unsplit["stock"][0])
    assert not torch.equal(unsplit["pruned"][1], unsplit["stock"][1])  # pruning changes the answers here


def test_cpu_offload_streams_weights(unsplit):
    model, inputs = fresh()
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    check(model, inputs, unsplit)


def test_dispatch_half_the_decoder_on_disk(unsplit, tmp_path):
    model, inputs = fresh()
    dispatch_model(model, device_map=decoder_map("disk"), main_device=torch.device("cpu"), offload_dir=tmp_path)
    assert model.model.language_model.layers[4].mlp.up_proj.weight.device.type == "meta"
    check(model, inputs, unsplit)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: splits the decoder between cuda:0 and the CPU")
def test_dispatch_between_gpu_and_cpu(unsplit):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, inputs = fresh()
    dispatch_model(model, device_map=decoder_map("cpu", where_early=0), main_device=torch.device("cpu"))
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.device.type == "cuda"
    assert model.model.language_model.layers[5].self_attn.q_proj.weight.device.type == "cpu"
    check(model, inputs, unsplit, atol=1e-4)


def test_load_model_device_map(tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    model, processor = tiny_llava(layers=LAYERS)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    inputs = inputs_for(processor, QUESTIONS, SEEDS)
    seen = {}
    original = AutoModelForImageTextToText.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen["device_map"] = kwargs.get("device_map")
        if seen.get("fake_gpus"):
            kwargs.pop("device_map", None)  # no real GPUs to dispatch to
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", classmethod(spy))
    plain, _ = hap.load_model(str(tmp_path), device="cpu")
    assert seen["device_map"] is None
    split, _ = hap.load_model(str(tmp_path), device="cpu", device_map=decoder_map("cpu"))
    assert seen["device_map"] == decoder_map("cpu") and not split.training
    with torch.no_grad(), hap.patched(plain, PRUNED), hap.patched(split, PRUNED):
        torch.testing.assert_close(split(**inputs).logits, plain(**inputs).logits)

    # device="auto" with two visible GPUs asks from_pretrained for device_map="auto"
    seen["fake_gpus"] = True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # so "auto" still resolves to the CPU here
    hap.load_model(str(tmp_path))
    assert seen["device_map"] == "auto"
    hap.load_model(str(tmp_path), device="cpu")
    assert seen["device_map"] is None
