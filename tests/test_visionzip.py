"""VisionZip-style selection: budget split, dominant tokens by [CLS] attention, contextual merging."""
import pytest
import torch

from hap.visionzip import contextual_tokens, dominant_tokens, split_budget


def test_split_budget():
    assert split_budget(64) == (54, 10)
    assert split_budget(8) == (7, 1)
    assert split_budget(1) == (1, 0)
    assert split_budget(2) == (1, 1)
    with pytest.raises(ValueError, match="at least one token"):
        split_budget(0)


def test_dominant_tokens_are_the_most_attended_ascending():
    attn = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05], [0.4, 0.0, 0.3, 0.0, 0.3]])
    assert dominant_tokens(attn, 2).tolist() == [[1, 3], [0, 2]]  # ties broken by position


def test_contextual_merge_groups_similar_keys():
    # 6 patches, dominant = {0}; the rest form two key clusters: {1, 2, 3} along x, {4, 5} along y
    keys = torch.tensor([[[1.0, 1.0], [1, 0], [1, 0.1], [1, -0.1], [0, 1], [0.1, 1]]])
    embeds = torch.arange(6, dtype=torch.float32).view(1, 6, 1).repeat(1, 1, 3)
    targets, merged = contextual_tokens(keys, embeds, torch.tensor([[0]]), 2)
    assert targets.tolist() == [[1, 5]]  # evenly spaced over the remaining patches [1..5]
    # target 1 gathers {1, 2, 3} (mean 2), target 5 gathers {4, 5} (mean 4.5)
    torch.testing.assert_close(merged[0, :, 0], torch.tensor([2.0, 4.5]))
    assert merged.shape == (1, 2, 3)


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
from hap.visionzip import select  # noqa: E402
from tiny_models import CASES, llava_case  # noqa: E402


def _inputs(make_inputs):
    return make_inputs(["what color is the circle ?", "is there a big red square in the image ?"], [0, 1])


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


@torch.no_grad()
def test_visionzip_equals_an_independent_eager_computation():
    """Dominant tokens from the tower's eager [CLS] attention, contextual ones merged by its keys: the kept
    tokens and the hidden states entering layer 0 are those `select` gives on independently computed cues."""
    model, make_inputs = llava_case(layers=4)
    inputs = _inputs(make_inputs)
    k = round(0.15 * 144)
    tower = model.model.vision_tower
    tower.set_attn_implementation("eager")
    vision = tower(inputs["pixel_values"], output_attentions=True, output_hidden_states=True)
    cls_attention = vision.attentions[-1][:, :, 0, 1:].mean(1)  # feature layer -1: the last layer's attention
    layer = tower.encoder.layers[-1]
    x = layer.layer_norm1(vision.hidden_states[-2])  # that layer's input
    B, T_v, _ = x.shape
    keys = layer.self_attn.k_proj(x).view(B, T_v, -1, layer.self_attn.head_dim).mean(2)[:, 1:]
    visual = inputs["input_ids"] == model.config.image_token_id
    embeds = model(**inputs, output_hidden_states=True).hidden_states[0][visual].view(B, 144, -1)
    chosen, slots, merged = select(cls_attention, keys, embeds, k)
    seen = {}
    with hap.patched(model, hap.HAPConfig(method="visionzip", retain=0.15)) as patch:
        def layer0_input(module, args, kwargs) -> None:
            seen["hidden"] = args[0] if args else kwargs["hidden_states"]

        hook = model.model.language_model.layers[0].register_forward_pre_hook(layer0_input, with_kwargs=True)
        model(**inputs)
        hook.remove()
    assert torch.equal(patch.state.cuts[0].kept, chosen)
    hidden = seen["hidden"]  # [B, T', D]: the kept visual rows sit at patch.state.visual_pos
    kept_rows = hidden.gather(1, patch.state.visual_pos[..., None].expand(-1, -1, hidden.shape[-1]))
    expected = embeds.gather(1, chosen[..., None].expand(-1, -1, embeds.shape[-1])).clone()
    expected.scatter_(1, slots[..., None].expand(-1, -1, embeds.shape[-1]), merged)
    torch.testing.assert_close(kept_rows, expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_visionzip_keeping_every_token_reproduces_the_stock_model():
    model, make_inputs = llava_case(layers=4)
    inputs = _inputs(make_inputs)
    ref = model(**inputs).logits
    with hap.patched(model, hap.HAPConfig(method="visionzip", retain=1.0)):
        logits = model(**inputs).logits
    assert (logits - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", ["llava-qwen2", "qwen2-vl"])
def test_visionzip_on_a_tower_without_cls_is_refused(arch):
    model, _ = CASES[arch]()
    with pytest.raises(ValueError, match=r"has no \[CLS\] token"):
        hap.patch(model, hap.HAPConfig(method="visionzip", retain=0.2))
    assert not hasattr(model, "_hap")
