"""DivPrune, VisPruner and CDPruner on LLaVA-NeXT as their official LLaVA-1.6 code runs them (docs/method.md §7), on a
tiny random LLaVA-NeXT with a CLIP tower (2 layers: the feature layer -2 is a layer's output). The cues are captured
here without the executor (the tower run on the crops with `output_attentions`, the packed tokens from the model's own
`get_image_features`), the rules are the references of `test_frontier_rules` (plain loops from the notes), and the
official packing is written out: each crop's index mask put through the official stitching and `unpad_image`, a
newline column added, as the official `prepare_inputs_labels_for_multimodal` does."""

from __future__ import annotations

import pytest
import torch
from test_frontier_pruners import QUESTION, save_clip
from test_frontier_rules import clip_folder as small_clip  # noqa: F401 (a fixture: the rules' tiny CLIP folder)
from test_frontier_rules import ref_cdpruner, ref_divprune, ref_relevance, ref_vispruner
from tiny_zoo import llava_next, picture
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

import hap
from hap.planning.budget import plan
from hap.patch.decoder import decoder_shape
from hap.runs.run import chat_prompt

torch.set_num_threads(1)
SIZES = ((112, 140), (40, 40))  # a 2 x 2 canvas cut to 6 x 8 tokens; a 1 x 2 canvas cut to 4 x 4 (2 x 1 leaves 4 x 4)


@pytest.fixture(scope="module")
def model():
    return llava_next("eager", vision_layers=2)


@pytest.fixture(scope="module", params=SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def case(request, model):
    """The image, its inputs and what the official code sees: per crop the head-mean [CLS] row of the feature layer
    [crops, n], its patches [crops, n, Dv] and their projection [crops, n, D]; the packed image tokens [N + R, D]; the
    official packing of a per-crop mask (`pack`) and the budget's count k of the N visual tokens at retain 0.25."""
    m, processor = model
    image = picture(request.param)
    inputs = processor(images=image, text=chat_prompt(processor, QUESTION), return_tensors="pt")
    cfg = m.config
    with torch.no_grad():
        pixels = inputs["pixel_values"][0]
        out = m.model.vision_tower(pixels, output_attentions=True, output_hidden_states=True)
        packed = m.model.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                                            vision_feature_layer=cfg.vision_feature_layer,
                                            vision_feature_select_strategy=cfg.vision_feature_select_strategy
                                            ).pooler_output[0]
        layer = cfg.vision_feature_layer % len(out.hidden_states)
        patches = out.hidden_states[layer][:, 1:]
        projected = m.model.multi_modal_projector(patches)
    newline = (packed == m.model.image_newline).all(-1)  # [N + R]
    side = cfg.vision_config.image_size // cfg.vision_config.patch_size
    size = inputs["image_sizes"][0].tolist()
    tiles_h, tiles_w = get_anyres_image_grid_shape(size, cfg.image_grid_pinpoints, cfg.vision_config.image_size)

    def pack(mask: torch.Tensor) -> torch.Tensor:
        """bool [crops, n] -> bool [N + R]: the official index mask after stitching, unpadding and the newlines."""
        tiles = mask[1:].view(tiles_h, tiles_w, side, side).permute(0, 2, 1, 3).flatten(0, 1).flatten(1, 2)
        tiles = unpad_image(tiles[None], size)[0]
        tiles = torch.cat([tiles, torch.ones(tiles.shape[0], 1, dtype=torch.bool)], 1)
        return torch.cat([mask[0], tiles.flatten()])

    N = int((~newline).sum())
    s = plan(hap.HAPConfig(method="vispruner", retain=0.25), decoder_shape(m), N,
             inputs["input_ids"].shape[1] - N)
    return {"image": image, "inputs": inputs, "cls": out.attentions[layer - 1][:, :, 0, 1:].mean(1),
            "patches": patches, "projected": projected, "packed": packed, "newline": newline, "pack": pack,
            "k": (s.planned or s.kept)[0], "tiles": (tiles_h, tiles_w)}


def run(model, case, **knobs) -> hap.Result:
    m, processor = model
    return hap.run(m, processor, case["image"], QUESTION, hap.HAPConfig(retain=0.25, **knobs), max_new_tokens=2,
                   trace=False)


def visual_indices(case, image_ids: list[int]) -> list[int]:
    """The visual indices (newlines not counted) of the image tokens `image_ids` that are no newline."""
    newline = case["newline"]
    before = newline.long().cumsum(0) - newline.long()
    return [i - int(before[i]) for i in image_ids if not newline[i]]


