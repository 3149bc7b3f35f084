"""Processor options (hap.options, hap.patch.processors): each changes the visual-token count exactly as the family's
processor called directly with the same kwargs does, through `hap.run`, the CLI and `/analyze`; a family without
the option refuses it by name; no options is the processor as loaded."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gradio as gr
import pytest
import torch

import hap
from hap.runs.features import FeatureCache, reusing_features
from hap.options import OPTIONS, ProcessorOptions
from hap.patch.processors import option_defaults, processor_options
from hap.runs.run import chat_prompt
from tiny_zoo import NEXT_PINPOINTS, TILE, llava_next, llava_onevision, picture
from tiny_zoo_more import INTERNVL_MAX, SMOL_LONGEST, idefics3, internvl
from tiny_zoo_recent import gemma3, qwen3_vl

PROMPT = "what is here ?"
WIDE = (112, 400)  # (height, width): far from square, so pan-and-scan cuts it and the tilings differ
FAST = hap.HAPConfig(retain=0.5)


def pinpoints(processor, kept: list[list[int]]):
    """A copy of a LLaVA-NeXT / OneVision processor built with the grid pinpoints `kept`: no kwargs."""
    other = copy.deepcopy(processor)
    other.image_processor.image_grid_pinpoints = kept
    return other, {}


def anyres(processor, n: int):
    other = copy.deepcopy(processor)
    other.vision_aspect_ratio = f"anyres_max_{n}"
    return other, {}


# case -> (builder, options, the processor to call directly and its kwargs, written out here by hand)
CASES = {
    "gemma3 pan-and-scan": (gemma3, ProcessorOptions(pan_and_scan=True, pan_and_scan_min_crop=32,
                                                     pan_and_scan_max_crops=2),
                            lambda p: (p, {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32,
                                           "pan_and_scan_max_num_crops": 2})),
    "internvl max tiles": (internvl, ProcessorOptions(max_tiles=2), lambda p: (p, {"max_patches": 2})),
    "idefics3 no splitting": (idefics3, ProcessorOptions(image_splitting="off"),
                              lambda p: (p, {"do_image_splitting": False})),
    "smolvlm longest edge": (lambda: idefics3(smolvlm=True), ProcessorOptions(longest_edge=256),
                             lambda p: (p, {"size": {"longest_edge": 256}})),
    "qwen3-vl pixels": (qwen3_vl, ProcessorOptions(max_pixels=128 * 128),
                        lambda p: (p, {"size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}})),
    "llava-next max tiles": (llava_next, ProcessorOptions(max_tiles=2),
                             lambda p: pinpoints(p, [pp for pp in NEXT_PINPOINTS if pp[0] * pp[1] <= 2 * TILE ** 2])),
    "onevision max tiles": (llava_onevision, ProcessorOptions(max_tiles=4),
                            lambda p: pinpoints(p, [pp for pp in p.image_processor.image_grid_pinpoints
                                                    if pp[0] * pp[1] <= 4 * TILE ** 2])),
    "onevision anyres max": (llava_onevision, ProcessorOptions(anyres_max=1), lambda p: anyres(p, 1)),
}


def prompt_tokens(processor, **kwargs) -> tuple[int, int]:
    """(prompt tokens, image-token ids) of the processor's output on the wide image and PROMPT."""
    out = processor(images=picture(WIDE), text=chat_prompt(processor, PROMPT), return_tensors="pt", **kwargs)
    ids = out["input_ids"][0]
    return len(ids), int((ids == getattr(processor, "image_token_id", -1)).sum())


def state(model, processor) -> tuple:
    """What an option may touch: the processor's call defaults and the settings the model and processor read."""
    return (copy.deepcopy(getattr(processor, "images_kwargs", None)), vars(model).get("_hap_options"),
            copy.deepcopy(getattr(model.config, "image_grid_pinpoints", None)),
            getattr(model.config, "vision_aspect_ratio", None), getattr(processor, "vision_aspect_ratio", None),
            copy.deepcopy(getattr(processor.image_processor, "image_grid_pinpoints", None)))


