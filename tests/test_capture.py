"""The recomputed prompt rows equal the eager attention probabilities, for every layer."""

import pytest
import torch

import hap
from hap.patch.state import PruneState
from tiny_models import inputs_for, tiny_llava


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_recomputed_rows_equal_eager_attention(monkeypatch, kv_heads):
    model, processor = tiny_llava("eager", layers=3, kv_heads=kv_heads)
    inputs = inputs_for(processor, ["what color is the circle ?", "is there a red square ?"])
    captured = {}
    original = PruneState.record

    def spy(self, layer, rows, hidden, lookahead=False, logits=None):
        captured[layer] = rows.clone()
        return original(self, layer, rows, hidden, lookahead, logits)

    monkeypatch.setattr(PruneState, "record", spy)
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True).attentions
        with hap.patched(model, hap.HAPConfig(method="none"), trace=True):
            model(**inputs)
    assert sorted(captured) == [0, 1, 2]
    for layer, rows in captured.items():
        P = rows.shape[2]
        assert rows.shape == (2, 4, P, inputs["input_ids"].shape[1])
        diff = (rows - eager[layer][:, :, -P:, :].float()).abs().max().item()
        assert diff < 1e-5, f"layer {layer}: {diff}"
    assert captured[0].sum(-1).sub(1).abs().max() < 1e-5


def test_capture_keeps_sdpa_on_the_model():
    model, processor = tiny_llava("sdpa", layers=2)
    inputs = inputs_for(processor, ["what shape is the red object ?"])
    with hap.patched(model, hap.HAPConfig(retain=0.75, first_layers=1, groups=1)) as patch, torch.no_grad():
        model(**inputs)
    assert model.config.text_config._attn_implementation == "sdpa"
    assert patch.state.cuts[0].kept.shape == (1, 72)  # (144 + 72) / 2 layers = 0.75 * 144


def test_captured_rows_after_a_proportional_merge_equal_the_models_biased_attention(monkeypatch):
    """After a merge the later layers attend with log(size) added to the merged keys; the rows the pruner records
    must be those probabilities, as the eager model computes them on the pruned sequence."""
    model, processor = tiny_llava("eager", layers=3)
    inputs = inputs_for(processor, ["what color is the circle ?"])
    captured = {}
    original = PruneState.record

    def spy(self, layer, rows, hidden, lookahead=False, logits=None):
        if not lookahead:
            captured[layer] = rows.clone()
        return original(self, layer, rows, hidden, lookahead, logits)

    monkeypatch.setattr(PruneState, "record", spy)
    config = hap.HAPConfig(retain=0.4, first_layers=1, groups=2, merge="proportional", rows="prompt")
    with torch.no_grad(), hap.patched(model, config, trace=True) as patch:
        eager = model(**inputs, output_attentions=True).attentions
    assert patch.state.key_bias and patch.state.sizes.max() > 1
    for layer in (1, 2):
        rows = captured[layer]
        P = rows.shape[2]
        assert rows.shape[-1] == eager[layer].shape[-1] < inputs["input_ids"].shape[1]  # the pruned sequence
        diff = (rows - eager[layer][:, :, -P:, :].float()).abs().max().item()
        assert diff < 1e-5, f"layer {layer}: {diff}"
