"""The instance patch on every supported architecture: equivalence with the stock model when
nothing is pruned, a really shortened cache, correct decoding on it, batches, unpatch."""

import pytest
import torch

import hap
from tiny_models import CASES, inputs_for, llava_case, tiny_llava

QUESTIONS = ["what color is the circle ?", "is there a big red square in the image ?"]
ARCHS = list(CASES)


def greedy(model, inputs, steps):
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, 1), out


def num_visual(model, inputs) -> int:
    return int((inputs["input_ids"][0] == model.config.image_token_id).sum())


@pytest.mark.parametrize(
    "arch, attn", [("llava", "sdpa"), ("llava", "eager")] + [(a, "sdpa") for a in ARCHS[1:]] + [("qwen2-vl", "eager")]
)
@pytest.mark.parametrize(
    "config",
    [hap.HAPConfig(method="none"), hap.HAPConfig(retain=1.0, groups=2), hap.HAPConfig(retain=1.0, first_layers=0)],
    ids=["none", "retain1", "retain1-cut-before-layer0"],
)
def test_nothing_pruned_reproduces_the_stock_model(arch, attn, config):
    model, make_inputs = CASES[arch](attn)
    inputs = make_inputs(QUESTIONS[:1], None)
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
    model, make_inputs = llava_case()
    inputs = make_inputs(QUESTIONS[:1], None)
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
    model, make_inputs = llava_case(layers=6)
    inputs = make_inputs(QUESTIONS[:1], None)
    T = inputs["input_ids"].shape[1]
    text = T - 144
    first = 1 if method == "fastv" else 0  # fastv at retain 0.2 needs its single cut behind a layer
    config = hap.HAPConfig(method=method, retain=0.056 if method != "fastv" else 0.2, first_layers=first)
    with hap.patched(model, config) as patch:
        _, _, out = greedy(model, inputs, 16)
    schedule = patch.state.schedule
    generated_in_cache = 15  # the 16th token is produced but never fed back
    for layer, visual in enumerate(schedule.visual_per_layer):
        assert out.cache.get_seq_length(layer) == text + visual + generated_in_cache
    assert out.sequences.shape[1] == T + 16
    assert config.retain - 1 / 144 <= schedule.retain <= config.retain + 1e-9  # rounded down, by under a token
    assert len(patch.state.cuts) == len(schedule.cuts)
    if method == "hap":
        assert schedule.cuts == [0, 2, 4] and schedule.kept[0] > schedule.kept[1] > schedule.kept[2]


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decoding_equals_a_fresh_pruned_forward(arch):
    """Positions (1-D RoPE or M-RoPE), masks and the shortened cache stay right while decoding: each
    cached step equals a no-cache forward over prompt + generated tokens that keeps the same tokens
    (the seeded random policy keeps the same tokens whatever the text)."""
    model, make_inputs = CASES[arch]()
    inputs = make_inputs(QUESTIONS[:1], None)
    config = hap.HAPConfig(method="random", retain=0.4, first_layers=1, groups=2)
    with hap.patched(model, config) as patch:
        tokens, steps, out = greedy(model, inputs, 6)
        assert out.cache.get_seq_length(3) < out.cache.get_seq_length(0)
        T = inputs["input_ids"].shape[1]
        for i in range(1, 6):
            ids = tokens[:, : T + i]
            extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
            if "mm_token_type_ids" in inputs:
                extra["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
            with torch.no_grad():
                fresh = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra).logits[:, -1]
            assert (fresh - steps[:, i]).abs().max().item() < 1e-4
        assert patch.state.cuts[-1].kept.shape[1] == patch.state.schedule.kept[-1]