@pytest.mark.parametrize("case", CASES)
def test_an_option_changes_the_tokens_as_the_processor_does_and_no_options_is_todays_run(case):
    build, options, direct = CASES[case]
    model, processor = build()
    before = state(model, processor)
    stock = prompt_tokens(processor)
    plain = hap.run(model, processor, picture(WIDE), PROMPT, FAST, max_new_tokens=2)
    assert plain.text_tokens + plain.num_visual == stock[0]  # no options: the processor as loaded
    ref_processor, kwargs = direct(processor)
    expected = prompt_tokens(ref_processor, **kwargs)
    assert expected[0] != stock[0]  # the option matters on this image
    result = hap.run(model, processor, picture(WIDE), PROMPT, FAST, max_new_tokens=2, options=options)
    assert result.text_tokens + result.num_visual == expected[0]
    assert result.layout["num_visual"] == result.num_visual and result.groups  # drawn and pruned on the new count
    assert state(model, processor) == before and prompt_tokens(processor) == stock  # everything restored


def test_run_batch_and_run_together_take_the_options():
    model, processor = internvl()
    options = ProcessorOptions(max_tiles=2)
    expected = prompt_tokens(processor, max_patches=2)[0]
    batch = hap.run_batch(model, processor, [picture(WIDE), picture(WIDE, 1)], [PROMPT, PROMPT], FAST,
                          max_new_tokens=2, options=options)
    together = hap.run_together(model, processor, picture(WIDE), PROMPT, [(FAST, False), (hap.HAPConfig(
        method="none"), False)], max_new_tokens=2, options=options)
    assert {r.text_tokens + r.num_visual for r in batch + together} == {expected}


def test_the_checkpoints_own_values_are_read_from_its_processor():
    assert option_defaults(*internvl()) == {"max_tiles": INTERNVL_MAX}
    assert option_defaults(*idefics3()) == {"image_splitting": True, "longest_edge": SMOL_LONGEST}
    assert option_defaults(*gemma3()) == {"pan_and_scan": False, "pan_and_scan_max_crops": 4,
                                          "pan_and_scan_min_crop": 256, "pan_and_scan_min_ratio": 1.2}
    assert option_defaults(*qwen3_vl()) == {"min_pixels": 64 * 64, "max_pixels": 256 * 256}
    assert option_defaults(*llava_next()) == {"max_tiles": 4}  # 2 x 2 is v1.6's largest pinpoint
    assert option_defaults(*llava_onevision()) == {"max_tiles": 36, "anyres_max": 9}


def test_a_family_without_the_option_refuses_it_by_name():
    model, processor = qwen3_vl()
    with pytest.raises(ValueError, match=r"^max_tiles is not a processor option of Qwen3VL; it is one of InternVL, "
                                         r"LlavaNext, LlavaOnevision$"):
        hap.run(model, processor, picture(WIDE), PROMPT, FAST, max_new_tokens=2,
                options=ProcessorOptions(max_tiles=2))
    with pytest.raises(ValueError, match="min_pixels=90000 exceeds max_pixels=65536"):
        hap.run(model, processor, picture(WIDE), PROMPT, FAST, max_new_tokens=2,
                options=ProcessorOptions(min_pixels=300 * 300))
    with pytest.raises(ValueError, match=r"max_tiles=1: every grid pinpoint .* fewest: 2"):
        hap.run(*llava_next(), picture(WIDE), PROMPT, FAST, options=ProcessorOptions(max_tiles=1))
    assert prompt_tokens(processor) == prompt_tokens(qwen3_vl()[1])  # a refused option changed nothing


