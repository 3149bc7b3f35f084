"""The tiled families (issue 37) on tiny random models: stock equality when nothing is pruned (SDPA and eager), every
method runs or is refused by the model's name, batches, the layout of the visual tokens on the uploaded image (a
planted bright square found where the drawn map says), the full pipeline and the CLI."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

import hap
from hap import views
from hap.planning.flops import DecoderShape, layer_flops, prefill_flops
from hap.knobs import METHODS
from hap.layout import Layout
from hap.patch import decoder_of, layout, refusal, visual_tokens
from hap.patch.decoder import decoder_shape
from hap.pruners import pruner_for
from hap.runs.run import chat_prompt, template_tail
from tiny_models import uniform_importance
from tiny_zoo import SIZES, ZOO, inputs
from tiny_zoo_more import ZOO as MORE
from tiny_zoo_recent import gemma3, qwen3_vl

QUESTION = "what color is the circle ?"
FAMILIES = list(ZOO)
TOWER = ("scope", "holov", "prunesid", "hiprune")  # the 2025-26 tower readers: [CLS] cues
REFUSED = {  # family -> methods refused before any work, each message naming the model class
    "llava-next": {"visionzip", "autoprune", "vispruner", "cdpruner", *TOWER},  # no one [CLS] (downsample pools each
    "llava-next-mistral": {"visionzip", "autoprune", "vispruner", "cdpruner", *TOWER},  # view; the 1-layer tower's
    "llava-onevision": {"visionzip", "autoprune", "vispruner", "cdpruner", *TOWER},  # feature layer -2 is no layer's
}


def greedy(model, batch, steps: int = 4):
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_pruned_reproduces_the_stock_model(family, attn):
    model, processor = ZOO[family](attn)
    check_unpruned_is_stock(model, inputs(processor, [QUESTION], [SIZES[family][0]]))


def check_unpruned_is_stock(model, batch) -> None:
    """Patched with nothing to prune (method none; retain 1 in two groups; retain 1 from layer 0), `model` gives the
    stock logits and greedy decoding of `batch`."""
    with torch.no_grad():
        ref = model(**batch).logits
    ref_tokens, ref_steps = greedy(model, batch)
    for config in (hap.HAPConfig(method="none"), hap.HAPConfig(retain=1.0, groups=2),
                   hap.HAPConfig(retain=1.0, first_layers=0)):
        with hap.patched(model, config, trace=True):
            with torch.no_grad():
                logits = model(**batch).logits
            tokens, steps = greedy(model, batch)
        assert (logits - ref).abs().max().item() < 1e-5
        assert (steps - ref_steps).abs().max().item() < 1e-5
        assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_runs_or_is_refused_by_name(family, method):
    model, processor = ZOO[family]()
    check_method(model, processor, SIZES[family][0], method, method in REFUSED[family])


def method_config(model, method: str, retain: float) -> hap.HAPConfig:
    """`method` at `retain`; a method that weights heads by a static head importance (hawk) gets a uniform one of
    `model`'s shape (these models carry no file)."""
    config = hap.HAPConfig(method=method, retain=retain)
    if pruner_for(config).static_heads:
        config = replace(config, head_importance=uniform_importance(model))
    return config


def check_method(model, processor, size: tuple[int, int], method: str, refused: bool) -> None:
    """`method` is refused by the model's class name before any work (`refused`), or runs a generate on an image of
    `size` = (height, width) and leaves the last layer's cache shorter than the prompt (`method_config`)."""
    config = method_config(model, method, 0.3)
    why = refusal(model, config)
    if refused:
        assert why is not None and type(model).__name__ in why
        return
    assert why is None
    batch = inputs(processor, [QUESTION], [size])
    with hap.patched(model, config, tail=template_tail(processor)) as patch:
        tokens, steps = greedy(model, batch, 3)
    assert torch.isfinite(steps).all() and tokens.shape[1] == batch["input_ids"].shape[1] + 3
    if method != "none":  # the last layer's cache really is shorter than the prompt
        cached = patch.cache.layers[-1].keys.shape[2]
        assert cached < batch["input_ids"].shape[1] + 3 - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_two_image_sizes_selects_as_each_sample_alone(family):
    model, processor = ZOO[family]()
    check_batch_selects_as_alone(model, processor, list(SIZES[family]))


