"""VisionZip: budget split, dominant tokens by [CLS] attention, contextual merging (the official rule end to end:
tests/test_baselines.py)."""
import pytest
import torch

from hap.pruners.visionzip import contextual_targets, contextual_tokens, dominant_tokens, split_budget


def test_split_budget():
    assert split_budget(64) == (54, 10)
    assert split_budget(8) == (7, 1)
    assert split_budget(2) == (1, 1)  # [CLS] and one contextual token
    for k in (0, 1):  # [CLS] alone is no image
        with pytest.raises(ValueError, match=r"at least 2 tokens \(\[CLS\] and one image token\)"):
            split_budget(k)


def test_dominant_tokens_are_the_most_attended_ascending():
    attn = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05], [0.4, 0.0, 0.3, 0.0, 0.3]])
    assert dominant_tokens(attn, 2).tolist() == [[1, 3], [0, 2]]  # ties broken by position


def test_contextual_merge_groups_similar_keys():
    # 6 patches, dominant = {0}; the rest [1..5] form two key clusters: {1, 2, 5} along x, {3, 4} along y
    keys = torch.tensor([[[1.0, 1.0], [1, 0], [1, 0.1], [0, 1], [0.1, 1], [1, -0.1]]])
    embeds = torch.arange(6, dtype=torch.float32).view(1, 6, 1).repeat(1, 1, 3)
    targets, merged = contextual_tokens(keys, embeds, torch.tensor([[0]]), 2)
    assert targets.tolist() == [[1, 3]]  # every (5 // 2)-th remaining patch from the first
    # target 1 gathers {2, 5}: 1 + mean(2, 5) = 4.5; target 3 gathers {4}: 3 + 4 = 7 (target plus the mean)
    torch.testing.assert_close(merged[0, :, 0], torch.tensor([4.5, 7.0]))
    assert merged.shape == (1, 2, 3)


def test_contextual_targets_step_through_the_remaining_patches():
    assert contextual_targets(130, 10).tolist() == list(range(0, 130, 13))
    assert contextual_targets(25, 10).tolist() == list(range(0, 20, 2))  # step 25 // 10 = 2, the first 10
    assert contextual_targets(7, 7).tolist() == list(range(7))
    with pytest.raises(ValueError, match="non-dominant"):
        contextual_targets(3, 4)


def test_contextual_merge_conserves_every_remaining_patch():
    torch.manual_seed(0)
    keys, embeds = torch.randn(3, 20, 8), torch.randn(3, 20, 5)
    dominant = dominant_tokens(torch.rand(3, 20), 6)
    targets, merged = contextual_tokens(keys, embeds, dominant, 4)
    assert targets.shape == (3, 4) and merged.shape == (3, 4, 5)
    for b in range(3):
        assert not set(targets[b].tolist()) & set(dominant[b].tolist())
    # no contextual tokens: nothing merged
    t0, m0 = contextual_tokens(keys, embeds, dominant, 0)
    assert t0.shape == (3, 0) and m0.shape == (3, 0, 5)
    with pytest.raises(ValueError, match="non-dominant"):
        contextual_tokens(keys, embeds, dominant, 15)


# --- wired as the `visionzip` method on small random LLaVAs ---------------------------------------------------
import hap  # noqa: E402
from tiny_models import CASES, llava_case  # noqa: E402


@torch.no_grad()
def test_visionzip_keeps_k_tokens_in_every_layer():
    model, make_inputs = llava_case(layers=4)
    inputs = make_inputs(["what color is the circle ?"], None)
    T = inputs["input_ids"].shape[1]
    with hap.patched(model, hap.HAPConfig(method="visionzip", retain=0.1, first_layers=2)) as patch:
        out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
    k = round(0.1 * 144)
    assert patch.state.schedule.visual_per_layer == [k] * 4 and patch.state.schedule.cuts == [0]  # K ignored
    for layer in range(4):
        assert out.cache.get_seq_length(layer) == T - 144 + k + 2


@pytest.mark.parametrize("arch", ["llava-qwen2", "qwen2-vl"])
def test_visionzip_on_a_tower_without_cls_is_refused(arch):
    model, _ = CASES[arch]()
    with pytest.raises(ValueError, match=r"has no \[CLS\] token"):
        hap.patch(model, hap.HAPConfig(method="visionzip", retain=0.2))
    assert not hasattr(model, "_hap")


def test_visionzip_refuses_a_budget_of_one_token_by_name_and_keeps_one_image_token_at_two():
    """retain=1/144 would keep [CLS] alone (a traced run crashed on no visual token); it is refused naming the knob
    and its smallest value, which the sweep's floor follows, and that smallest value keeps one image token."""
    from hap.planning.budget import plan, smallest_retain
    from hap.patch.decoder import decoder_shape
    from tiny_models import noise_image, tiny_llava

    model, processor = tiny_llava(layers=4)
    shape, ask = decoder_shape(model), dict(image=noise_image(), prompt="what color is the circle ?", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"retain=0.00694444 keeps 1 of 144 visual tokens, which under "
                                         r"method='visionzip' is too few: it needs at least 2.*raise retain to at least "
                                         r"0\.0139"):
        hap.run(model, processor, config=hap.HAPConfig(method="visionzip", retain=1 / 144), **ask)
    with pytest.raises(ValueError, match=r"flops_ratio=0.05 keeps 1 of 144 .*raise flops_ratio to at least 0\.0529"):
        plan(hap.HAPConfig(method="visionzip", flops_ratio=0.05), shape, 144, text_tokens=10)  # 1 token: 0.0483
    floor = smallest_retain(hap.HAPConfig(method="visionzip"), shape, 144)
    assert floor == 2 / 144
    result = hap.run(model, processor, config=hap.HAPConfig(method="visionzip", retain=floor), **ask)  # traced
    assert [len(g.kept) for g in result.groups] == [1] and result.visual_per_layer == [2] * 4