def official_per_crop(case, picks: list[list[int]]) -> list[int]:
    """The visual indices the official code keeps from each crop's `picks` (patch indices)."""
    mask = torch.zeros(case["cls"].shape, dtype=torch.bool)
    for crop, chosen in enumerate(picks):
        mask[crop, chosen] = True
    return visual_indices(case, case["pack"](mask).nonzero()[:, 0].tolist())


def test_the_unpadding_cuts_patches_of_the_tiles_and_the_small_image_is_a_one_by_two_canvas(case):
    N = len(case["packed"]) - int(case["newline"].sum())
    assert N < case["cls"].numel() == 16 * (1 + case["tiles"][0] * case["tiles"][1])
    if case["image"].size == (40, 40):
        assert case["tiles"] == (1, 2)  # its 4 x 4 grid is what a 2 x 1 canvas would leave too


def test_divprune_selects_over_the_newline_tokens_at_the_official_ratio(model, case):
    r = run(model, case, method="divprune")
    n_all, R = len(case["packed"]), int(case["newline"].sum())
    N, k = n_all - R, case["k"]
    total = int(round(k / N * n_all))  # the budget's ratio over every token it selects over
    picks = ref_divprune(case["packed"], total)
    assert len(picks) == len(set(picks)) == total
    lines = sum(bool(case["newline"][i]) for i in picks)
    assert r.groups[0].kept == visual_indices(case, picks) and len(r.groups[0].kept) == total - lines
    assert lines <= 1  # the newlines are one learned vector: the max-min rule keeps at most one of them
    assert r.retained_tokens == total - lines - (R - lines)  # the accounting: visual kept less newlines dropped
    m, _ = model
    with hap.patched(m, hap.HAPConfig(method="divprune", retain=0.25)) as patch, torch.no_grad():
        m.generate(**case["inputs"], max_new_tokens=1, do_sample=False)
    T = case["inputs"]["input_ids"].shape[1]  # the prefill's cache holds the text, newlines included, and that count
    assert patch.cache.layers[0].keys.shape[2] == T - N + patch.state.schedule.kept[0] == T - n_all + total


def test_vispruner_selects_per_crop_before_the_unpadding(model, case):
    r = run(model, case, method="vispruner")
    crops = case["cls"].shape[0]
    t = case["k"] // crops  # T per crop
    picks = [ref_vispruner(a, f, t) for a, f in zip(case["cls"], case["patches"])]
    expected = official_per_crop(case, picks)
    assert r.groups[0].kept == expected and len(expected) <= crops * t
    assert r.retained_tokens == len(expected)  # the realised count in the accounting
    m, _ = model
    with hap.patched(m, hap.HAPConfig(method="vispruner", retain=0.25)) as patch, torch.no_grad():
        m(**case["inputs"])  # a plain forward: the tiles from the images' sizes, not from the packed features
    assert patch.state.kept_orig[0].tolist() == expected


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory, small_clip):
    return save_clip(tmp_path_factory.mktemp("clip_next"), small_clip)


def test_cdpruner_selects_per_crop_with_the_relevance_normalised_over_all_crops(model, case, clip_folder):
    from transformers import AutoTokenizer, CLIPModel

    m, _ = model
    r = run(model, case, method="cdpruner", clip_model=str(clip_folder))
    clip, tok = CLIPModel.from_pretrained(clip_folder).eval(), AutoTokenizer.from_pretrained(clip_folder)
    ids = tok(QUESTION)["input_ids"]
    rows = [ids[i:i + 8] for i in range(0, len(ids), 8)]
    with torch.no_grad():
        text = torch.cat([clip.get_text_features(input_ids=torch.tensor([row + [0] * (8 - len(row))]),
                                                 attention_mask=torch.tensor([[1] * len(row) + [0] * (8 - len(row))]))
                          .pooler_output for row in rows])
        image = clip.visual_projection(m.model.vision_tower.post_layernorm(case["patches"]))  # [crops, n, E]
    relevance = ref_relevance(list(image), text)  # min and max over every token of every crop
    t = case["k"] // len(relevance)
    picks = [ref_cdpruner(x, rel, t) for x, rel in zip(case["projected"], relevance)]
    assert r.groups[0].kept == official_per_crop(case, picks)
    assert r.retained_tokens == len(r.groups[0].kept)