def check_batch_selects_as_alone(model, processor, sizes: list[tuple[int, int]]) -> None:
    """A batch of two images of `sizes` (equal visual-token counts) keeps at every cut what each sample alone keeps."""
    batch = inputs(processor, [QUESTION, "is there a red square ?"], sizes, [0, 1])
    config = hap.HAPConfig(retain=0.3, groups=2)
    with hap.patched(model, config) as patch, torch.no_grad():
        model(**batch)
        together = [c.kept for c in patch.state.cuts]
    for b in range(2):
        alone = inputs(processor, [[QUESTION, "is there a red square ?"][b]], [sizes[b]], [b])
        with hap.patched(model, config) as patch, torch.no_grad():
            model(**alone)
        assert all(torch.equal(t[b], c.kept[0]) for t, c in zip(together, patch.state.cuts))


def test_a_batch_of_unequal_visual_counts_is_refused_before_any_work():
    model, processor = ZOO["llava-onevision"]()
    batch = inputs(processor, [QUESTION, QUESTION], [(168, 140), (300, 400)])
    counts = visual_tokens(model, batch).sum(1)
    assert counts[0] != counts[1]
    with hap.patched(model, hap.HAPConfig(retain=0.3)), pytest.raises(ValueError, match="same number of visual"):
        model(**batch)


def local_tower(model) -> None:
    """Zero every vision layer's attention output and MLP output: each patch's feature then depends on its own pixels
    only (and its position), so a bright square changes only the tokens whose patches it covers."""
    tower = getattr(model.model, "vision_tower", None) or model.model.vision_model  # Idefics3 / SmolVLM: vision_model
    for module in tower.modules():
        for name in ("out_proj", "fc2", "o_proj", "projection_layer"):
            linear = getattr(module, name, None)
            if isinstance(linear, torch.nn.Linear):
                torch.nn.init.zeros_(linear.weight)
                if linear.bias is not None:
                    torch.nn.init.zeros_(linear.bias)


def square_image(size: tuple[int, int], box: tuple[int, int, int, int] | None) -> Image.Image:
    """A grey image of (height, width) with a white rectangle (x0, y0, x1, y1) pixels, or none."""
    pixels = np.full((*size, 3), 90, np.uint8)
    if box is not None:
        x0, y0, x1, y1 = box
        pixels[y0:y1, x0:x1] = 255
    return Image.fromarray(pixels)


