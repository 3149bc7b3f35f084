"""InternVL (issue 37) on tiny random models (`tiny_zoo_more`): stock equality when nothing is pruned (SDPA and
eager, Qwen2 and Llama decoders), every method runs or is refused by the model's name, batches, the tile / thumbnail
layout of the visual tokens on the uploaded image (a planted bright square found where the drawn map says), the
pipeline, the CLI, and the budget arithmetic at InternVL3-1B's decoder shape and real 448-px tiles."""

import numpy as np
import pytest
import torch

import hap
from hap import views
from hap.budget import prefill_flops
from hap.knobs import METHODS
from hap.layout import Layout
from hap.patch import layout, refusal, visual_tokens
from hap.patch.decoder import decoder_shape
from hap.run import chat_prompt
from test_zoo import (QUESTION, check_square_under_hottest_cells, check_unpruned_is_stock, decoder_input, greedy,
                      local_tower, square_image)
from tiny_zoo import inputs
from tiny_zoo_more import ZOO

FAMILIES = ["internvl", "internvl-llama"]
REFUSED = {"visionzip", "autoprune"}  # the [CLS] cues: each tile encoded on its own, its [CLS] dropped
WIDE, WIDER = (100, 170), (120, 200)  # (height, width): both 2 x 1 tiles + thumbnail = 48 tokens


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_pruned_reproduces_the_stock_model(family, attn):
    model, processor = ZOO[family](attn)
    check_unpruned_is_stock(model, inputs(processor, [QUESTION], [WIDE]))


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_or_is_refused_by_name(method):
    model, processor = ZOO["internvl"]()
    config = hap.HAPConfig(method=method, retain=0.3)
    why = refusal(model, config)
    if method in REFUSED:
        assert why is not None and "InternVLForConditionalGeneration" in why and "[CLS]" in why
        return
    assert why is None
    batch = inputs(processor, [QUESTION], [WIDE])
    with hap.patched(model, config) as patch:
        tokens, steps = greedy(model, batch, 3)
    assert torch.isfinite(steps).all() and tokens.shape[1] == batch["input_ids"].shape[1] + 3
    if method != "none":  # the last layer's cache really is shorter than the prompt
        assert patch.cache.layers[-1].keys.shape[2] < batch["input_ids"].shape[1] + 3 - 1


def test_a_batch_of_two_images_of_equal_tile_counts_selects_as_each_sample_alone():
    model, processor = ZOO["internvl"]()
    questions = [QUESTION, "is there a red square ?"]
    batch = inputs(processor, questions, [WIDE, WIDER], [0, 1])
    assert visual_tokens(model, batch).sum(1).tolist() == [48, 48]
    config = hap.HAPConfig(retain=0.3, groups=2)
    with hap.patched(model, config) as patch, torch.no_grad():
        model(**batch)
        together = [c.kept for c in patch.state.cuts]
    for b, size in enumerate([WIDE, WIDER]):
        with hap.patched(model, config) as patch, torch.no_grad():
            model(**inputs(processor, [questions[b]], [size], [b]))
        assert all(torch.equal(t[b], c.kept[0]) for t, c in zip(together, patch.state.cuts))


def test_a_batch_of_unequal_tile_counts_is_refused_before_any_work():
    model, processor = ZOO["internvl"]()
    batch = inputs(processor, [QUESTION, QUESTION], [WIDE, (480, 640)])
    assert visual_tokens(model, batch).sum(1).tolist() == [48, 80]
    with hap.patched(model, hap.HAPConfig(retain=0.3)), pytest.raises(ValueError, match="same number of visual"):
        model(**batch)


@pytest.mark.parametrize("size, tiles", [((112, 112), None), ((100, 170), (1, 2)), ((300, 100), (3, 1)),
                                         ((480, 640), (2, 2))])
def test_the_layout_has_the_processors_tile_grid_and_the_thumbnail(size, tiles):
    """The tile grid recomputed from the image size is the processor's (its pixel tiles count), the thumbnail comes
    last; a one-tile image (no thumbnail) has one view over the whole image."""
    model, processor = ZOO["internvl"]()
    batch = inputs(processor, [QUESTION], [size])
    where = layout(model, batch, size[::-1])
    where.check()
    assert where.num_visual == int(visual_tokens(model, batch).sum()) == 16 * batch["pixel_values"].shape[0]
    if tiles is None:
        assert len(where.views) == 1 and where.views[0].grid == (4, 4)
        return
    grid, thumbnail = where.views
    assert grid.grid == (4 * tiles[0], 4 * tiles[1]) and thumbnail.grid == (4, 4)
    assert thumbnail.tokens == tuple(range(where.num_visual - 16, where.num_visual))
    assert grid.tokens[:5] == (0, 1, 2, 3, 16 if tiles[1] > 1 else 4)  # the first row crosses into the second tile
    with pytest.raises(ValueError, match="image's"):
        layout(model, batch)


