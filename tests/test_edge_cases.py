"""Edge cases of the core on small random LLaVAs: a decode loop without positions, right padding,
a static cache."""

import pytest
import torch

import hap
from hap.runs.run import chat_prompt
from tiny_models import CASES, inputs_for, llava_case, noise_image, tiny_llava

QUESTIONS = ["what color is the circle ?", "is there a big red square in the image ?"]
CUT_BEFORE_LAYER0 = hap.HAPConfig(method="random", retain=0.4, first_layers=0, groups=2)


@pytest.mark.parametrize("arch", ["llava", "qwen2-vl"])
@torch.no_grad()
def test_a_decode_loop_without_positions_after_a_cut_before_layer0_equals_a_fresh_pruned_forward(arch):
    """Only input_ids, attention_mask and the cache per step: the patch supplies the positions the stock
    model would use on an unpruned cache (the seeded random policy keeps the same tokens whatever the text)."""
    model, make_inputs = CASES[arch]()
    inputs = make_inputs(QUESTIONS[:1], None)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    with hap.patched(model, CUT_BEFORE_LAYER0):
        out = model(**inputs, use_cache=True)
        steps = []
        for _ in range(4):
            step = out.logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, step], 1), torch.cat([mask, torch.ones_like(step)], 1)
            out = model(input_ids=step, attention_mask=mask, cache=out.cache, use_cache=True)
            steps.append((ids, mask, out.logits[:, -1]))
        for ids, mask, logits in steps:  # after the loop: a fresh prefill starts a new pruning state
            if "mm_token_type_ids" in inputs:
                images["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
            fresh = model(input_ids=ids, attention_mask=mask, use_cache=False, **images)
            assert (logits - fresh.logits[:, -1]).abs().max().item() < 1e-5


@pytest.mark.parametrize("config", [hap.HAPConfig(method="hap", retain=0.3, first_layers=1, groups=2), CUT_BEFORE_LAYER0,
                                    hap.HAPConfig(method="pdrop", retain=0.3, first_layers=0, groups=2)],
                         ids=["hap", "random-before-layer0", "pdrop-last-row"])
@torch.no_grad()
def test_a_right_padded_batch_prunes_each_sample_as_alone(config):
    """The prompt rows are found per sample from the attention mask: the same tokens kept and the same
    logits at each sample's last real token as the sample alone."""
    model, processor = tiny_llava(layers=4)
    processor.tokenizer.padding_side = "right"
    batch = processor(images=[noise_image(b) for b in range(2)], text=[chat_prompt(processor, q) for q in QUESTIONS],
                      return_tensors="pt", padding=True)
    assert (batch["attention_mask"][:, -1] == 0).any(), "right padding must leave a pad at the end of a row"
    with hap.patched(model, config) as patch:
        logits = model(**batch).logits  # [2, T', vocab] on the pruned sequence, pads last
        last = logits.shape[1] - 1 - (batch["attention_mask"] == 0).sum(1)
        kept = [c.kept for c in patch.state.cuts]
        for b, q in enumerate(QUESTIONS):
            alone = model(**inputs_for(processor, [q], [b])).logits[0, -1]
            assert [c.kept[0].tolist() for c in patch.state.cuts] == [k[b].tolist() for k in kept]
            assert (logits[b, last[b]] - alone).abs().max().item() < 1e-4


def test_a_static_cache_is_refused_by_name():
    model, make_inputs = llava_case(layers=4)
    inputs = make_inputs(QUESTIONS[:1], None)
    with hap.patched(model, hap.HAPConfig(retain=0.4, first_layers=1, groups=2)), torch.no_grad():
        with pytest.raises(ValueError, match=r"dynamic KV cache.*StaticCache"):
            model.generate(**inputs, max_new_tokens=2, do_sample=False, cache_implementation="static")