def decoder_input(model, batch) -> torch.Tensor:
    """[T, D] the decoder's input embeddings of sample 0."""
    seen = []
    hook = decoder_of(model).register_forward_pre_hook(lambda m, a, k: seen.append(k["inputs_embeds"][0]),
                                                        with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_planted_square_lands_where_the_layout_and_the_drawn_map_say(family):
    """Write a bright square into the image: the visual tokens it changes most, in each view, have layout boxes
    holding the square's centre, and on every drawn panel the hottest cell sits over the square's pixels."""
    model, processor = ZOO[family]()
    # not a tile multiple: unpadding and, for the tiles, a box beyond the image
    check_planted_square(model, processor, (100, 170), (104, 36, 114, 46))


def check_planted_square(model, processor, size: tuple[int, int], square: tuple[int, int, int, int],
                         views_expected: int = 2, grid: tuple[int, int] | None = None, retain: float = 0.3,
                         localize=None) -> None:
    """A white `square` (x0, y0, x1, y1) pixels on a grey image of `size` = (height, width), through a vision tower
    made local (`localize(model)`, default `local_tower`): in each of the layout's `views_expected` views (the first
    of `grid` (rows, cols) tokens, where given) the token it changes most has a box holding the square's centre, and
    every panel the pipeline draws at `retain` shows the square under its hottest cell."""
    (localize or local_tower)(model)
    height, width = size
    centre = ((square[0] + square[2]) / 2 / width, (square[1] + square[3]) / 2 / height)
    image = square_image((height, width), square)
    prompt = chat_prompt(processor, QUESTION)
    batch = processor(images=image, text=prompt, return_tensors="pt")
    plain = processor(images=square_image((height, width), None), text=prompt, return_tensors="pt")
    visual = visual_tokens(model, batch)[0]
    change = (decoder_input(model, batch) - decoder_input(model, plain))[visual].norm(dim=-1).numpy()
    where = layout(model, batch, image.size)
    where.check()
    boxes = where.boxes()
    assert len(where.views) == views_expected and grid in (None, where.views[0].grid)
    for view in covering(where.views, centre):
        tokens = np.asarray(view.tokens)
        hottest = tokens[tokens >= 0][np.argmax(change[tokens[tokens >= 0]])]
        x0, y0, x1, y1 = boxes[hottest]
        assert x0 <= centre[0] <= x1 and y0 <= centre[1] <= y1, (view.name, boxes[hottest], centre)
    check_square_under_hottest_cells(model, processor, image, change, retain, centre)


def covering(token_views, centre: tuple[float, float]) -> list:
    """The views of a layout whose box holds the point `centre` (x, y), fractions of the image (all of a layout whose
    every view spans the image; the crops holding it of Gemma 3's pan-and-scan)."""
    return [v for v in token_views if v.box[0] <= centre[0] <= v.box[2] and v.box[1] <= centre[1] <= v.box[3]]


def check_square_under_hottest_cells(model, processor, image: Image.Image, change: np.ndarray,
                                     retain: float = 0.3, centre: tuple[float, float] | None = None) -> None:
    """Drawn by the pipeline's views (a run at `retain`), the per-token `change [N]` has its hottest cell of every
    panel over the white square of `image` (where given, of every panel whose view holds the square's `centre`)."""
    result = hap.run(model, processor, image, QUESTION, hap.HAPConfig(retain=retain), max_new_tokens=2)
    data = views.ViewData.from_result(result, image)
    drawn = data.panels("planted", change)
    if centre is not None and data.layout is not None:
        kept = covering(data.layout.views, centre)
        drawn = [panel for panel, view in zip(drawn, data.layout.views) if view in kept]
    for panel in drawn:
        rows, cols = panel.grid or data.grid  # one view over the whole image: the run's grid
        r, c = np.unravel_index(np.nanargmax(panel.scores), (rows, cols))
        h, w = panel.view.shape[:2]
        under = panel.view[r * h // rows:(r + 1) * h // rows, c * w // cols:(c + 1) * w // cols]
        assert under.max() > 200, panel.title  # the white square shows under the hottest cell


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pipeline_draws_every_view_once_per_image_view(family, tmp_path):
    check_pipeline(*ZOO[family](), (120, 90), tmp_path)


def check_pipeline(model, processor, size: tuple[int, int], tmp_path, views_expected: int = 2) -> None:
    """`hap.run` on an image of `size` = (height, width): its layout counts the image's visual tokens, its retained
    share is against them, and every view draws one panel per image view (`views_expected`) and exports."""
    image = square_image(size, (10, 10, 30, 30))
    result = hap.run(model, processor, image, QUESTION, hap.HAPConfig(retain=0.3, groups=2), max_new_tokens=3)
    where = Layout.from_dict(result.layout)
    assert result.num_visual == where.num_visual == int(visual_tokens(
        model, processor(images=image, text=result.prompt_text, return_tensors="pt")).sum())
    assert result.retain == pytest.approx(result.retained_tokens / where.num_visual)
    data = views.ViewData.from_result(result, image)
    assert len(views.head_map_panels(data).panels) == views_expected * result.num_heads
    assert len(views.mask_panels(data).panels) == views_expected * len(result.groups)
    figures = views.figures(data)
    assert set(figures) == {v.name for v in views.VIEWS}
    assert len(views.export_png(data, tmp_path)) == len(views.VIEWS)


@pytest.mark.parametrize("family", ["llava-next", "llava-onevision"])
def test_the_cli_runs_a_saved_model(family, tmp_path, capsys):
    model, processor = ZOO[family]()
    check_cli(model, processor, (120, 90), tmp_path, capsys)


def check_cli(model, processor, size: tuple[int, int], tmp_path, capsys, retain: float = 0.3) -> None:
    """`python -m hap run --model FOLDER --retain RETAIN` on `model` and `processor` saved there, an image of `size` =
    (height, width): it answers, writes its figures and reports the image's visual-token count."""
    from hap.__main__ import main

    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    image = square_image(size, (10, 10, 30, 30))
    image.save(tmp_path / "image.png")
    code = main(["run", "--model", str(tmp_path / "model"), "--image", str(tmp_path / "image.png"), "--prompt",
                 QUESTION, "--retain", str(retain), "--max-new-tokens", "2", "--device", "cpu",
                 "--json", str(tmp_path / "out.json"), "--figures", str(tmp_path / "figures")])
    assert code == 0, capsys.readouterr().err
    batch = processor(images=image, text=chat_prompt(processor, QUESTION), return_tensors="pt")
    assert f"visual tokens: {layout(model, batch, image.size).num_visual}" in capsys.readouterr().out


def test_sliding_window_layers_cost_less_attention_and_the_shape_says_which():
    model, _ = ZOO["llava-next-mistral"]()
    shape = decoder_shape(model)
    assert shape.windows == (24,) * 4
    full = DecoderShape(shape.layers, shape.hidden, shape.intermediate, shape.kv_dim, q_dim=shape.q_dim)
    assert layer_flops(100, shape, 24) < layer_flops(100, full)
    assert layer_flops(20, shape, 24) == layer_flops(20, full)  # a sequence inside the window: no difference
    assert prefill_flops([80] * 4, 18, shape) < prefill_flops([80] * 4, 18, full)
    gqa = decoder_shape(ZOO["llava-onevision"]()[0])
    assert gqa.kv_dim == 2 * 16 and gqa.windows == ()


@pytest.mark.slow
def test_onevision_at_the_05b_decoder_shape_cuts_to_the_budget():
    """LLaVA-OneVision-0.5B's decoder (Qwen2 896 / 14 heads / 2 KV / 4864) on 3 layers and its real 384-px tiles
    (27 x 27 tokens each): a 336 x 336 image gives the real 1485 tokens; the schedule, the cut and the FLOPs agree."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config, SiglipVisionConfig
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    from analysis.training.tiny_vlm import CHAT_TEMPLATE, build_tokenizer
    from hap.patch.processors import OnevisionImageProcessor

    tok = build_tokenizer()
    pins = [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)]
    processor = OnevisionImageProcessor(LlavaOnevisionImageProcessorPil(size={"height": 384, "width": 384},
                                                                        image_grid_pinpoints=pins), tok,
                                        num_image_tokens=729, vision_feature_select_strategy="full",
                                        chat_template=CHAT_TEMPLATE)
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=384, patch_size=14, vision_use_head=False),
        text_config=Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864, num_hidden_layers=3,
                                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096),
        image_token_index=tok.image_token_id, image_grid_pinpoints=pins, vision_feature_layer=-1,
        vision_feature_select_strategy="full")
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    batch = inputs(processor, [QUESTION], [(336, 336)])
    assert int((batch["input_ids"] == tok.image_token_id).sum()) == 1485  # the 5.24 processor's real count
    N = int(visual_tokens(model, batch).sum())
    assert N == 1485 - 27  # 27 newline tokens kept out of the budget
    check_cut_to_budget(model, batch)


def check_cut_to_budget(model, batch) -> None:
    """On a 3-layer `model`, retain=0.5 from layer 1 in one group, over the image's own N visual tokens: the schedule
    keeps at most half of them, the last layer caches the prompt less the dropped ones, and the FLOPs ratio is the
    pruned prefill's over the unpruned one's."""
    N = int(visual_tokens(model, batch).sum())
    with hap.patched(model, hap.HAPConfig(retain=0.5, first_layers=1, groups=1)) as patch, torch.no_grad():
        model(**batch, use_cache=True)
    schedule = patch.state.schedule
    assert schedule.num_visual == N and schedule.retained_tokens <= 0.5 * N
    assert patch.cache.layers[-1].keys.shape[2] == batch["input_ids"].shape[1] - (N - schedule.kept[0])
    shape = decoder_shape(model)
    text = batch["input_ids"].shape[1] - N
    assert schedule.flops_ratio(text, shape) == pytest.approx(
        prefill_flops(schedule.visual_per_layer, text, shape) / prefill_flops([N] * 3, text, shape))


SERVED = {  # family -> (builder of the model the app serves, (height, width) of the photo, its views)
    "llava-next": (ZOO["llava-next"], (120, 90), 2), "llava-onevision": (ZOO["llava-onevision"], (120, 90), 2),
    "internvl": (MORE["internvl"], (100, 170), 2), "idefics3": (MORE["idefics3"], (100, 170), 2),
    "qwen3-vl": (qwen3_vl, (240, 180), 1), "gemma3": (gemma3, (240, 180), 1)}  # Qwen3-VL: 8 x 6 tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app serving a saved tiny model of each family (local folders allowed), and their names."""
    import os

    from app.app import build_demo, launch_options
    from app_model import free_port
    from gradio_client import Client

    os.environ["HAP_APP_ALLOW_LOCAL"] = "1"
    names = {}
    for family, (build, _, _) in SERVED.items():
        folder = tmp_path_factory.mktemp(family)
        model, processor = build(layers=4)
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        names[family] = str(folder)
    demo = build_demo(list(names.values()))
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options())
    yield Client(url, verbose=False), names
    demo.close()


@pytest.mark.parametrize("family", list(SERVED))
def test_the_app_analyzes_and_sweeps_a_tiled_model(served, family, tmp_path):
    """`/analyze` (with the causal section and head utility) and `/sweep` on a random model of the class: the maps
    come in panels per image view (two for the tiled families, one for Qwen3-VL and Gemma 3), the token importance
    covers every visual token."""
    from app.present import OUTPUTS
    from gradio_client import handle_file

    client, names = served
    photo = tmp_path / "photo.png"
    _, size, views_seen = SERVED[family]
    square_image(size, (10, 10, 30, 30)).save(photo)
    knobs = dict(retain=0.3, groups=2, first_layers=1)
    out = dict(zip(OUTPUTS, client.predict(image=handle_file(str(photo)), prompt=QUESTION, model_name=names[family],
                                           method="hap", **knobs, api_name="/analyze")))
    report = out["summary"]
    where = Layout.from_dict(report["layout"])
    assert report["num_visual"] == where.num_visual and len(where.views) == views_seen
    assert len(report["causal"]["token_importance"]) == where.num_visual
    assert report["head_utility"]["values"]
    import json
    masks = json.loads(out["kept_masks"]["plot"])["layout"]["images"]
    assert len(masks) == len(where.views) * len(report["groups"])  # per view and group
    figure, data = client.predict(image=handle_file(str(photo)), prompt=QUESTION, model_name=names[family],
                                  **{k: v for k, v in knobs.items() if k != "retain"}, api_name="/sweep")
    assert data["methods"]["hap"]["answers"] and "visionzip" not in data["methods"]  # refused for the class