@pytest.mark.parametrize(
    "arch, method, first",
    [("llava", "hap", 1), ("llava", "hap", 0), ("llava", "pdrop", 1), ("llava", "fastv", 1),
     ("llava-qwen2", "hap", 1), ("qwen2-vl", "hap", 1), ("qwen2.5-vl", "hap", 0)],
)
def test_batch_selection_equals_each_sample_alone(arch, method, first):
    model, make_inputs = CASES[arch]()
    config = hap.HAPConfig(method=method, retain=0.3 if arch.startswith("llava") else 0.5, first_layers=first,
                           groups=2 if method != "fastv" else 1)
    batch = make_inputs(QUESTIONS, [0, 1])
    assert (batch["attention_mask"] == 0).any(), "the prompts must differ in length to test left padding"
    with hap.patched(model, config) as patch:
        tokens, _, _ = greedy(model, batch, 4)
        kept_batch = [c.kept for c in patch.state.cuts]
        for b in range(2):
            alone_tokens, _, _ = greedy(model, make_inputs([QUESTIONS[b]], [b]), 4)
            for cut, kept in zip(patch.state.cuts, kept_batch):
                assert torch.equal(cut.kept[0], kept[b])
            assert torch.equal(alone_tokens[0, -4:], tokens[b, -4:])


def test_text_only_generation_after_a_pruned_one_is_stock():
    """A new prompt without an image gets a new cache: nothing of the earlier pruning applies to it."""
    model, processor = tiny_llava(layers=4)
    image_inputs = inputs_for(processor, QUESTIONS[:1])
    text = processor.tokenizer(["what color is the circle ?"], return_tensors="pt")
    ref, _, _ = greedy(model, text, 5)
    with hap.patched(model, hap.HAPConfig(retain=0.4, first_layers=1, groups=2)):
        greedy(model, image_inputs, 3)
        again, _, _ = greedy(model, text, 5)
    assert torch.equal(again, ref)


def test_an_image_cannot_be_added_to_an_existing_cache():
    model, make_inputs = llava_case(layers=4)
    inputs = make_inputs(QUESTIONS[:1], None)
    with hap.patched(model, hap.HAPConfig(retain=0.4, first_layers=1, groups=2)), torch.no_grad():
        cache = model(**inputs).cache
        with pytest.raises(ValueError, match="fresh prefill"):
            model(**inputs, cache=cache)


def test_retain_below_the_reachable_minimum_names_the_fix():
    model, make_inputs = llava_case(layers=6)
    with hap.patched(model, hap.HAPConfig(retain=0.056, first_layers=2)), torch.no_grad():
        with pytest.raises(ValueError, match=r"retain=0.056 is unreachable.*lower first_layers"):
            model(**make_inputs(QUESTIONS[:1], None))


def test_unsupported_architectures_are_refused_by_name():
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    config = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        text_config=dict(model_type="gemma", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64),
        image_token_index=60,
    )
    with pytest.raises(ValueError, match=r"no adapter for PaliGemmaForConditionalGeneration.*supported: Llava"):
        hap.patch(PaliGemmaForConditionalGeneration(config), hap.HAPConfig())


def test_a_priority_ranks_above_the_scores_at_every_cut():
    """The analysis hook: tokens of higher priority are kept first at every cut (by original visual index),
    the method's scores order the rest; an all-zero priority changes nothing."""
    model, make_inputs = llava_case(layers=6)
    inputs = make_inputs(QUESTIONS, [0, 1])
    config = hap.HAPConfig(method="uniform", retain=0.2, first_layers=0, groups=3)
    favoured = [torch.tensor([3, 50, 77, 140]), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])]
    priority = torch.zeros(2, 144)
    for b, idx in enumerate(favoured):
        priority[b, idx] = 1.0
    with torch.no_grad():
        with hap.patched(model, config) as plain:
            model(**inputs)
        with hap.patched(model, config, priority=torch.zeros(2, 144)) as zero:
            model(**inputs)
        with hap.patched(model, config, priority=priority) as patch:
            model(**inputs)
    for cut, cut_plain, cut_zero in zip(patch.state.cuts, plain.state.cuts, zero.state.cuts):
        assert torch.equal(cut_zero.kept, cut_plain.kept)
        for b, idx in enumerate(favoured):
            kept, wanted = set(cut.kept[b].tolist()), set(idx.tolist())
            assert wanted <= kept if len(kept) >= len(wanted) else kept <= wanted  # the favoured first
    assert not torch.equal(patch.state.cuts[0].kept, plain.state.cuts[0].kept)
    with pytest.raises(ValueError, match=r"priority must be \[batch, visual\] = \[2, 144\]"):
        with hap.patched(model, config, priority=torch.zeros(2, 10)), torch.no_grad():
            model(**inputs)