def test_divprune_on_onevision_selects_over_the_newlines_too():
    """Carried over to LLaVA-OneVision (SigLIP, no official code): the same one selection over every token of the
    image, newlines included, at the same count."""
    from tiny_zoo import llava_onevision

    m, processor = llava_onevision("eager")
    image = picture((336, 280))
    inputs = processor(images=image, text=chat_prompt(processor, QUESTION), return_tensors="pt")
    cfg = m.config
    with torch.no_grad():
        packed = m.model.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                                            vision_feature_layer=cfg.vision_feature_layer,
                                            vision_feature_select_strategy=cfg.vision_feature_select_strategy
                                            ).pooler_output[0]
    newline = (packed == m.model.image_newline).all(-1)
    N, R = int((~newline).sum()), int(newline.sum())
    k = int(0.25 * N)
    r = hap.run(m, processor, image, QUESTION, hap.HAPConfig(method="divprune", retain=k / N), max_new_tokens=2,
                trace=False)
    picks = ref_divprune(packed, int(round(k / N * (N + R))))
    assert r.groups[0].kept == visual_indices({"newline": newline}, picks)


@pytest.mark.parametrize("method", ["divprune", "vispruner"])
def test_a_batch_keeps_what_each_image_keeps_alone(model, method):
    """Two images of different sizes (equal visual counts) in one `generate`: each sample's crops found among the
    tower's (the tile canvases recovered from the packed features) and selected as alone."""
    from tiny_zoo import inputs

    m, processor = model
    questions, sizes = [QUESTION, "is there a red square ?"], [(112, 112), (140, 140)]
    config = hap.HAPConfig(method=method, retain=0.3)
    with hap.patched(m, config) as patch, torch.no_grad():
        m.generate(**inputs(processor, questions, sizes, [0, 1]), max_new_tokens=2, do_sample=False)
    together = patch.state.cuts[0].kept
    for b in range(2):
        with hap.patched(m, config) as patch, torch.no_grad():
            m.generate(**inputs(processor, questions[b:b + 1], sizes[b:b + 1], [b]), max_new_tokens=2, do_sample=False)
        assert torch.equal(together[b], patch.state.cuts[0].kept[0])


def test_the_other_cls_methods_and_an_unpaired_clip_are_refused_by_name(model):
    from hap.patch import refusal

    m, _ = model
    for method in ("visionzip", "autoprune"):  # one [CLS] row would rank every visual token: none exists here
        assert "no single [CLS] row ranks them" in refusal(m, hap.HAPConfig(method=method, retain=0.3))
    why = refusal(m, hap.HAPConfig(method="cdpruner"))  # the default CLIP-L/336 against a 32-wide tower
    assert "LlavaNextForConditionalGeneration" in why and "CLIP-L/336" in why
    assert refusal(m, hap.HAPConfig(method="vispruner", retain=0.3)) is None


@pytest.mark.parametrize("size", [(375, 500), (500, 375), (200, 200), (1000, 300), (336, 1100), (700, 700)])
def test_crop_places_follow_the_packing_at_the_real_llava_v16_geometry(size):
    """336-px tiles of 24 x 24 patches on llava-v1.6's canvases: each crop's patch lands where transformers'
    `pack_image_features` puts it (features numbered crop * 1000 + patch; newlines -1), or nowhere when unpadded."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextModel

    from hap.patch.llava_next import crop_places

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    config = LlavaNextConfig(vision_config=CLIPVisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                                            num_attention_heads=1, image_size=336, patch_size=14),
                             text_config=LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                                     num_hidden_layers=1, num_attention_heads=1),
                             image_grid_pinpoints=pinpoints)
    model = LlavaNextModel(config)
    tiles = get_anyres_image_grid_shape(list(size), pinpoints, 336)
    crops = 1 + tiles[0] * tiles[1]
    ids = (torch.arange(crops)[:, None] * 1000 + torch.arange(576)[None]).float()[..., None]  # [crops, 576, 1]
    packed = model.pack_image_features([ids], torch.tensor([size]), "default", torch.tensor([-1.0]))[0][0][:, 0]
    visual = packed[packed >= 0].long().tolist()  # the crop * 1000 + patch of each visual token, in order
    rows = int((packed < 0).sum())
    places = crop_places(24, tiles, (rows, (len(visual) - 576) // rows))
    expected = torch.full((crops, 576), -1)
    for index, code in enumerate(visual):
        expected[code // 1000, code % 1000] = index
    assert torch.equal(places, expected)