@pytest.mark.parametrize("size, square", [((100, 170), (104, 36, 114, 46)), ((300, 100), (55, 204, 65, 216))])
def test_a_planted_square_lands_where_the_layout_and_the_drawn_map_say(size, square):
    """Write a bright square into the image: the visual tokens it changes most, in each view (tiles, thumbnail),
    have layout boxes holding the square's centre, and on every drawn panel the hottest cell sits over the square."""
    model, processor = ZOO["internvl"]()
    local_tower(model)
    height, width = size
    centre = ((square[0] + square[2]) / 2 / width, (square[1] + square[3]) / 2 / height)
    image = square_image(size, square)
    prompt = chat_prompt(processor, QUESTION)
    batch = processor(images=image, text=prompt, return_tensors="pt")
    plain = processor(images=square_image(size, None), text=prompt, return_tensors="pt")
    visual = visual_tokens(model, batch)[0]
    change = (decoder_input(model, batch) - decoder_input(model, plain))[visual].norm(dim=-1).numpy()
    where = layout(model, batch, image.size)
    boxes = where.boxes()
    assert len(where.views) == 2
    for view in where.views:
        tokens = np.asarray(view.tokens)
        hottest = tokens[np.argmax(change[tokens])]
        x0, y0, x1, y1 = boxes[hottest]
        assert x0 <= centre[0] <= x1 and y0 <= centre[1] <= y1, (view.name, boxes[hottest], centre)
    check_square_under_hottest_cells(model, processor, image, change)


def test_the_pipeline_draws_the_tiles_and_the_thumbnail():
    model, processor = ZOO["internvl"]()
    image = square_image(WIDE, (10, 10, 30, 30))
    result = hap.run(model, processor, image, QUESTION, hap.HAPConfig(retain=0.3, groups=2), max_new_tokens=3)
    where = Layout.from_dict(result.layout)
    assert result.num_visual == where.num_visual == 48
    assert result.retain == pytest.approx(result.retained_tokens / where.num_visual)
    data = views.ViewData.from_result(result, image)
    assert len(views.head_map_panels(data).panels) == 2 * result.num_heads
    assert len(views.mask_panels(data).panels) == 2 * len(result.groups)
    assert set(views.figures(data)) == {v.name for v in views.VIEWS}


def test_the_cli_runs_a_saved_model(tmp_path, capsys):
    from hap.__main__ import main

    model, processor = ZOO["internvl"]()
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    square_image(WIDE, (10, 10, 30, 30)).save(tmp_path / "image.png")
    code = main(["run", "--model", str(tmp_path / "model"), "--image", str(tmp_path / "image.png"), "--prompt",
                 QUESTION, "--retain", "0.3", "--max-new-tokens", "2", "--device", "cpu",
                 "--json", str(tmp_path / "out.json")])
    assert code == 0, capsys.readouterr().err
    assert "visual tokens: 48" in capsys.readouterr().out


@pytest.mark.slow
def test_internvl3_1b_decoder_shape_cuts_to_the_budget():
    """InternVL3-1B's decoder (Qwen2 896 / 14 heads / 2 KV / 4864) on 3 layers and its real 448-px tiles (256 tokens
    each, at most 12 + thumbnail): a 640 x 480 image gives the real 3328 tokens, a 336 x 336 one 256; the schedule,
    the cut and the FLOPs agree, the retained share is against each image's own count."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    _, tiny = ZOO["internvl"]()
    tok = tiny.tokenizer
    processor = type(tiny)(GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True,
                                                     max_patches=12), tok, image_seq_length=256,
                           chat_template=tiny.chat_template)
    config = InternVLConfig(
        vision_config=InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=448, patch_size=14),
        text_config=Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864, num_hidden_layers=3,
                                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192),
        image_token_id=processor.image_token_id)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config).eval()
    shape = decoder_shape(model)
    assert (shape.hidden, shape.kv_dim, shape.q_dim) == (896, 2 * 64, None)
    for size, count in (((480, 640), 3328), ((336, 336), 256)):
        batch = inputs(processor, [QUESTION], [size])
        N = int(visual_tokens(model, batch).sum())
        assert N == count  # the 5.24 processor's real count
        assert layout(model, batch, size[::-1]).num_visual == N
        with hap.patched(model, hap.HAPConfig(retain=0.5, first_layers=1, groups=1)) as patch, torch.no_grad():
            model(**batch, use_cache=True)
        schedule = patch.state.schedule
        assert schedule.num_visual == N and schedule.retained_tokens <= 0.5 * N
        assert patch.cache.layers[-1].keys.shape[2] == batch["input_ids"].shape[1] - (N - schedule.kept[0])
        text = batch["input_ids"].shape[1] - N
        assert schedule.flops_ratio(text, shape) == pytest.approx(
            prefill_flops(schedule.visual_per_layer, text, shape) / prefill_flops([N] * 3, text, shape))
