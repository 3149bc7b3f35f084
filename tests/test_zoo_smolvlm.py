"""SmolVLM / Idefics3 (issue 37) on tiny random models (`tiny_zoo_more`: `Idefics3ForConditionalGeneration` with
the stock `Idefics3Processor`, as SmolVLM-256M declares; `SmolVLMForConditionalGeneration` with the image-only
SmolVLM processor): stock equality when nothing is pruned (SDPA and eager), every method runs or is refused by the
model's name, batches, the crop / global-view layout read from the prompt (a planted bright square found where the
drawn map says), the pipeline, the CLI, and the budget arithmetic at SmolVLM-256M's decoder shape and real crops."""

import pytest
import torch

import hap
from hap.knobs import METHODS
from hap.patch import decoder_of, layout, refusal, visual_tokens
from hap.patch.decoder import decoder_shape
from hap.runs.run import chat_prompt
from test_zoo import (QUESTION, check_batch_selects_as_alone, check_cli, check_cut_to_budget, check_method,
                      check_pipeline, check_planted_square, check_unpruned_is_stock, square_image)
from tiny_zoo import inputs
from tiny_zoo_more import ZOO

FAMILIES = ["idefics3", "smolvlm"]
REFUSED = {"visionzip", "autoprune", "vispruner", "cdpruner",
           "scope", "holov", "prunesid", "hiprune"}  # the [CLS] cues: SigLIP has no [CLS] token
WIDE, WIDER, TALL = (100, 170), (120, 200), (300, 100)  # (height, width): 2 x 2, 2 x 2 and 2 x 1 crops + global


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_pruned_reproduces_the_stock_model(family, attn):
    model, processor = ZOO[family](attn)
    assert decoder_of(model) is model.model.text_model
    check_unpruned_is_stock(model, inputs(processor, [QUESTION], [WIDE]))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_runs_or_is_refused_by_name(family, method):
    model, processor = ZOO[family]()
    check_method(model, processor, TALL, method, method in REFUSED)
    if method in REFUSED:
        assert "[CLS]" in refusal(model, hap.HAPConfig(method=method))


def test_a_batch_of_two_images_of_equal_crop_counts_selects_as_each_sample_alone():
    model, processor = ZOO["idefics3"]()
    assert visual_tokens(model, inputs(processor, [QUESTION] * 2, [WIDE, WIDER])).sum(1).tolist() == [80, 80]
    check_batch_selects_as_alone(model, processor, [WIDE, WIDER])


def test_smolvlm_takes_a_batch_with_its_images_nested_per_prompt():
    """`SmolVLMProcessor` puts a flat list of images into one prompt; nested one list per prompt, a batch of two
    prunes each sample to its own budget."""
    model, processor = ZOO["smolvlm"]()
    processor.tokenizer.padding_side = "left"
    batch = processor(images=[[square_image(WIDE, None)], [square_image(WIDER, (5, 5, 20, 20))]],
                      text=[chat_prompt(processor, QUESTION)] * 2, return_tensors="pt", padding=True)
    assert visual_tokens(model, batch).sum(1).tolist() == [80, 80]
    with hap.patched(model, hap.HAPConfig(retain=0.3, groups=2)) as patch, torch.no_grad():
        model(**batch)
    assert all(cut.kept.shape[0] == 2 for cut in patch.state.cuts)
    assert patch.state.schedule.retained_tokens <= 0.3 * 80 + 1


def test_a_batch_of_unequal_crop_counts_is_refused_before_any_work():
    model, processor = ZOO["idefics3"]()
    batch = inputs(processor, [QUESTION, QUESTION], [WIDE, TALL])
    assert visual_tokens(model, batch).sum(1).tolist() == [80, 48]
    with hap.patched(model, hap.HAPConfig(retain=0.3)), pytest.raises(ValueError, match="same number of visual"):
        model(**batch)


@pytest.mark.parametrize("size, crops", [((100, 170), (2, 2)), ((300, 100), (2, 1)), ((100, 300), (1, 2)),
                                         ((20, 30), (2, 2))])
def test_the_layout_reads_the_crop_grid_from_the_prompt(size, crops):
    """The crop grid read from the prompt's <image> runs is the processor's (upscaled small images included), the
    global view comes last; without splitting there is one view; a prompt whose row ends left no token is refused."""
    model, processor = ZOO["idefics3"]()
    batch = inputs(processor, [QUESTION], [size])
    where = layout(model, batch, size[::-1])
    where.check()
    assert where.num_visual == int(visual_tokens(model, batch).sum()) == 16 * batch["pixel_values"].shape[1]
    grid, global_view = where.views
    assert grid.grid == (4 * crops[0], 4 * crops[1]) and global_view.grid == (4, 4)
    assert global_view.tokens == tuple(range(where.num_visual - 16, where.num_visual))
    assert grid.tokens[:5] == (0, 1, 2, 3, 16 if crops[1] > 1 else 4)  # the first row crosses into the second crop
    whole = processor(images=square_image(size, None), text=chat_prompt(processor, QUESTION), return_tensors="pt",
                      do_image_splitting=False)
    assert [v.grid for v in layout(model, whole, size[::-1]).views] == [(4, 4)]
    newline = processor.tokenizer.convert_tokens_to_ids("\n")
    ids = batch["input_ids"][:, batch["input_ids"][0] != newline]
    with pytest.raises(ValueError, match="newline after each row"):
        layout(model, {"input_ids": ids}, size[::-1])


@pytest.mark.parametrize("size, square", [((100, 170), (104, 36, 114, 46)), ((300, 100), (55, 204, 65, 216))])
def test_a_planted_square_lands_where_the_layout_and_the_drawn_map_say(size, square):
    check_planted_square(*ZOO["idefics3"](), size, square)


def test_the_pipeline_draws_the_crops_and_the_global_view(tmp_path):
    check_pipeline(*ZOO["smolvlm"](), TALL, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cli_runs_a_saved_model(family, tmp_path, capsys):
    check_cli(*ZOO[family](), TALL, tmp_path, capsys)


@pytest.mark.slow
def test_smolvlm_256m_decoder_shape_cuts_to_the_budget():
    """SmolVLM-256M's decoder (Llama 576 / 9 heads / 3 KV / 1536) on 3 layers and its real crops (512 px, 16-px
    patches, shuffle 4: 64 tokens each; longest edge 2048, upscaled): a 336 x 336 image gives the real 1088 tokens, a
    640 x 480 one 832; the schedule, the cut and the FLOPs agree, the retained share is against each image's count."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    _, tiny = ZOO["idefics3"]()
    tok = tiny.tokenizer
    processor = type(tiny)(Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}),
                           tok, image_seq_len=64, chat_template=tiny.chat_template)
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=512, patch_size=16),
        text_config=LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
                                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192),
        image_token_id=processor.image_token_id, scale_factor=4)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    shape = decoder_shape(model)
    assert (shape.hidden, shape.kv_dim, shape.q_dim) == (576, 3 * 64, None)
    for size, count in (((336, 336), 1088), ((480, 640), 832)):
        batch = inputs(processor, [QUESTION], [size])
        N = int(visual_tokens(model, batch).sum())
        assert N == count  # the 5.24 processor's real count
        assert layout(model, batch, size[::-1]).num_visual == N
        check_cut_to_budget(model, batch)
