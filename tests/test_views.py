"""hap.views: every view from hand-built arrays (no model runs here); values land in the right cells."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

import hap
from hap import views as V
from hap.layout import Layout

L, H, GRID = 4, 3, (2, 3)  # layers, heads, visual grid (rows, cols)
N = GRID[0] * GRID[1]
NAN = float("nan")
HEAD_CLASS = [["sink", "optimal", "dispersed"], ["", "", ""], ["optimal", "optimal", "sink"], ["dispersed"] * 3]
GROUPS = [hap.Group(0, (1, 3), [0], [5, 0, 2], [], []), hap.Group(1, (3, 4), [2], [2], [], [])]


def data(**changes) -> V.ViewData:
    """A 4-layer, 3-head run on a 2 x 3 grid: layer 1 not captured, tokens 1, 3, 4 pruned by the first cut."""
    rng = np.random.default_rng(0)
    stats = rng.uniform(0, 1, (L, H, len(V.STATS)))
    stats[1] = NAN
    head_maps = rng.uniform(0, 1, (L, H, N))
    head_maps[1] = NAN
    head_maps[2:, :, [1, 3, 4]] = NAN
    layer_maps = head_maps.mean(1)
    group_maps = np.array([[0.9, 0.1, 0.8, 0.2, 0.3, 1.0], [NAN, NAN, 0.5, NAN, NAN, 0.4]])
    uniform = np.array([[0.9, 0.1, 0.2, 0.8, 0.3, 1.0], [NAN, NAN, 0.1, NAN, NAN, 0.4]])
    attention = head_maps / np.nansum(head_maps, -1, keepdims=True)
    fields = dict(image=np.full((60, 90, 3), 200, np.uint8), grid=GRID, head_class=HEAD_CLASS, stats=stats,
                  head_maps=head_maps, head_attention=attention, layer_maps=layer_maps, group_maps=group_maps,
                  group_uniform=uniform, groups=GROUPS, method="hap", temperature=0.1, layer=2)
    return V.ViewData(**{**fields, **changes})


def heatmaps(fig) -> list:
    """The heatmaps that carry values (not the layer dimming absent tokens, which has no hover)."""
    return [t for t in fig.data if t.type == "heatmap" and t.hoverinfo != "skip"]


def test_one_list_of_views_with_unique_names_and_titles():
    names = [v.name for v in V.VIEWS]
    assert names == ["kept_masks", "token_counts", "head_classes", "paq", "grounding", "head_maps", "layer_maps", "group_maps",
                     "uniform_vs_paq"]
    assert len({v.title for v in V.VIEWS}) == len({v.label for v in V.VIEWS}) == len(V.VIEWS)
    assert set(V.figures(data())) == set(names)


def test_class_grid_puts_each_class_and_its_statistics_in_its_cell():
    d = data()
    fig = V.VIEW["head_classes"].figure(d)
    assert len(fig.data) == 1
    trace = fig.data[0]
    assert np.asarray(trace.z).tolist() == [[1, 3, 2], [0, 0, 0], [3, 3, 1], [2, 2, 2]]
    assert np.asarray(trace.text)[0].tolist() == ["sink", "optimal", "dispersed"]
    np.testing.assert_array_equal(np.asarray(trace.customdata, dtype=float), d.stats)
    assert fig.layout.title.text == "Head classes: 2 sink, 4 dispersed, 3 optimal"
    assert sorted(s.y0 for s in fig.layout.shapes) == [0.5, 2.5]  # a dashed line above each group's first layer
    assert [a.text for a in fig.layout.annotations] == ["group 0: 3 of 6 tokens", "group 1: 1 of 6 tokens"]


def test_paq_heatmap_is_the_first_statistic():
    d = data()
    fig = V.VIEW["paq"].figure(d)
    np.testing.assert_array_equal(np.asarray(fig.data[0].z, dtype=float), d.stats[..., 0])
    assert fig.layout.title.text.startswith("PAQ = (1 - sink share) x (1 - dispersion)")
    assert list(fig.layout.yaxis.range) == [L - 0.5, -0.5]  # layer 0 on top


def test_head_maps_show_one_panel_per_head_of_the_chosen_layer():
    d = data()
    fig = V.VIEW["head_maps"].figure(d)
    maps = heatmaps(fig)
    assert len(maps) == H and len(fig.layout.images) == H  # each head over the image
    for h, trace in enumerate(maps):
        raw = d.head_maps[2, h].reshape(GRID)
        np.testing.assert_allclose(np.asarray(trace.z, dtype=float), raw / np.nanmax(raw))  # relative to the highest
        np.testing.assert_allclose(np.asarray(trace.customdata, dtype=float)[..., 0], raw)  # the raw score on hover
    assert fig.layout.title.text == "Per-head maps of layer 2, before fusion"
    assert [a.text for a in fig.layout.annotations][:H] == [
        f"L2 H{h}: {HEAD_CLASS[2][h]}<br>PAQ {d.stats[2, h, 0]:.3g}" for h in range(H)]
    assert V.VIEW["head_maps"].figure(d.at_layer(0)).layout.title.text.startswith("Per-head maps of layer 0")


def test_a_layer_outside_the_decoder_is_refused():
    with pytest.raises(ValueError, match=r"layer=4 is outside the decoder's layers 0..3"):
        data().at_layer(4)


def test_layer_maps_skip_layers_that_were_not_captured():
    fig = V.VIEW["layer_maps"].figure(data(temperature=0.25))
    assert len(heatmaps(fig)) == L - 1
    assert [a.text for a in fig.layout.annotations] == [f"layer {l} (head fusion)" for l in (0, 2, 3)]
    assert fig.layout.title.text.endswith("T = 0.25")


def test_group_maps_and_the_uniform_comparison():
    d = data()
    groups = V.VIEW["group_maps"].figure(d)
    assert len(heatmaps(groups)) == len(GROUPS)
    np.testing.assert_allclose(np.asarray(heatmaps(groups)[0].z, dtype=float), d.group_maps[0].reshape(GRID))
    versus = V.VIEW["uniform_vs_paq"].figure(d)
    assert len(heatmaps(versus)) == 2 * len(GROUPS)
    titles = [a.text for a in versus.layout.annotations]
    # top 3 of the PAQ map {5, 0, 2} vs the uniform map {5, 0, 3}: two shared; group 1: token 2 vs token 5
    assert titles[2:] == ["group 0: PAQ-weighted<br>2 of the top 3 shared",
                          "group 1: PAQ-weighted<br>0 of the top 1 shared"]


def test_kept_masks_name_each_token_kept_or_pruned():
    fig = V.VIEW["kept_masks"].figure(data())
    hover = heatmaps(fig)
    assert [np.asarray(t.text).tolist() for t in hover] == [
        [["kept", "pruned", "kept"], ["pruned", "pruned", "kept"]],
        [["pruned", "pruned", "kept"], ["pruned", "pruned", "pruned"]],
    ]
    assert fig.layout.title.text == "Kept visual tokens (hap)"
    assert [a.text for a in fig.layout.annotations] == ["group 0 (layers 1-2):<br>3/6 kept",
                                                        "group 1 (layers 3-3):<br>1/6 kept"]
    merged = V.VIEW["kept_masks"].figure(data(merged=True))  # HAP+: the dimmed tokens live on in the kept ones
    assert [a.text for a in merged.layout.annotations] == [
        "group 0 (layers 1-2):<br>3/6 kept,<br>the rest merged into them",
        "group 1 (layers 3-3):<br>1/6 kept,<br>the rest merged into them"]


@pytest.mark.parametrize("width, cols", [(1000, 4), (650, 3), (480, 3)])
def test_panel_titles_fit_their_column(width, cols):
    """Every line of every small multiple's title is at most its column's width (at TITLE_CHAR_PX a character,
    an upper bound at the titles' font size): a centred title then stays within its panel, at the figure's edges
    too (the token-importance and kept-token panels were cut at both ends)."""
    long = "token importance (outlined: the answering patches), and the rest merged into them"
    panels = V.Panels([V.Panel(long, np.zeros((6, 6, 3), np.uint8)) for _ in range(cols)], (2, 3), cols, width)
    fig = V.panels_plotly(panels, "title")
    column = (width - V.COLORBAR_PX) / cols
    lines = [line for a in fig.layout.annotations for line in a.text.split("<br>")]
    assert len(lines) > cols and max(len(line) for line in lines) * V.TITLE_CHAR_PX <= column
    assert fig.layout.margin.t >= 60 + V.TITLE_LINE_PX * max(a.text.count("<br>") + 1 for a in fig.layout.annotations)


def test_masks_dim_exactly_the_pruned_patches():
    panel = V.mask_panels(data()).panels[0]
    rows, cols = GRID
    pixels = panel.background()[:: 60 // rows, :: 90 // cols, 0]  # one pixel per token
    assert (pixels == 200).tolist() == [[True, False, True], [False, False, True]]


def test_a_run_without_cuts_says_so():
    d = data(groups=[], group_maps=np.empty((0, N)), group_uniform=np.empty((0, N)))
    fig = V.VIEW["kept_masks"].figure(d)
    assert not fig.data and fig.layout.annotations[0].text == V.NO_CUTS


def test_model_view_squashes_the_whole_image_and_a_one_view_layout_draws_its_part():
    image = Image.new("RGB", (300, 100), "red")
    image.paste((0, 0, 255), (100, 0, 200, 100))  # the centre square is blue
    whole = V.model_view(image, size=10)
    assert whole[:, 0, 0].min() == 255 and whole[:, 5, 2].min() == 255  # red ends, blue middle
    assert V.model_view(None).shape == (V.VIEW_PIXELS, V.VIEW_PIXELS, 3)
    result = fake_result(data(), layout=Layout.grid(*GRID, (300, 100), (1 / 3, 0, 2 / 3, 1)).to_dict())
    cropped = V.ViewData.from_result(result, image)  # a centre crop (LLaVA-1.5): the image and panel are its part
    assert cropped.image[..., 2].min() == 255 and cropped.image[..., 0].max() == 0
    assert cropped.panels("map")[0].view is cropped.view_images[0]


def fake_result(d: V.ViewData, **fields) -> SimpleNamespace:
    """The fields of a hap.Result the views read, from `d`'s arrays (a "fastv" run at temperature 0.5)."""
    tensor = __import__("torch").tensor
    return SimpleNamespace(
        paq=tensor(d.stats[..., 0]), sink_share=tensor(d.stats[..., 1]), dispersion=tensor(d.stats[..., 2]),
        visual_share=tensor(d.stats[..., 3]), visual_grid=GRID, head_class=HEAD_CLASS, groups=GROUPS,
        method="fastv", config={"temperature": 0.5}, visual_per_layer=[N] + [2] * (L - 1), curve=None,
        maps=SimpleNamespace(head=tensor(d.head_maps), head_attention=tensor(d.head_attention),
                             layer=tensor(d.layer_maps), group=tensor(d.group_maps),
                             group_uniform=tensor(d.group_uniform)), **fields,
    )


def test_from_result_reads_every_array_into_place():
    d = data()
    result = fake_result(d)
    got = V.ViewData.from_result(result, Image.new("RGB", (40, 20), "blue"))
    np.testing.assert_array_equal(got.stats, d.stats)
    np.testing.assert_array_equal(got.head_maps, d.head_maps)
    np.testing.assert_array_equal(got.head_attention, d.head_attention)
    assert got.truth is None
    assert (got.layer, got.method, got.temperature, got.shape) == (0, "fastv", 0.5, (L, H, N))  # first cut's scorer
    assert got.image.shape == (V.VIEW_PIXELS, V.VIEW_PIXELS, 3) and got.image[..., 2].min() == 255
    assert V.ViewData.from_result(result, layer=3).layer == 3
    assert not got.merged  # a baseline never merges
    assert list(got.visual_per_layer) == [N] + [2] * (L - 1) and got.curve is None
    for merge, merged in (("proportional", True), ("average", True), ("none", False)):
        hap_run = SimpleNamespace(**{**vars(result), "method": "hap", "config": {"temperature": 0.1, "merge": merge}})
        assert V.ViewData.from_result(hap_run).merged is merged


def test_token_counts_show_what_each_layer_ran_on_and_autoprunes_curve():
    counts = V.token_counts(replace(data(), visual_per_layer=[N, 3, 3, 3]))
    assert counts.processed == [N, 3, 3, 3] and counts.after_drop is None and counts.planned is None
    assert V.token_counts(data()).processed == [N] * L  # no cuts recorded: every token everywhere
    curve = {"budget": 2, "first_keep": 5, "mi0": 0.1, "mi1": 0.5, "slope": 0.3, "scale": 1.2,
             "fractions": [0.5, 0.25, 0.25], "keeps": [2, 1, 1], "counts": [5, 3, 2, 2]}
    run = replace(data(), visual_per_layer=[N, 5, 3, 2], curve=curve)
    counts = V.token_counts(run)
    assert counts.after_drop == [5, 3, 2, 2] and counts.planned == [2.0, 1.0, 1.0]  # (S - 1) x kp_l
    fig = V.VIEW["token_counts"].figure(run)
    assert [t.name for t in fig.data] == ["processed", "after the layer's drop (AutoPrune's accounting)",
                                          "curve: (S - 1) x kp_l"]
    assert "MI_1 0.500 -> slope 0.300" in fig.layout.title.text


def test_default_layer_without_a_scored_cut_is_the_first_captured():
    paq = np.full((3, 2), NAN)
    paq[2] = 0.5
    assert V.default_layer([], paq) == 2
    assert V.default_layer([hap.Group(0, (0, 3), [], [1], [], [])], paq) == 2
    assert V.scored_layers(paq) == [2]


@pytest.mark.parametrize("truth", [None, "scene"])
def test_export_png_writes_one_non_blank_file_per_view(tmp_path, truth):
    paths = V.export_png(data(truth=TRUTH if truth else None), tmp_path / "figs")
    assert [p.name for p in paths] == [f"{v.name}.png" for v in V.VIEWS]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        pixels = np.asarray(Image.open(path).convert("L"), dtype=float)
        assert pixels.std() > 5 and min(pixels.shape) > 200, path  # something drawn, not a blank canvas


def test_plotly_figures_serialise():
    for d in (data(), data(truth=TRUTH)):
        for name, fig in V.figures(d).items():
            assert json.loads(fig.to_json())["data"], name


GROUNDING = np.arange(L * H, dtype=float).reshape(L, H)
TRUTH = V.Truth("what is top left ?", np.array([True, True, False, False, False, False]), GROUNDING, 0.5, [0.5, 0.0])


def outlines(fig) -> list:
    return [t for t in fig.data if t.type == "scatter"]


def test_the_answering_patches_are_outlined_on_every_map():
    d = data(truth=TRUTH)
    for view in V.VIEWS:
        fig = view.figure(d)
        panels = fig.layout.images
        if panels:  # a map view: one outline per panel, none without ground truth
            assert len(outlines(fig)) == len(panels), view.name
            assert not outlines(view.figure(data())), view.name
    xs, ys = V.outline_segments(TRUTH.patches.reshape(GRID))
    edges = {((xs[i], ys[i]), (xs[i + 1], ys[i + 1])) for i in range(0, len(xs), 3)}
    assert edges == {((-0.5, -0.5), (0.5, -0.5)), ((0.5, -0.5), (1.5, -0.5)), ((-0.5, 0.5), (0.5, 0.5)),
                     ((0.5, 0.5), (1.5, 0.5)), ((-0.5, -0.5), (-0.5, 0.5)), ((1.5, -0.5), (1.5, 0.5))}  # 2 x 1 box


def test_grounding_grid_beside_paq_with_the_spearman_or_why_not():
    fig = V.VIEW["grounding"].figure(data(truth=TRUTH))
    np.testing.assert_array_equal(np.asarray(fig.data[0].z, dtype=float), GROUNDING)
    assert fig.layout.title.text.endswith("Spearman with PAQ 0.50")
    empty = V.VIEW["grounding"].figure(data())
    assert np.isnan(np.asarray(empty.data[0].z, dtype=float)).all()
    assert empty.layout.title.text.endswith(V.NO_TRUTH)
    text_only = V.Truth("the object is red . what color is it ?", np.zeros(N, bool), None, None, [None, None])
    assert "answered from the prompt alone" in V.VIEW["grounding"].figure(data(truth=text_only)).layout.title.text


def test_grounding_is_grey_and_unknown_where_the_answering_patches_were_cut():
    grounding = GROUNDING.copy()
    grounding[3] = NAN  # layer 3's input held no answering patch
    cut = V.Truth(TRUTH.question, TRUTH.patches, grounding, 0.5, [0.5, 0.0], np.array([False, False, False, True]))
    fig = V.VIEW["grounding"].figure(data(truth=cut))
    values, grey = heatmaps(fig)
    assert np.isnan(np.asarray(values.z, dtype=float)[3]).all()  # no 0 is drawn there
    grey_z = np.asarray(grey.z, dtype=float)
    assert np.isfinite(grey_z[3]).all() and np.isnan(grey_z[:3]).all()
    assert np.asarray(grey.text)[3, 0] == "answering patches were cut before layer 3"
    assert "unknown" in grey.hovertemplate
    assert len(heatmaps(V.VIEW["grounding"].figure(data(truth=TRUTH)))) == 1  # nothing cut: no grey layer
    from hap.views.report import head_text, truth_text

    assert "| grounding | unknown: answering patches were cut before layer 3 |" in head_text(
        data(truth=cut).at_layer(3), 0)
    assert "Grounding unknown (grey) in layer 3" in truth_text(cut, "")
    V.grounding_draw(V.grounding_grid(data(truth=cut)), "drawn")  # matplotlib draws the grey layer too


def test_head_inspector_draws_one_head_of_the_layer():
    d = data(truth=TRUTH)
    panels = V.head_panel(d, 1)
    assert [p.title for p in panels.panels] == ["layer 2 head 1: optimal"]
    np.testing.assert_array_equal(panels.panels[0].scores, d.head_maps[2, 1].reshape(GRID))
    assert panels.panels[0].outline.tolist() == [[True, True, False], [False, False, False]]
    with pytest.raises(ValueError, match=r"head=3 is outside the layer's heads 0..2"):
        V.head_panel(d, 3)


def test_sweep_plot_has_a_distinct_line_per_method_and_an_answer_grid():
    sweep = {"retain": [1.0, 0.5, 0.1], "unpruned": {"answer": "red", "answer_prob": 0.9}, "methods": {
        "hap": {"answers": ["red", "Red.", "blue"], "answer_prob": [0.9, 0.8, 0.2]},
        "fastv": {"answers": ["red", "", "blue"], "answer_prob": [0.9, 0.1, None]}}}
    fig = V.sweep_plotly(sweep, "sweep")
    lines, grid = fig.data[:2], fig.data[2]
    assert [(t.name, t.type) for t in fig.data] == [("hap", "scatter"), ("fastv", "scatter"), (None, "heatmap")]
    assert list(lines[1].y) == [0.9, 0.1, None] and list(lines[1].customdata) == [1.0, 0.5, 0.1]  # true budgets
    assert lines[0].line.dash != lines[1].line.dash and lines[0].marker.symbol != lines[1].marker.symbol
    assert all(a > b for a, b in zip(lines[1].x, lines[0].x))  # set apart: coinciding points stay visible
    np.testing.assert_allclose(np.array(lines[0].x) / np.array(lines[1].x), lines[0].x[0] / lines[1].x[0])
    assert np.asarray(grid.text).tolist() == [["red", "Red.", "blue"], ["red", "(empty)", "blue"]]
    assert np.asarray(grid.z).tolist() == [[1, 1, 0], [1, 0, 0]]  # the unpruned answer, case and full stop aside
    assert list(grid.y) == ["hap", "fastv"] and list(fig.layout.xaxis2.ticktext) == ["1", "0.5", "0.1"]
    assert fig.layout.xaxis.type == "log" and fig.layout.title.text == "sweep"
    assert V.same_answer(" Zero  blue!", "zero blue") and not V.same_answer("zero", "zero blue")
