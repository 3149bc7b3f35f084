"""analysis.figures: every view from a real `hap.run` result on a tiny random LLaVA (no model access in the views)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import noise_image, tiny_llava

import hap
from analysis import figures as F
from analysis.report import explanation, summary
from hap.compare import compare

PROMPT = "what color is the circle ?"


@pytest.fixture(scope="module")
def model():
    return tiny_llava(layers=6)


@pytest.fixture(scope="module")
def result(model):
    cfg = hap.HAPConfig(method="hap", retain=0.2, first_layers=0, groups=3)
    return hap.run(*model, noise_image(), PROMPT, cfg, max_new_tokens=2)


@pytest.fixture(scope="module")
def view():
    return F.model_view(noise_image())


def test_every_plotly_view_is_non_empty(result, view):
    figs = F.figures(result, view)
    assert set(figs) == {"kept_masks", "head_classes", "paq", "head_maps", "layer_maps", "group_maps",
                         "uniform_vs_paq"}
    for name, fig in figs.items():
        assert len(fig.data) > 0, name
        assert fig.to_json(), name
    assert sum(t.type == "heatmap" for t in figs["head_maps"].data) == result.num_heads
    assert sum(t.type == "heatmap" for t in figs["layer_maps"].data) == result.num_layers  # traced: every layer
    assert sum(t.type == "image" for t in figs["kept_masks"].data) == len(result.groups)
    hover = [t for t in figs["kept_masks"].data if t.type == "heatmap"]
    assert [int((np.asarray(t.text) == "kept").sum()) for t in hover] == [len(g.kept) for g in result.groups]
    assert sum(t.type == "heatmap" for t in figs["uniform_vs_paq"].data) == 2 * len(result.groups)


def test_head_class_hover_carries_the_statistics(result):
    trace = F.head_class_figure(result).data[0]
    custom = np.asarray(trace.customdata, dtype=float)
    assert custom.shape == (result.num_layers, result.num_heads, 4)
    np.testing.assert_allclose(custom[..., 0], result.paq.numpy())
    np.testing.assert_allclose(custom[..., 3], result.visual_share.numpy())
    assert [[F.CLASS_LABELS[int(c)] for c in row] for row in trace.z] == [
        [c or "not scored" for c in row] for row in result.head_class]


def test_paq_figure_marks_every_cut(result):
    fig = F.paq_figure(result)
    assert sorted(s.y0 for s in fig.layout.shapes) == [g.layers[0] - 0.5 for g in result.groups]


def test_group_map_top_k_is_what_hap_kept(result):
    """The layer-fused map drawn per group is the score the cut ranked: its top-k is the kept set."""
    for g in result.groups:
        assert F._top(result.maps.group[g.index].numpy(), len(g.kept)) == set(g.kept)


def test_masks_and_maps_dim_exactly_the_pruned_patches(result):
    view = np.full((168, 168, 3), 200, np.uint8)
    rows, cols = result.visual_grid
    for g in result.groups:
        panel = F.mask_panels(result, view)[g.index]
        dimmed = panel.background()[:: 168 // rows, :: 168 // cols, 0]  # one pixel per token
        assert ((dimmed == 200).ravel() == result.kept_mask(g.index).numpy()).all()
    for panel in F.layer_map_panels(result, view):
        shown = panel.background()[:: 168 // rows, :: 168 // cols, 0] == 200
        assert shown.tolist() == (~np.isnan(panel.scores)).tolist()


def test_model_view_crops_the_centre_square():
    from PIL import Image

    image = Image.new("RGB", (300, 100), "red")
    image.paste((0, 0, 255), (100, 0, 200, 100))  # the centre square is blue
    assert F.model_view(image, center_crop=True, size=10)[..., 2].min() == 255
    assert F.model_view(image, center_crop=False, size=10)[..., 0].max() == 255
    assert F.model_view(None).shape == (F.VIEW_PIXELS, F.VIEW_PIXELS, 3)


@pytest.mark.parametrize("method", ["none", "fastv", "random"])
def test_views_of_other_methods(model, view, method):
    cfg = hap.HAPConfig(method=method, retain=0.3, first_layers=1, groups=2)
    result = hap.run(*model, noise_image(), PROMPT, cfg, max_new_tokens=1)
    for name, fig in F.figures(result, view).items():
        assert len(fig.data) + len(fig.layout.annotations) > 0, name


def test_head_maps_reject_a_layer_outside_the_model(result, view):
    with pytest.raises(ValueError, match="layer=6"):
        F.head_maps_figure(result, view, 6)


def test_export_png_writes_every_view(result, tmp_path):
    paths = F.export_png(result, tmp_path / "figs", noise_image())
    assert len(paths) == 7
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000, path
    assert F.export_png(result, tmp_path / "grey")  # without the image: maps on grey
    noise_image().save(tmp_path / "input.png")
    assert len(F.export_png(result, tmp_path / "from-file", tmp_path / "input.png")) == 7  # as the CLI passes it


def test_report_texts(model):
    cfg = hap.HAPConfig(method="hap", retain=0.2, first_layers=0)
    comparison = compare(*model, noise_image(), PROMPT, cfg, max_new_tokens=1)
    assert [r.method for _, r in comparison.items()] == ["none", "hap", "uniform"]
    text = explanation(comparison)
    assert "PAQ" in text and "Group 2" in text
    data = summary(comparison, "tiny")
    assert [(d["index"], d["layers"], d["scored_by"], d["kept"]) for d in data["groups"]] == [
        (g.index, list(g.layers), g.scored_by, g.kept) for g in comparison.pruned.groups]
    assert set(data["runs"]) == {"unpruned", "pruned", "uniform"} and "maps" not in data


def test_scored_layers_skip_uncaptured_ones(result):
    partial = dataclasses.replace(result, paq=result.paq.clone())
    partial.paq[1:3] = float("nan")
    assert F.scored_layers(partial) == [0, 3, 4, 5]
