"""Qwen3-VL (issue 37) on a tiny random model: stock equality when nothing is pruned (SDPA and eager), every method
runs or is refused by the model's name, batches of two image sizes, DeepStack features that follow the kept tokens
whatever the cut's layer, the layout of the visual tokens on the uploaded image, the pipeline and the CLI, and the
budget arithmetic at the real 2B decoder's shape."""

import pytest
import torch

import hap
from hap.planning.flops import prefill_flops
from hap.knobs import METHODS
from hap.layout import Layout
from hap.patch import decoder_of, refusal, visual_tokens
from hap.patch.decoder import decoder_shape
from hap.runs.run import template_tail
from test_zoo import (check_cli, check_planted_square, check_unpruned_is_stock, greedy, method_config,
                      square_image)
from tiny_zoo import inputs
from tiny_zoo_recent import decode_loop_error, fanned_out_error, qwen3_vl, recomputed_rows_error

QUESTION = "what color is the circle ?"
SIZES = ((100, 170), (170, 100))  # 3 x 5 and 5 x 3 merged tokens: different images, equal counts
REFUSED = {"pdrop", "visionzip", "sparsevlm", "autoprune", "divprune", "vispruner", "cdpruner", "scope", "holov",
           "prunesid", "hiprune"}  # no [CLS] token;
#   M-RoPE ids cannot be renumbered (downsample resizes the image instead: tests/test_downsample_resized.py)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_nothing_pruned_reproduces_the_stock_model(attn):
    model, processor = qwen3_vl(attn)
    batch = inputs(processor, [QUESTION], [SIZES[0]])
    check_unpruned_is_stock(model, batch)
    assert "_deepstack_process" not in vars(decoder_of(model))  # unpatched: the class's own method again


def test_recomputed_rows_equal_eager_attention(monkeypatch):
    """The prompt rows HAP recomputes (interleaved M-RoPE, QK-norm) equal the model's own eager attention, every
    layer."""
    model, processor = qwen3_vl("eager")
    batch = inputs(processor, [QUESTION, "is there a red square ?"], list(SIZES), [0, 1])
    assert recomputed_rows_error(monkeypatch, model, batch) < 1e-5


def test_a_fanned_out_prompt_equals_one_run_per_variant():
    """A batch-1 prompt with several priority rows (head utility, the causal section) cut entering layer 1: each
    variant's logits as if run alone (the DeepStack rows of each variant's kept tokens)."""
    model, processor = qwen3_vl()
    assert fanned_out_error(model, inputs(processor, [QUESTION], [SIZES[0]]), layer=1) < 1e-5


def test_the_causal_sections_repeated_decoder_input_carries_deepstack():
    """`hap.causal` repeats a batch-1 decoder input per gated variant: each copy gets the DeepStack features too, so
    the all-open copy equals the stock model and a gated copy equals that gate run alone."""
    from hap import causal

    model, processor = qwen3_vl()
    batch = inputs(processor, [QUESTION], [SIZES[0]])
    L, H = causal.head_layout(model)
    gates = torch.ones(3, L, H)
    gates[1, 0, 0] = gates[2, 1, 1] = 0.0
    together = causal.answer_log_probs(model, batch, gates)
    with torch.no_grad():
        stock = model(**batch).logits[0, -1].float().log_softmax(-1)
    assert (together[0] - stock).abs().max().item() < 1e-5
    alone = causal.answer_log_probs(model, batch, gates[2:])
    assert (together[2] - alone[0]).abs().max().item() < 1e-5


def test_a_decode_loop_without_positions_equals_a_fresh_pruned_forward():
    model, processor = qwen3_vl()
    config = hap.HAPConfig(method="random", retain=0.5, first_layers=0, groups=2)
    assert decode_loop_error(model, inputs(processor, [QUESTION], [SIZES[0]]), config) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_or_is_refused_by_name(method):
    model, processor = qwen3_vl()
    config = method_config(model, method, 0.3)
    why = refusal(model, config)
    if method in REFUSED:
        assert why is not None and type(model).__name__ in why
        return
    assert why is None
    if method == "downsample":  # the image resized in hap.run (tests/test_downsample_resized.py), no patch alone
        with pytest.raises(ValueError, match="resizes the image before the processor"), hap.patched(model, config):
            pass
        return
    batch = inputs(processor, [QUESTION], [SIZES[0]])
    with hap.patched(model, config, tail=template_tail(processor)) as patch:
        tokens, steps = greedy(model, batch, 3)
    assert torch.isfinite(steps).all() and tokens.shape[1] == batch["input_ids"].shape[1] + 3
    if method != "none":
        assert patch.cache.layers[-1].keys.shape[2] < batch["input_ids"].shape[1] + 3 - 1


def test_a_batch_of_two_image_sizes_selects_as_each_sample_alone():
    model, processor = qwen3_vl()
    questions = [QUESTION, "is there a red square ?"]
    batch = inputs(processor, questions, list(SIZES), [0, 1])
    config = hap.HAPConfig(retain=0.3, groups=2)
    with hap.patched(model, config) as patch, torch.no_grad():
        model(**batch)
        together = [c.kept for c in patch.state.cuts]
    for b in range(2):
        alone = inputs(processor, [questions[b]], [SIZES[b]], [b])
        with hap.patched(model, config) as patch, torch.no_grad():
            model(**alone)
        assert all(torch.equal(t[b], c.kept[0]) for t, c in zip(together, patch.state.cuts))


