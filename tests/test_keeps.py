"""What each method keeps (`hap.runs.keeps`): every registry method at one budget, one map per method titled with its
answer and overlap with HAP's, the answering patches outlined on a scene; refusals named, never run; on the shipped
model, a random Qwen2-VL and a tiled LLaVA-NeXT; through `/analyze` (opt-in `keeps`) and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from app_model import ROOT, SHIPPED, default_model
from PIL import Image
from test_zerogpu import on_zerogpu  # noqa: F401 (fixture: app/pipeline.py on a stand-in ZeroGPU)
from tiny_models import qwen_vl_folder

import hap
from hap import views
from hap.views.ground_truth import read_metadata, scene_truth
from hap.runs.keeps import (REFERENCE, keeps, keeps_draw, keeps_panels, keeps_plotly, keeps_png, overlap, panel_title,
                            pruning)

SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the square ?"  # the question saved with scene_600000
RETAIN = 0.111
OFFICIAL_FLOOR = ("sparsevlm", "autoprune")  # their official schedules cannot reach 0.111 on 6 layers


@pytest.fixture(scope="module")
def model_name(tmp_path_factory):
    return default_model(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def shipped(model_name):
    from app.settings import resolve

    torch.set_num_threads(1)
    model, processor = hap.load_model(resolve(model_name), device="cpu")
    image = Image.open(SCENE)
    config = hap.HAPConfig(retain=RETAIN, first_layers=0)
    found = keeps(model, processor, image, PROMPT, config)
    data = views.ViewData.from_result(hap.run(model, processor, image, PROMPT, config), image)
    return model, processor, found, replace(data, truth=scene_truth(read_metadata(image)["question"], data))


def test_every_method_of_the_registry_runs_or_is_refused_by_name(shipped):
    model, _, found, _ = shipped
    assert list(found.methods) + list(found.refused) == [m for m in pruning() if m not in found.refused] + list(
        found.refused)
    assert set(found.methods) | set(found.refused) == set(hap.METHODS) - {"none"}
    for method in OFFICIAL_FLOOR:  # out of reach at this budget: refused before any run, with the planner's reason
        assert "unreachable" in found.refused[method], method
    visual = 144
    for method, kept in found.methods.items():
        assert all(0 <= v < visual for v in kept.kept) and kept.kept == sorted(set(kept.kept)), method
        assert abs(kept.retained_tokens - RETAIN * visual) <= 12, method  # the one budget, to a token row of the grid
        layers = model.config.text_config.num_hidden_layers  # the image's tokens each layer runs; VisionZip's merged
        assert kept.present.sum() / layers <= kept.retained_tokens  # contextual tokens are on top of them
        assert 0.0 <= kept.overlap_with_hap <= 1.0 and 0.0 < kept.flops_ratio < 1.0
        if kept.cut_layer == 0 and kept.present.all(0).sum() == len(kept.kept):  # one cut before layer 0: the budget
            assert kept.retained_tokens - len(kept.kept) == (1 if method in ("visionzip", "prunesid") else 0)  # [CLS]
    assert found.methods[REFERENCE].overlap_with_hap == 1.0
    assert all(abs(found.methods[m].retained_tokens - RETAIN * visual) <= 1.0 for m in ("hap", "uniform", "fastv"))
    direct = hap.run(model, shipped[1], Image.open(SCENE), PROMPT, hap.HAPConfig(method="fastv", retain=RETAIN,
                                                                                    first_layers=0), trace=False)
    assert found.methods["fastv"].answer == direct.answer  # one batched decode: the answers of runs one by one
    assert found.methods["fastv"].kept == sorted(direct.groups[0].kept)
    entry = json.loads(json.dumps(found.to_json()))
    assert entry["retain"] == RETAIN and set(entry["refused"]) == set(found.refused)
    assert set(entry["methods"]["fastv"]) == {"kept", "cut_layer", "cuts", "answer", "retained_tokens", "flops_ratio",
                                               "overlap_with_hap"}


def test_at_the_full_budget_every_method_keeps_every_token(shipped):
    model, processor, _, _ = shipped
    found = keeps(model, processor, Image.open(SCENE), PROMPT, hap.HAPConfig(retain=1.0, first_layers=0),
                  max_new_tokens=2, methods=("hap", "fastv"))
    assert all(len(k.kept) == 144 and k.overlap_with_hap == 1.0 for k in found.methods.values())
    answer = found.methods["fastv"].answer
    assert panel_title(found.methods["fastv"]) == f"fastv: {answer!r} · 100% of HAP's\n144 kept entering layer 0"


def test_the_image_is_encoded_once_for_every_method_that_does_not_read_the_tower(shipped):
    from hap.runs.features import FeatureCache, reusing_features

    model, processor, _, _ = shipped
    cache = FeatureCache(1)
    with reusing_features(model, cache):
        found = keeps(model, processor, Image.open(SCENE), PROMPT, hap.HAPConfig(retain=0.2, first_layers=0),
                      max_new_tokens=2)
    # one vision pass, read by every method but those reading the tower's [CLS] cues (`hap.runs.features.needs_tower`)
    assert cache.misses == 1 and 0 < cache.hits < len(found.methods)


def test_overlap_counts_hap_s_token_layers():
    hap_runs = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], bool)  # token 0 in both layers, token 1 in layer 0
    assert overlap(hap_runs, hap_runs) == 1.0
    assert overlap(np.array([[1, 0, 1, 0], [1, 0, 1, 0]], bool), hap_runs) == pytest.approx(2 / 3)
    assert overlap(hap_runs, np.zeros((2, 4), bool)) is None


def test_the_view_has_a_titled_panel_per_method_with_the_answering_patches_outlined(shipped, tmp_path):
    _, _, found, data = shipped
    panels = keeps_panels(data, found).panels
    assert len(panels) == len(found.methods)
    for panel, (method, kept) in zip(panels, found.methods.items()):
        share = "HAP's own" if method == REFERENCE else f"{kept.overlap_with_hap:.0%} of HAP's"
        assert panel.title.startswith(f"{method}: {kept.answer!r} · {share}")
        assert np.flatnonzero(panel.present.ravel()).tolist() == kept.kept  # kept bright, the rest dimmed
        assert ("2 more cuts" in panel.title) == (kept.cuts == 3)  # HAP's groups: the later cuts said
        assert panel.outline is not None and panel.outline.sum() == data.truth.patches.sum() > 0
    figure = keeps_plotly(data, found)
    outlines = [t for t in figure.data if t.type == "scatter" and t.line.color == views.OUTLINE_COLOR]
    assert len(outlines) == len(found.methods)
    assert found.refused and "refused" not in figure.layout.title.text  # the figure holds the maps
    assert [t.get_text() for t in keeps_draw(data, found).texts if "refused" in t.get_text()]  # a file: under the title
    assert not [t for t in keeps_plotly(replace(data, truth=None), found).data if t.type == "scatter"]
    assert keeps_png(data, found, tmp_path).stat().st_size > 0


def test_a_random_qwen2_vl_refuses_by_name_and_draws_its_own_grid(tmp_path):
    model, processor = hap.load_model(str(qwen_vl_folder(tmp_path / "qwen", layers=4, side=112)), device="cpu")
    image = Image.open(SCENE)
    config = hap.HAPConfig(retain=0.5, first_layers=0)
    found = keeps(model, processor, image, PROMPT, config, max_new_tokens=3)
    assert {"visionzip", "pdrop"} <= set(found.refused) and REFERENCE in found.methods
    data = views.ViewData.from_result(hap.run(model, processor, image, PROMPT, config, 3), image)
    panels = keeps_panels(data, found).panels
    assert len(panels) == len(found.methods) and all(p.present.shape == data.grid for p in panels)
    assert all(0 <= v < data.shape[2] for k in found.methods.values() for v in k.kept)


def test_a_tiled_model_draws_a_panel_per_view_of_each_method():
    from tiny_zoo import llava_next, picture

    model, processor = llava_next()
    image = picture((112, 56))
    config = hap.HAPConfig(retain=0.5, first_layers=0)
    found = keeps(model, processor, image, "what is it ?", config, max_new_tokens=2, methods=("hap", "fastv"))
    data = views.ViewData.from_result(hap.run(model, processor, image, "what is it ?", config, 2), image)
    assert data.views_count() > 1
    panels = keeps_panels(data, found).panels
    assert len(panels) == 2 * data.views_count()
    assert {p.title.split(":")[0] for p in panels} == {"hap", "fastv"}
    assert sum(int(p.present.sum()) for p in panels[:data.views_count()]) == len(found.methods["hap"].kept)


def test_analyze_runs_every_method_only_when_asked(model_name):
    import gradio as gr
    from test_edit import file

    from app.handler import Handler
    from app.keeps import NOT_RUN, refused_text
    from app.settings import Settings, knob_defaults

    handler = Handler(Settings(models=[model_name]))
    knobs = {**knob_defaults(model_name), "method": "hap", "retain": RETAIN, "first_layers": 0, "causal": "off"}
    plain = handler.analyze(file(SCENE), PROMPT, model_name, **knobs)
    assert "keeps" not in plain["summary"] and plain["keeps"] is None  # the default cost does not grow
    out = handler.analyze(file(SCENE), PROMPT, model_name, keeps=True, **knobs)
    entry = out["summary"]["keeps"]
    assert entry["retain"] == RETAIN and set(entry["methods"]) | set(entry["refused"]) == set(pruning())
    assert entry["methods"]["hap"]["overlap_with_hap"] == 1.0
    assert entry["methods"]["hap"]["kept"] == sorted(out["summary"]["groups"][0]["kept"])  # the page's run, reused
    assert entry["methods"]["uniform"]["answer"] == out["summary"]["runs"]["uniform"]["answer"]
    assert len(entry["methods"]["fastv"]["kept"]) == 15 and 0 < entry["methods"]["fastv"]["flops_ratio"] < 1
    assert out["keeps"].layout.title.text.startswith("What each method keeps at retain 0.111")
    assert set(OFFICIAL_FLOOR) <= set(entry["refused"])  # named, not run, and the request goes on
    side = refused_text(out["summary"])  # beside the figure, one line each, none in it
    assert all(f"- {m} refused: {why}" in side for m, why in entry["refused"].items())
    assert "refused" not in out["keeps"].layout.title.text and refused_text(plain["summary"]) == NOT_RUN
    with pytest.raises(gr.Error, match="keeps='yes' must be true or false"):
        handler.analyze(file(SCENE), PROMPT, model_name, keeps="yes", **knobs)


def test_the_cli_draws_the_view_and_writes_its_json(tmp_path, model_name):
    from hap.__main__ import main

    out = tmp_path / "run.json"
    assert main(["run", "--model", model_name, "--image", str(SCENE), "--prompt", PROMPT, "--retain", str(RETAIN),
                 "--first-layers", "0", "--max-new-tokens", "3", "--keeps", "--json", str(out),
                 "--figures", str(tmp_path / "figures")]) == 0
    entry = json.loads(out.read_text())["keeps"]
    assert entry["methods"]["hap"]["overlap_with_hap"] == 1.0 and set(entry["refused"]) >= set(OFFICIAL_FLOOR)
    assert (tmp_path / "figures" / "keeps.png").stat().st_size > 0


def test_the_sweep_its_grid_and_the_benchmark_take_every_registry_method():
    from analysis import benchmark
    from hap.runs import sweep

    assert set(sweep.grid_methods()) <= set(pruning())
    assert set(pruning()) <= set(benchmark.CHOICES) and benchmark.chosen(["all"]) == pruning()
    retain = [1.0, 0.5, 0.25]
    result = {"retain": retain, "unpruned": {"answer": "red"},
              "methods": {m: {"answers": ["red", "blue", None], "answer_prob": [0.9, 0.2, None]} for m in pruning()}}
    figure = views.sweep_plotly(result, "sweep")
    lines = [t for t in figure.data if t.type == "scatter"]
    assert [t.name for t in lines] == pruning() and list(figure.data[-1].y) == pruning()  # a line and a grid row each
    styles = {(t.line.color, t.line.dash, t.marker.symbol) for t in lines}
    assert len(styles) == len(pruning())  # told apart by colour, dash and marker


def test_on_zerogpu_the_comparison_asks_for_its_own_call(on_zerogpu):
    from app.settings import Settings, knob_defaults
    from app import zerogpu

    handler, calls = on_zerogpu
    image = {"path": str(SCENE), "orig_name": SCENE.name, "meta": {"_type": "gradio.FileData"}}
    out = handler.Handler(Settings(models=[SHIPPED])).analyze(image, PROMPT, SHIPPED, causal="off", keeps=True,
                                                               **{**knob_defaults(SHIPPED), "retain": RETAIN})
    assert out["summary"]["keeps"]["methods"]["hap"]["overlap_with_hap"] == 1.0
    asked = {name: seconds for name, seconds, _ in calls}
    assert "gpu_keeps" in asked and zerogpu.MIN_S <= asked["gpu_keeps"]