@pytest.mark.parametrize("values, message", [
    ({"max_tiles": 0}, r"max_tiles=0 must be an integer in \[1, 64\]"),
    ({"max_tiles": 2.5}, r"max_tiles=2.5 must be an integer"),
    ({"pan_and_scan": "yes"}, r"pan_and_scan='yes' is not allowed; choose one of on, off"),
    ({"pan_and_scan_min_ratio": 0.5}, r"pan_and_scan_min_ratio=0.5 must be a number in \[1, 100\]"),
    ({"longest_edge": "big"}, r"longest_edge='big' must be an integer"),
    ({"tiles": 3}, r"unknown processor options tiles; known: pan_and_scan, "),
])
def test_bad_values_are_refused_naming_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        ProcessorOptions.of(values)


def test_form_values_become_the_dataclass_values():
    options = ProcessorOptions.of({"pan_and_scan": "on", "image_splitting": "default", "max_tiles": 3.0,
                                   "min_pixels": ""})
    assert options.given() == {"pan_and_scan": True, "max_tiles": 3}
    assert [o.name for o in OPTIONS] == list(ProcessorOptions.__dataclass_fields__)


def test_the_feature_cache_keys_on_the_options():
    """The same image under another tiling must not reuse the features: LLaVA-NeXT packs even equal pixels by the
    pinpoints the options set."""
    model, processor = llava_next()
    cache = FeatureCache(4)
    runs = [None, ProcessorOptions(max_tiles=2), ProcessorOptions(max_tiles=3), None]
    with reusing_features(model, cache):
        counts = [hap.run(model, processor, picture(WIDE), PROMPT, FAST, max_new_tokens=2, options=o).num_visual
                  for o in runs]
    assert counts[0] == counts[3] != counts[1] and (cache.misses, cache.hits) == (3, 1)
    assert vars(model).get("_hap_options") is None


def test_nested_blocks_restore_the_outer_options():
    model, processor = internvl()
    with processor_options(model, processor, {"max_tiles": 2}):  # a dict by name as well
        inner = hap.run(model, processor, picture(WIDE), PROMPT, FAST, max_new_tokens=2,
                        options=ProcessorOptions(max_tiles=3))
        assert prompt_tokens(processor) == prompt_tokens(processor, max_patches=2)
    assert inner.text_tokens + inner.num_visual == prompt_tokens(processor, max_patches=3)[0]


# --- the CLI and /analyze on a random Qwen2-VL saved to a folder (min_pixels = max_pixels = 168^2: 36 tokens) -------
SCENE = Path(__file__).resolve().parent.parent / "assets" / "examples" / "scene_600000.png"
SMALL = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    from tiny_models import qwen_vl_folder

    return str(qwen_vl_folder(tmp_path_factory.mktemp("qwen2-vl")))


