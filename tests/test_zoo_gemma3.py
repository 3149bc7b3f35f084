"""Gemma 3 (issue 37) on a tiny random model: stock equality when nothing is pruned (SDPA and eager), every method
runs or is refused by the model's name, batches of two image sizes, the bidirectional image block and the sliding /
full masks and rotary tables kept consistent after a drop, pan-and-scan crops (stock, pruned, drawn), the layout of the visual
tokens on the uploaded image, the pipeline and the CLI, and the budget arithmetic at the real 4B decoder's shape."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, get_block_sequence_ids_for_mask

import hap
from hap.planning.flops import DecoderShape, layer_flops, prefill_flops
from hap.knobs import METHODS
from hap.layout import Layout
from hap.patch import decoder_of, layout, refusal, visual_tokens
from hap.patch.gemma3 import crop_boxes
from hap.patch.decoder import decoder_shape
from hap.runs.run import chat_prompt, template_tail
from test_zoo import (check_cli, check_planted_square, check_unpruned_is_stock, greedy, method_config,
                      square_image)
from tiny_zoo import picture
from tiny_zoo_recent import decode_loop_error, fanned_out_error, gemma3, recomputed_rows_error

QUESTION = "what color is the circle ?"
SIZES = ((100, 170), (170, 100))  # squashed to 112 x 112: 16 tokens each
REFUSED = {"visionzip", "autoprune", "vispruner", "cdpruner",
           "scope", "holov", "prunesid", "hiprune"}  # SigLIP has no [CLS] (downsample pools each block)


def inputs(processor, questions: list[str], sizes: list[tuple[int, int]], seeds: list[int] | None = None) -> dict:
    """A left-padded batch: one question and one noise image of (height, width) per sample (Gemma 3's processor
    takes a list of images per sample)."""
    seeds = seeds or list(range(len(questions)))
    processor.tokenizer.padding_side = "left"
    return processor(images=[[picture(s, seed)] for s, seed in zip(sizes, seeds)],
                     text=[chat_prompt(processor, q) for q in questions], return_tensors="pt", padding=True)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_nothing_pruned_reproduces_the_stock_model(attn):
    model, processor = gemma3(attn)
    batch = inputs(processor, [QUESTION], [SIZES[0]])
    assert batch["input_ids"].shape[1] > 2 * model.config.text_config.sliding_window  # the windows matter
    check_unpruned_is_stock(model, batch)


def test_recomputed_rows_equal_eager_attention(monkeypatch):
    """The prompt rows HAP recomputes (QK-norm, each kind's rotary table, windows of 8) equal the model's own eager
    attention, every layer."""
    model, processor = gemma3("eager")
    batch = inputs(processor, [QUESTION, "is there a red square ?"], list(SIZES), [0, 1])
    assert recomputed_rows_error(monkeypatch, model, batch) < 1e-5


def test_a_fanned_out_prompt_equals_one_run_per_variant():
    """A batch-1 prompt with several priority rows (head utility, the causal section) cut entering layer 1: each
    variant's logits as if run alone (each variant's kept image block)."""
    model, processor = gemma3()
    assert fanned_out_error(model, inputs(processor, [QUESTION], [SIZES[0]]), layer=1) < 1e-5


def test_a_decode_loop_without_positions_equals_a_fresh_pruned_forward():
    model, processor = gemma3()
    config = hap.HAPConfig(method="random", retain=0.5, first_layers=0, groups=2)
    assert decode_loop_error(model, inputs(processor, [QUESTION], [SIZES[0]]), config) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_or_is_refused_by_name(method):
    model, processor = gemma3()
    config = method_config(model, method, 0.4)
    why = refusal(model, config)
    if method in REFUSED:
        assert why is not None and type(model).__name__ in why
        return
    assert why is None
    batch = inputs(processor, [QUESTION], [SIZES[0]])
    with hap.patched(model, config, tail=template_tail(processor)) as patch:
        tokens, steps = greedy(model, batch, 3)
    assert torch.isfinite(steps).all() and tokens.shape[1] == batch["input_ids"].shape[1] + 3
    if method != "none":  # the last (full-attention) layer's cache really is shorter than the prompt
        assert patch.cache.layers[-1].keys.shape[2] < batch["input_ids"].shape[1] + 3 - 1


def test_a_batch_of_two_image_sizes_selects_as_each_sample_alone():
    model, processor = gemma3()
    questions = [QUESTION, "is there a red square ?"]
    batch = inputs(processor, questions, list(SIZES), [0, 1])
    config = hap.HAPConfig(retain=0.4, groups=2)
    with hap.patched(model, config) as patch, torch.no_grad():
        model(**batch)
        together = [c.kept for c in patch.state.cuts]
    for b in range(2):
        alone = inputs(processor, [questions[b]], [SIZES[b]], [b])
        with hap.patched(model, config) as patch, torch.no_grad():
            model(**alone)
        assert all(torch.equal(t[b], c.kept[0]) for t, c in zip(together, patch.state.cuts))


def pan_and_scan(processor) -> None:
    """The processor's pan-and-scan on for every call (its `images_kwargs` defaults; `hap.run` passes none), with crops
    of at least 56 px (the tiny model's images are small)."""
    processor.images_kwargs = {**processor.images_kwargs, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 56}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pan_and_scan_crops_run_unpruned_as_stock_and_pruned_over_every_block(attn):
    """A 100 x 300 image gives the whole image and 3 crops (4 blocks of 16 tokens, each bidirectional within itself):
    stock logits when nothing is pruned, and a pruned run ranks the tokens of every block together."""
    model, processor = gemma3(attn)
    pan_and_scan(processor)
    batch = processor(images=[[picture((100, 300))]], text=[chat_prompt(processor, QUESTION)], return_tensors="pt")
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 4 * model.config.mm_tokens_per_image
    check_unpruned_is_stock(model, batch)
    with hap.patched(model, hap.HAPConfig(retain=0.4)) as patch, torch.no_grad():
        model.generate(**batch, max_new_tokens=2)
    kept = torch.cat([cut.kept[0] for cut in patch.state.cuts])
    assert patch.state.num_visual == 64 and set((kept // 16).tolist()) == {0, 1, 2, 3}  # tokens kept in every block


def test_pan_and_scan_crops_are_drawn_over_their_strips():
    """The layout: the whole image, then 3 crops of 100 px side by side (portrait: stacked); a bright square changes
    most the token over it in the whole image and in the crop holding it, and the drawn maps show it there."""
    model, processor = gemma3()
    pan_and_scan(processor)
    batch = processor(images=[[picture((100, 300))]], text=[chat_prompt(processor, QUESTION)], return_tensors="pt")
    where = layout(model, batch, (300, 100))
    where.check()
    assert [v.name for v in where.views] == ["whole image", "crop 1", "crop 2", "crop 3"]
    assert [v.box for v in where.views[1:]] == [(0.0, 0.0, 1 / 3, 1.0), (1 / 3, 0.0, 2 / 3, 1.0), (2 / 3, 0.0, 1.0, 1.0)]
    assert crop_boxes(2, (100, 301)) == [(0.0, 0.0, 1.0, 151 / 301), (0.0, 151 / 301, 1.0, 1.0)]
    check_planted_square(model, processor, (100, 300), (160, 30, 200, 70), views_expected=4, grid=(4, 4), retain=0.4)


def by_hand(model, batch, keep: torch.Tensor, cut: int, blocks: bool = True) -> torch.Tensor:
    """The last token's logits [vocab] of the stock layers run by hand on sample 0, dropping all but the prompt
    positions `keep` (long [T']) entering layer `cut`: from there on, the masks `create_masks_for_vision_model` builds
    for the kept sequence and its kept image block (`blocks`; False: no block, plain causal) and each layer kind's
    rotary table at the kept tokens' original positions."""
    text = decoder_of(model)
    seen = {}
    hook = text.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    hook.remove()
    hidden, masks = seen["inputs_embeds"], seen["attention_mask"]
    positions = torch.arange(hidden.shape[1])[None]
    types = batch["token_type_ids"]
    with torch.no_grad():
        for i, layer in enumerate(text.layers):
            if i == cut:
                hidden, positions, types = hidden[:, keep], positions[:, keep], types[:, keep]
                ids = get_block_sequence_ids_for_mask(types if blocks else torch.zeros_like(types))
                masks = create_masks_for_vision_model(text.config, hidden, None, None, None, ids)
            kind = text.config.layer_types[i]
            hidden = layer(hidden, attention_mask=masks[kind], position_embeddings=text.rotary_emb(
                hidden, positions, kind), position_ids=positions)
        return model.lm_head(text.norm(hidden))[0, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("cut", [0, 1, 3])  # before a sliding layer, and before the full-attention one
def test_after_a_drop_the_image_block_sliding_windows_and_rotary_tables_stay_consistent(cut, attn):
    """One cut entering layer `cut` (no merge): the logits equal the stock layers run by hand on the kept tokens with
    the stock masks of the kept sequence (bidirectional within the kept image tokens, windows of 8) and each kind's
    rotary table; without the image block they would differ."""
    model, processor = gemma3(attn, layers=8)
    batch = inputs(processor, [QUESTION], [SIZES[0]])
    config = hap.HAPConfig(retain=0.6, first_layers=cut, groups=1, merge="none")
    with hap.patched(model, config) as patch, torch.no_grad():
        logits = model(**batch).logits[0, -1]
        keep = patch.origin[0]
    assert [c.layer for c in patch.state.cuts] == [cut]
    assert len(keep) > model.config.text_config.sliding_window  # the windows still cut the kept sequence
    assert (logits - by_hand(model, batch, keep, cut)).abs().max().item() < 1e-5
    assert (logits - by_hand(model, batch, keep, cut, blocks=False)).abs().max().item() > 1e-4


def test_a_planted_square_lands_where_the_layout_and_the_drawn_map_say():
    """A bright square changes most the pooled token whose layout box holds its centre; the drawn map's hottest cell
    sits over the square's pixels."""
    model, processor = gemma3()
    square = (104, 36, 134, 66)  # 30 px: at least one pooled 28 x 28 cell of the squashed image inside it
    check_planted_square(model, processor, (100, 170), square, views_expected=1, grid=(4, 4), retain=0.4)


def test_the_pipeline_and_the_cli_run_a_saved_model(tmp_path, capsys):
    model, processor = gemma3()
    image = square_image((120, 90), (10, 10, 30, 30))
    result = hap.run(model, processor, image, QUESTION, hap.HAPConfig(retain=0.4, groups=2), max_new_tokens=3)
    assert result.num_visual == Layout.from_dict(result.layout).num_visual == 16
    check_cli(model, processor, (120, 90), tmp_path, capsys, retain=0.4)


def test_sliding_layers_cost_less_attention_and_the_shape_says_which():
    model, _ = gemma3(layers=8)
    shape = decoder_shape(model)
    assert shape.windows == (8, 8, 8, None) * 2 and shape.kv_dim == 2 * 16
    full = DecoderShape(shape.layers, shape.hidden, shape.intermediate, shape.kv_dim, q_dim=shape.q_dim)
    assert layer_flops(100, shape, 8) < layer_flops(100, full)
    assert prefill_flops([16] * 8, 30, shape) < prefill_flops([16] * 8, 30, full)


@pytest.mark.slow
def test_the_4b_decoder_shape_cuts_to_the_budget():
    """Gemma 3 4B's decoder (2560 wide, 8 query / 4 KV heads of 256, FFN 10240, window 1024, 5 sliding : 1 full) on
    6 layers and its real 256 tokens per image; the schedule, the cut and the FLOPs (GQA, q width 2048 != hidden,
    windows) agree."""
    text = dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                query_pre_attn_scalar=256, max_position_embeddings=8192, sliding_window=1024,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                 "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}})
    model, processor = gemma3(layers=6, text=text, tokens=256, image_size=896, every=6)
    batch = inputs(processor, [QUESTION], [(480, 640)])
    N = int(visual_tokens(model, batch).sum())
    assert N == 256
    shape = decoder_shape(model)
    assert shape.kv_dim == 4 * 256 and shape.q_dim == 8 * 256 and shape.windows == (1024,) * 5 + (None,)
    config = hap.HAPConfig(retain=0.5, first_layers=1, groups=1)
    with hap.patched(model, config) as patch, torch.no_grad():
        model(**batch, use_cache=True)
    schedule = patch.state.schedule
    assert schedule.num_visual == N and schedule.retained_tokens <= 0.5 * N
    assert patch.cache.layers[-1].keys.shape[2] == batch["input_ids"].shape[1] - (N - schedule.kept[0])
    text_tokens = batch["input_ids"].shape[1] - N
    assert schedule.flops_ratio(text_tokens, shape) == pytest.approx(
        prefill_flops(schedule.visual_per_layer, text_tokens, shape) / prefill_flops([N] * 6, text_tokens, shape))
