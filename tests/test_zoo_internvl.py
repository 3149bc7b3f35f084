"""InternVL (issue 37) on tiny random models (`tiny_zoo_more`): stock equality when nothing is pruned (SDPA and
eager, Qwen2 and Llama decoders), every method runs or is refused by the model's name, batches, the tile / thumbnail
layout of the visual tokens on the uploaded image (a planted bright square found where the drawn map says), the
pipeline, the CLI, and the budget arithmetic at InternVL3-1B's decoder shape and real 448-px tiles."""

from types import SimpleNamespace

import pytest
import torch

import hap
from hap.knobs import METHODS
from hap.patch import layout, refusal, visual_tokens
from hap.patch.decoder import decoder_shape
from test_zoo import (QUESTION, check_batch_selects_as_alone, check_cli, check_cut_to_budget, check_method,
                      check_pipeline, check_planted_square, check_unpruned_is_stock)
from tiny_zoo import inputs
from tiny_zoo_more import ZOO

FAMILIES = ["internvl", "internvl-llama"]
REFUSED = {"visionzip", "autoprune", "vispruner", "cdpruner",
           "scope", "holov", "prunesid", "hiprune"}  # the [CLS] cues: each tile encoded on its own, its
#                                                                [CLS] dropped
WIDE, WIDER = (100, 170), (120, 200)  # (height, width): both 2 x 1 tiles + thumbnail = 48 tokens


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_pruned_reproduces_the_stock_model(family, attn):
    model, processor = ZOO[family](attn)
    check_unpruned_is_stock(model, inputs(processor, [QUESTION], [WIDE]))


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_or_is_refused_by_name(method):
    model, processor = ZOO["internvl"]()
    check_method(model, processor, WIDE, method, method in REFUSED)
    if method in REFUSED:
        assert "[CLS]" in refusal(model, hap.HAPConfig(method=method))


def test_a_batch_of_two_images_of_equal_tile_counts_selects_as_each_sample_alone():
    model, processor = ZOO["internvl"]()
    assert visual_tokens(model, inputs(processor, [QUESTION] * 2, [WIDE, WIDER])).sum(1).tolist() == [48, 48]
    check_batch_selects_as_alone(model, processor, [WIDE, WIDER])


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


def test_the_tile_grid_from_the_tile_count_is_the_processors_choice():
    """Over a sweep of image sizes, 448-px tiles and 1..12 (the real default) or 1..4 tiles: the grid the processor picks
    is the one `tile_grid` recomputes from its tile count and the image size alone."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    from hap.patch.internvl import tile_grid

    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(image_size=(448, 448))))
    for most in (4, 12):
        for height in range(20, 2000, 37):
            for width in range(20, 2000, 41):
                cols, rows = get_optimal_tiled_canvas((height, width), (448, 448), 1, most)
                assert tile_grid(model, rows * cols, height, width) == (rows, cols), (most, height, width)


@pytest.mark.parametrize("size, square", [((100, 170), (104, 36, 114, 46)), ((300, 100), (55, 204, 65, 216))])
def test_a_planted_square_lands_where_the_layout_and_the_drawn_map_say(size, square):
    """Write a bright square into the image: the visual tokens it changes most, in each view (tiles, thumbnail),
    have layout boxes holding the square's centre, and on every drawn panel the hottest cell sits over the square."""
    check_planted_square(*ZOO["internvl"](), size, square)


def test_the_pipeline_draws_the_tiles_and_the_thumbnail(tmp_path):
    check_pipeline(*ZOO["internvl"](), WIDE, tmp_path)


def test_the_cli_runs_a_saved_model(tmp_path, capsys):
    check_cli(*ZOO["internvl"](), WIDE, tmp_path, capsys)


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
        check_cut_to_budget(model, batch)
