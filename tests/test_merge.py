"""Merging dropped tokens with proportional attention (hap/pruners/merge.py, docs/method.md §10): the merge arithmetic,
the bias = copies identity, and the patched model's prefill and decode steps agreeing with each other."""

import pytest
import torch

import hap
from hap.pruners.merge import add_key_bias, key_bias, merge_dropped
from tiny_models import CASES

QUESTION = "what color is the circle ?"


def test_merge_dropped_folds_each_token_into_its_most_similar_kept_one():
    torch.manual_seed(0)
    B, N, D = 2, 9, 5
    embeds, sizes = torch.randn(B, N, D), torch.randint(1, 4, (B, N)).float()
    chosen = torch.tensor([[0, 4, 7], [1, 2, 8]])
    merged, total = merge_dropped(embeds, sizes, chosen)
    assert torch.allclose(total.sum(1), sizes.sum(1))
    for b in range(B):
        unit = torch.nn.functional.normalize(embeds[b], dim=-1)
        for slot, i in enumerate(chosen[b].tolist()):
            members = [j for j in range(N) if j not in chosen[b].tolist()
                       and int((unit[j] @ unit[chosen[b]].T).argmax()) == slot] + [i]
            w = sizes[b, members]
            assert total[b, slot] == w.sum()
            assert torch.allclose(merged[b, slot], (embeds[b, members] * w[:, None]).sum(0) / w.sum(), atol=1e-6)


def test_merge_by_hand_on_two_clusters():
    """A second, hand-computed check of the nearest-kept-token assignment and the size-weighted mean: tokens 1 and
    4 lie along x with kept token 0, token 3 along y with kept token 2 (not the nearest by position)."""
    embeds = torch.tensor([[[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [1.0, 0.05]]])
    sizes = torch.tensor([[1.0, 1.0, 1.0, 1.0, 2.0]])
    merged, total = merge_dropped(embeds, sizes, torch.tensor([[0, 2]]))
    assert total.tolist() == [[4.0, 2.0]]
    torch.testing.assert_close(merged, torch.tensor([[[0.975, 0.05], [0.05, 0.95]]]))


def test_key_bias_by_hand():
    """log(size) at each visual token's current position, 0 on every other key (a second check of the bias)."""
    bias = key_bias(torch.tensor([[2.0, 1.0, 4.0]]), torch.tensor([[1, 3, 4]]), 6)
    torch.testing.assert_close(bias, torch.tensor([[0.0, 2.0, 0.0, 0.0, 4.0, 0.0]]).clamp_min(1).log())


def test_a_log_size_bias_on_a_key_equals_that_many_copies_of_it():
    """softmax over s copies of (k, v) = softmax with log s added to k's logit: what lets a merged token stand in."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    copies = torch.tensor([3, 1, 2, 1])
    expanded = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(copies, 2), v.repeat_interleave(copies, 2))
    mask = add_key_bias(torch.ones(1, 1, 3, 4, dtype=torch.bool), key_bias(copies[None].float(),
                                                                           torch.arange(4)[None], 4), torch.float32)
    biased = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(expanded, biased, atol=1e-5)


def test_the_bias_keeps_the_masked_keys_masked_and_pads_the_generated_columns():
    mask = torch.tensor([[True, False, True, True, True]])[None, None]  # [1, 1, 1, 5]: key 1 is padding
    out = add_key_bias(mask, torch.tensor([[0.0, 2.0, 1.0]]), torch.float32)  # bias on the 3 prompt keys
    assert out[0, 0, 0, 1] < -1e30 and out[0, 0, 0, 2] == 1.0 and out[0, 0, 0, 3:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("arch", ["llava", "qwen2-vl"])
@pytest.mark.parametrize("merge", ["average", "proportional"])
@torch.no_grad()
def test_decode_steps_on_a_merged_cache_equal_a_fresh_merged_prefill(arch, merge):
    """The kept tokens are fixed by a priority, so a fresh prefill of prompt + generated tokens merges the same way;
    the decode steps (bias in the decode masks) must then give its logits; and the merge must change them."""
    model, make_inputs = CASES[arch]()
    inputs = make_inputs([QUESTION], [0])
    n = int((inputs["input_ids"] == model.config.image_token_id).sum())
    priority = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float()[None]
    config = hap.HAPConfig(retain=0.3, first_layers=1, groups=2, merge=merge)
    with hap.patched(model, config, priority=priority) as patch:
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        sizes = patch.state.sizes
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        ids = out.sequences[:, :-1]
        if "mm_token_type_ids" in inputs:
            extra["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        fresh = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[:, -1]
    assert sizes.sum().item() == n and sizes.max().item() > 1
    assert (out.logits[-1] - fresh).abs().max().item() < 1e-4
    with hap.patched(model, hap.HAPConfig(retain=0.3, first_layers=1, groups=2, merge="none"), priority=priority):
        unmerged = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[:, -1]
    assert (unmerged - fresh).abs().max().item() > 1e-3


def test_proportional_merge_refuses_flash_attention_by_name():
    model, _ = CASES["llava"]()
    model.model.language_model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"flash_attention_2.*merge='none'"):
        hap.patch(model, hap.HAPConfig(merge="proportional"))