def test_a_batch_of_unequal_visual_counts_is_refused_before_any_work():
    model, processor = qwen3_vl()
    batch = inputs(processor, [QUESTION, QUESTION], [(100, 170), (200, 200)])
    counts = visual_tokens(model, batch).sum(1)
    assert counts[0] != counts[1]
    with hap.patched(model, hap.HAPConfig(retain=0.3)), pytest.raises(ValueError, match="same number of visual"):
        model(**batch)


def by_hand(model, batch, keep: torch.Tensor, cut: int, deepstack_after_cut: bool = True) -> torch.Tensor:
    """The last token's logits [vocab] of the stock layers run by hand on sample 0, dropping all but the prompt
    positions `keep` (long [T']) entering layer `cut`, and adding each DeepStack feature to its own token (after the
    cut too, unless `deepstack_after_cut` is False)."""
    text = decoder_of(model)
    seen = {}
    hook = text.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    hook.remove()
    hidden, visual, stack = seen["inputs_embeds"], seen["visual_pos_masks"], seen["deepstack_visual_embeds"]
    positions = seen["position_ids"][-3:]  # T / H / W (after the text row, where there is one)
    cos, sin = text.rotary_emb(hidden, positions)
    rows = torch.full(visual.shape, -1).masked_scatter(visual, torch.arange(int(visual.sum())))
    with torch.no_grad():
        for i, layer in enumerate(text.layers):
            if i == cut:
                hidden, cos, sin, visual, rows = (x[:, keep] for x in (hidden, cos, sin, visual, rows))
            hidden = layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
            if i < len(stack) and (deepstack_after_cut or i < cut):
                hidden = hidden.clone()
                hidden[visual] += stack[i][rows[visual]]
        return model.lm_head(text.norm(hidden))[0, -1]


@pytest.mark.parametrize("cut", [0, 1, 2, 3])  # DeepStack follows layers 0 and 1: cuts before, inside, at, after it
def test_deepstack_features_follow_the_kept_tokens(cut):
    """One cut entering layer `cut` (no merge): the logits equal the stock layers run by hand on the kept tokens with
    each DeepStack feature added to its own token."""
    model, processor = qwen3_vl(layers=8)
    batch = inputs(processor, [QUESTION], [SIZES[0]])
    config = hap.HAPConfig(retain=0.6, first_layers=cut, groups=1, merge="none")
    with hap.patched(model, config) as patch, torch.no_grad():
        logits = model(**batch).logits[0, -1]
        keep = patch.origin[0]
    assert [c.layer for c in patch.state.cuts] == [cut]
    visual = int(visual_tokens(model, batch).sum())
    assert keep.shape[0] < batch["input_ids"].shape[1] and len(keep) - (batch["input_ids"].shape[1] - visual) > 0
    ref = by_hand(model, batch, keep, cut)
    assert (logits - ref).abs().max().item() < 1e-4
    if cut < 2:  # DeepStack runs after the cut: leaving its features out there would show
        assert (logits - by_hand(model, batch, keep, cut, deepstack_after_cut=False)).abs().max().item() > 1e-3


def local_visual(model) -> None:
    """Zero each vision block's attention output: a merged token's feature then depends on its own 2 x 2 patches."""
    for block in model.model.visual.blocks:
        torch.nn.init.zeros_(block.attn.proj.weight)
        torch.nn.init.zeros_(block.attn.proj.bias)


def test_a_planted_square_lands_where_the_layout_and_the_drawn_map_say():
    """A bright square changes most the token whose layout box holds its centre; the drawn map's hottest cell sits
    over the square's pixels."""
    model, processor = qwen3_vl()
    square = (104, 36, 114, 46)
    check_planted_square(model, processor, (100, 170), square, views_expected=1, grid=(3, 5), retain=0.3,
                         localize=local_visual)


def test_the_pipeline_and_the_cli_run_a_saved_model(tmp_path, capsys):
    model, processor = qwen3_vl()
    image = square_image((120, 90), (10, 10, 30, 30))
    result = hap.run(model, processor, image, QUESTION, hap.HAPConfig(retain=0.3, groups=2), max_new_tokens=3)
    assert result.num_visual == Layout.from_dict(result.layout).num_visual == 12
    check_cli(model, processor, (120, 90), tmp_path, capsys, retain=0.3)


@pytest.mark.slow
def test_the_2b_decoder_shape_cuts_to_the_budget():
    """Qwen3-VL-2B's decoder (2048 wide, 16 query / 8 KV heads of 128, FFN 6144, M-RoPE [24, 20, 20]) on
    4 layers (DeepStack after the first 2, from the tiny tower); a 640 x 480 image gives the real 300 tokens; the
    schedule, the cut and the FLOPs agree."""
    text = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]})
    model, processor = qwen3_vl(layers=4, text=text, max_pixels=16777216)
    batch = inputs(processor, [QUESTION], [(480, 640)])
    N = int(visual_tokens(model, batch).sum())
    assert N == 300
    shape = decoder_shape(model)
    assert shape.kv_dim == 8 * 128 and shape.q_dim is None and shape.windows == ()  # GQA; 16 x 128 = hidden
    config = hap.HAPConfig(retain=0.5, first_layers=1, groups=1)
    with hap.patched(model, config) as patch, torch.no_grad():
        model(**batch, use_cache=True)
    schedule = patch.state.schedule
    assert schedule.num_visual == N and schedule.retained_tokens <= 0.5 * N
    assert patch.cache.layers[-1].keys.shape[2] == batch["input_ids"].shape[1] - (N - schedule.kept[0])
    text_tokens = batch["input_ids"].shape[1] - N
    assert schedule.flops_ratio(text_tokens, shape) == pytest.approx(
        prefill_flops(schedule.visual_per_layer, text_tokens, shape) / prefill_flops([N] * 4, text_tokens, shape))