@pytest.fixture(scope="module")
def expected(qwen_folder) -> int:
    """Image tokens of the folder's processor called directly on the scene with the SMALL pixels."""
    from PIL import Image

    _, processor = hap.load_model(qwen_folder)
    image = Image.open(SCENE).convert("RGB")
    out = processor(images=image, text=chat_prompt(processor, PROMPT), return_tensors="pt",
                    size={"shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]})
    return int((out["input_ids"][0] == processor.image_token_id).sum())


def test_the_cli_takes_the_options_as_flags(qwen_folder, expected, tmp_path, capsys):
    from hap.__main__ import main

    out = tmp_path / "out.json"
    base = ["run", "--model", qwen_folder, "--image", str(SCENE), "--prompt", PROMPT, "--max-new-tokens", "2"]
    assert main([*base, "--min-pixels", str(SMALL["min_pixels"]), "--max-pixels", str(SMALL["max_pixels"]),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_visual"] == expected != 36 and report["processor_options"] == SMALL
    assert f"processor options: min_pixels {SMALL['min_pixels']}" in capsys.readouterr().out
    assert main([*base, "--max-tiles", "2"]) == 2
    assert "error: max_tiles is not a processor option of Qwen2VL" in capsys.readouterr().err


def test_analyze_takes_the_options_as_fields_and_refuses_one_by_name(qwen_folder, expected):
    from app.handler import Handler
    from app.settings import Settings
    from hap.knobs import KNOBS

    server = Handler(Settings(models=[qwen_folder], allow_local=True))
    upload = {"path": str(SCENE), "orig_name": SCENE.name, "meta": {"_type": "gradio.FileData"}}
    knobs = {k.name: k.resolve(4) for k in KNOBS}
    shown = server.analyze(upload, PROMPT, qwen_folder, causal="off", **knobs, **SMALL)
    out = shown["summary"]
    assert out["num_visual"] == expected and out["processor_options"] == SMALL
    assert f"- Processor options: `min_pixels` {SMALL['min_pixels']} (set), `max_pixels`" in shown["explanation"]
    shown = server.analyze(upload, PROMPT, qwen_folder, causal="off", **knobs, min_pixels=None)
    plain = shown["summary"]
    assert plain["num_visual"] == 36 and plain["processor_options"] == {"min_pixels": 168 ** 2,
                                                                        "max_pixels": 168 ** 2}
    assert f"`max_pixels` {168 ** 2} (the checkpoint)" in shown["explanation"]
    with pytest.raises(gr.Error, match="max_tiles is not a processor option of Qwen2VL; it is one of InternVL"):
        server.analyze(upload, PROMPT, qwen_folder, causal="off", **knobs, max_tiles=2)
    with pytest.raises(gr.Error, match=r"max_pixels=0 must be an integer"):
        server.analyze(upload, PROMPT, qwen_folder, causal="off", **knobs, max_pixels=0)


def test_the_page_shows_the_options_of_the_chosen_models_family():
    from app.layout import model_options
    from app.settings import HUB_ARCHITECTURES, HUB_MODELS, options_taken

    assert set(HUB_ARCHITECTURES) == set(HUB_MODELS)
    assert options_taken("google/gemma-3-4b-it")[:2] == ("pan_and_scan", "pan_and_scan_max_crops")
    assert options_taken("OpenGVLab/InternVL3-1B-hf") == ("max_tiles",)
    assert options_taken("assets/tiny-llava") == () and options_taken("someone/unknown") is None
    shown = [u["visible"] for u in model_options("HuggingFaceTB/SmolVLM-256M-Instruct")]
    assert [o.name for o, v in zip(OPTIONS, shown) if v] == ["image_splitting", "longest_edge"]
    assert all(u["visible"] for u in model_options("someone/unknown"))
    torch.manual_seed(0)


def test_the_docs_name_every_option_with_its_range():
    root = Path(__file__).resolve().parent.parent
    app_doc, readme = (root / "docs" / "app.md").read_text(), (root / "README.md").read_text()
    for option in OPTIONS:
        assert f"`{option.name}`" in app_doc and f"`{option.name}`" in readme, option.name
        if option.choices is None:
            assert f"[{option.low:g}, {option.high:g}]" in app_doc, option.name


def test_the_cli_flags_parse_to_the_options():
    from hap.__main__ import parser

    args = parser().parse_args(["run", "--image", "x.png", "--prompt", "q", "--pan-and-scan", "on",
                                "--pan-and-scan-min-ratio", "2", "--max-tiles", "6"])
    given = {o.name: getattr(args, o.name) for o in OPTIONS if getattr(args, o.name) is not None}
    assert ProcessorOptions.of(given).given() == {"pan_and_scan": True, "pan_and_scan_min_ratio": 2.0, "max_tiles": 6}
    with pytest.raises(SystemExit):
        parser().parse_args(["run", "--image", "x.png", "--prompt", "q", "--image-splitting", "maybe"])


def test_analyze_and_sweep_name_the_options_as_api_parameters():
    from app.layout import build_demo

    info = build_demo().get_api_info()["named_endpoints"]
    for endpoint in ("/analyze", "/sweep"):
        params = {p["parameter_name"]: p for p in info[endpoint]["parameters"]}
        assert all(params[o.name]["parameter_has_default"] for o in OPTIONS), endpoint
        assert params["max_tiles"]["parameter_default"] is None and params["pan_and_scan"]["parameter_default"] in (
            None, "default")
