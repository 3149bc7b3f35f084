"""The instance patch: equivalence with the stock model, real pruning of the cache, batches, unpatch."""

import pytest
import torch

import hap
from tiny_models import inputs_for, tiny_llava

QUESTIONS = ["what color is the circle ?", "is there a big red square in the image ?"]


def greedy(model, inputs, steps):
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, 1), out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "config",
    [hap.HAPConfig(method="none"), hap.HAPConfig(retain=1.0, groups=2), hap.HAPConfig(retain=1.0, first_layers=0)],
    ids=["none", "retain1", "retain1-cut-before-layer0"],
)
def test_nothing_pruned_reproduces_the_stock_model(attn, config):
    model, processor = tiny_llava(attn)
    inputs = inputs_for(processor, QUESTIONS[:1])
    with torch.no_grad():
        ref_logits = model(**inputs).logits
    ref_tokens, ref_steps, _ = greedy(model, inputs, 8)
    with hap.patched(model, config, trace=True):
        with torch.no_grad():
            logits = model(**inputs).logits
        tokens, steps, _ = greedy(model, inputs, 8)
    assert (logits - ref_logits).abs().max().item() < 1e-5
    assert (steps - ref_steps).abs().max().item() < 1e-5
    assert torch.equal(tokens, ref_tokens)


def test_unpatch_restores_stock_behaviour():
    model, processor = tiny_llava()
    inputs = inputs_for(processor, QUESTIONS[:1])
    with torch.no_grad():
        ref = model(**inputs).logits[:, -1]
        hap.patch(model, hap.HAPConfig(retain=0.1, first_layers=0, groups=2))
        pruned = model(**inputs).logits[:, -1]
        hap.unpatch(model)
        back = model(**inputs).logits[:, -1]
    assert not hasattr(model, "_hap")
    assert (pruned - ref).abs().max() > 1e-4  # pruning really changed the computation
    assert torch.equal(back, ref)


@pytest.mark.parametrize("method", ["hap", "uniform", "pdrop", "random", "fastv"])
def test_pruned_cache_lengths_and_generation(method):
    model, processor = tiny_llava(layers=6)
    inputs = inputs_for(processor, QUESTIONS[:1])
    T = inputs["input_ids"].shape[1]
    text = T - 144
    first = 1 if method == "fastv" else 0  # fastv's single cut needs a layer behind it
    config = hap.HAPConfig(method=method, retain=0.056 if method != "fastv" else 0.2, first_layers=first)
    with hap.patched(model, config) as patch:
        _, _, out = greedy(model, inputs, 16)
    schedule = patch.state.schedule
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    generated_in_cache = 15  # the 16th token is produced but never fed back
    for layer, visual in enumerate(schedule.visual_per_layer):
        assert cache.get_seq_length(layer) == text + visual + generated_in_cache
    assert out.sequences.shape[1] == T + 16
    target = config.retain
    assert abs(schedule.retain - target) <= 0.5 / 144 + 1e-9  # rounding only
    assert len(patch.state.cuts) == len(schedule.cuts)
    if method == "hap":
        assert schedule.cuts == [0, 2, 4] and schedule.kept[0] > schedule.kept[1] > schedule.kept[2]


def test_cached_decoding_equals_a_fresh_pruned_forward():
    """Positions, masks and the shortened cache stay right while decoding: each cached step equals a
    no-cache forward over prompt + generated tokens with the same kept tokens (the seeded random
    policy keeps the same tokens whatever the text)."""
    model, processor = tiny_llava(layers=4)
    inputs = inputs_for(processor, QUESTIONS[:1])
    config = hap.HAPConfig(method="random", retain=0.3, first_layers=1, groups=2)
    with hap.patched(model, config):
        tokens, steps, _ = greedy(model, inputs, 6)
        T = inputs["input_ids"].shape[1]
        for i in range(1, 6):
            ids = tokens[:, : T + i]
            with torch.no_grad():
                fresh = model(
                    input_ids=ids, pixel_values=inputs["pixel_values"], use_cache=False,
                    attention_mask=torch.ones_like(ids),
                ).logits[:, -1]
            assert (fresh - steps[:, i]).abs().max().item() < 1e-4


@pytest.mark.parametrize("method, first", [("hap", 1), ("hap", 0), ("pdrop", 1), ("fastv", 1)])
def test_batch_selection_equals_each_sample_alone(method, first):
    model, processor = tiny_llava(layers=4)
    config = hap.HAPConfig(method=method, retain=0.3, first_layers=first, groups=2 if method != "fastv" else 1)
    batch = inputs_for(processor, QUESTIONS, seeds=[0, 1])
    assert (batch["attention_mask"] == 0).any(), "the prompts must differ in length to test left padding"
    with hap.patched(model, config) as patch:
        tokens, _, _ = greedy(model, batch, 4)
        kept_batch = [c.kept for c in patch.state.cuts]
        for b in range(2):
            alone = inputs_for(processor, [QUESTIONS[b]], seeds=[b])
            alone_tokens, _, _ = greedy(model, alone, 4)
            for cut, kept in zip(patch.state.cuts, kept_batch):
                assert torch.equal(cut.kept[0], kept[b])
            assert torch.equal(alone_tokens[0, -4:], tokens[b, -4:])


def test_retain_below_the_reachable_minimum_names_the_fix():
    model, processor = tiny_llava(layers=6)
    inputs = inputs_for(processor, QUESTIONS[:1])
    with hap.patched(model, hap.HAPConfig(retain=0.056)), torch.no_grad():
        with pytest.raises(ValueError, match=r"retain=0.056 is unreachable.*lower first_layers"):
            model(**inputs)
