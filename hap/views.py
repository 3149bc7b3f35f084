"""Every view of one run (the app's design card), drawn from plain arrays: plotly for the page, matplotlib for files.

Three steps, each its own function, and only the first reads a `hap.Result`:

1. `ViewData.from_result(result, image)`: the run as arrays on the visual grid (L layers, H heads,
   V visual tokens, G groups) plus the image as the grid covers it (`model_view`).
2. `View.inputs(data)`: one view's own plain inputs, a layer x head `HeadGrid` or a list of
   small-multiple `Panels`.
3. `View.plotly(inputs, title)` or `View.draw(inputs, title)`: the figure. Builders take arrays,
   grids and titles, never a model or a `Result`.

`VIEWS` is the one list of views (name, page label, title, inputs, plotly builder, matplotlib
drawing); the app's outputs, the CLI's `--figures` and `export_png` all walk it. Titles are
templates over `ViewData.title_fields`, written once.

On a scene with known ground truth (`Truth`: the patches answering the question and each head's
grounding on them, computed outside this module), every map outlines the answering patches and the
grounding grid sits beside PAQ; without it the outline is absent and the grid says why.

Token maps are selection scores s_v = ||M[:, v]||_2 (docs/method.md §6), drawn over the image,
transparent where low and red where high. Each small multiple is divided by its own highest score
(heads differ in scale by orders of magnitude), so a dispersed head looks flat and a focused one
shows its peaks; hovering shows the raw score. Tokens an earlier cut already removed are NaN in the
maps; their patches are dimmed.

plotly and matplotlib are imported when a figure is built, so `import hap` needs neither.
"""

from __future__ import annotations

import base64
import io
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import plotly.graph_objects as go
    from matplotlib.figure import Figure

    from . import Group, Result

from .layout import WHOLE, Layout, TokenView

CLASSES = ("", "sink", "dispersed", "optimal")  # index = colour code; "" = layer not scored
CLASS_LABELS = ("not scored", "sink", "dispersed", "optimal")
CLASS_COLORS = ("#d9d9d9", "#d62728", "#ffb000", "#2ca02c")
STATS = ("PAQ", "sink share", "dispersion", "visual share")  # the last axis of `ViewData.stats`
# Token maps over the image: low scores transparent (the image shows), high scores opaque red.
MAP_STOPS = ((0.0, (255, 255, 255, 0.0)), (0.4, (255, 200, 0, 0.35)), (1.0, (215, 0, 0, 0.9)))  # (at, RGBA)
PRUNED_BRIGHTNESS = 0.2  # pruned patches keep this fraction of their brightness
VIEW_PIXELS = 336  # side of the image under the maps (LLaVA-1.5's input size)
NO_CUTS = "nothing to show: this method made no cuts"
NO_TRUTH = "no ground truth for this image"
CUT_BEFORE = "answering patches were cut before layer {layer}"  # why a layer's grounding is unknown
UNKNOWN_COLOR = "#9e9e9e"  # grounding unknown: grey, never 0
OUTLINE_COLOR = "#00e5ff"  # the answering patches' outline on every map
PNG_DPI = 120
TITLE_CHAR_PX = 6.5  # a subplot title character's width at font size 11, rounded up: the wrapping budget
TITLE_LINE_PX = 15  # a subplot title line's height
COLORBAR_PX = 100  # the width the small multiples' colour bar takes from the panels
FIGURE_TITLE_CHAR_PX = 9  # a figure title character's width at plotly's title size (17), rounded up
FIGURE_TITLE_LINE_PX = 22  # a figure title line's height
FIGURE_TITLE_PAD_PX = 60  # the figure title's distance from the figure's top edge (the page's plot label and
#                           plotly's mode bar sit above it)


# --- plain data ------------------------------------------------------------------------------------
@dataclass
class Panel:
    """One small multiple: a token map (or none) over the image, tokens outside the sequence dimmed."""

    title: str
    view: np.ndarray  # [height, width, 3] uint8 image spanning the whole visual grid
    scores: np.ndarray | None = None  # [rows, cols] raw token scores, NaN where the token is absent
    present: np.ndarray | None = None  # bool [rows, cols] tokens in the sequence (None: all of them)
    outline: np.ndarray | None = None  # bool [rows, cols] patches outlined (the answering patches), or none
    grid: tuple[int, int] | None = None  # (rows, cols) of its own visual grid where it differs from its Panels'

    @classmethod
    def map(cls, title: str, view: np.ndarray, scores: np.ndarray, outline: np.ndarray | None = None) -> Panel:
        """A token map; the tokens it has no score for (already pruned) are dimmed."""
        absent = np.isnan(scores)
        return cls(title, view, scores, ~absent if absent.any() else None, outline)

    def background(self) -> np.ndarray:
        """The image with the absent tokens' patches dimmed, `[height, width, 3]` uint8."""
        return self.view if self.present is None else dim(self.view, self.present)


@dataclass
class Panels:
    """Small multiples on one visual grid, `cols` to a row; `width` is the page width the figure gets."""

    panels: list[Panel]
    grid: tuple[int, int]  # (rows, cols) of visual tokens
    cols: int = 4
    width: int = 1000


@dataclass
class HeadGrid:
    """A layer x head matrix with the token cuts marked."""

    values: np.ndarray  # [layers, heads]: class codes (index into CLASSES) or PAQ
    cuts: list[tuple[int, str]]  # (first layer of a group, its label)
    stats: np.ndarray | None = None  # [layers, heads, len(STATS)] shown on hover (class grid)
    unknown: list[str] | None = None  # [layers] why the layer's values are unknown, drawn grey ("" where known)

    def unknown_mask(self) -> np.ndarray:
        """bool [layers, heads]: the cells of the layers whose values are unknown."""
        rows = [bool(why) for why in self.unknown or [""] * self.values.shape[0]]
        return np.repeat(np.array(rows, dtype=bool)[:, None], self.values.shape[1], axis=1)


@dataclass
class Truth:
    """What a scene's ground truth says about one run, as plain arrays (computed by hap.ground_truth)."""

    question: str  # the question the truth is for
    patches: np.ndarray  # bool [V] the patches that answer it (outlined on every map; none for a text question)
    grounding: np.ndarray | None  # [layers, heads] attention share on them / their area share (NaN: not scored
    #                               or unknown)
    spearman: float | None  # rank correlation of PAQ and grounding over the heads with a grounding
    kept_recall: list[float | None]  # [G] share of the answering patches each group runs on
    cut: np.ndarray | None = None  # bool [layers]: the layer's input held no answering patch (grounding unknown)

    def unknown(self, layer: int) -> str:
        """Why `layer`'s grounding is unknown, or "" when it is known (or not scored)."""
        return CUT_BEFORE.format(layer=layer) if self.cut is not None and self.cut[layer] else ""


@dataclass
class ViewData:
    """One run as the views need it: plain arrays, no model, no `Result`."""

    image: np.ndarray  # [height, width, 3] uint8, the image as the visual grid covers it
    grid: tuple[int, int]  # (rows, cols); rows * cols = V
    head_class: list[list[str]]  # [layers][heads] a CLASSES entry ("" where not scored)
    stats: np.ndarray  # [layers, heads, len(STATS)], NaN where not scored
    head_maps: np.ndarray  # [layers, heads, V] per-head scores before fusion (NaN: absent token, uncaptured layer)
    head_attention: np.ndarray  # [layers, heads, V] each head's prompt-row attention over the image, sums to 1
    layer_maps: np.ndarray  # [layers, V] after head fusion
    group_maps: np.ndarray  # [G, V] after layer fusion: the scores each cut ranked
    group_uniform: np.ndarray  # [G, V] plain head average counterpart
    groups: Sequence[Group]  # index, layers [start, end), scored_by, kept (visual indices)
    method: str = "hap"
    temperature: float = 0.1
    merged: bool = False  # the dropped tokens were folded into the kept ones (HAP+ merge, docs/method.md §10)
    layer: int = 0  # the layer whose per-head maps are drawn
    truth: Truth | None = None  # the scene's ground truth, when the image carries it for this prompt
    visual_per_layer: Sequence[int] = ()  # [layers] visual tokens each layer processed (empty: every token)
    curve: dict | None = None  # AutoPrune's chosen curve (`Result.curve`), None for the other methods
    layout: Layout | None = None  # where each visual token lies on the uploaded image (`hap.layout`); None or one
    #                               view over the whole image: `image` and `grid` say it all
    view_images: tuple[np.ndarray, ...] = ()  # [views] the uploaded image under each view of a tiled `layout`

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, heads, visual tokens)."""
        return self.head_maps.shape

    @classmethod
    def from_result(cls, result: Result, image: Image.Image | str | Path | None = None,
                    layer: int | None = None) -> ViewData:
        """Everything the views draw from `result` over the uploaded `image` (None: grey): `image` is the part of it
        under a layout of one view (LLaVA-1.5's centre crop), else the whole image squashed (`model_view`).

        `layer` picks the per-head maps (default: `default_layer`).
        """
        stats = np.stack([_array(t) for t in (result.paq, result.sink_share, result.dispersion,
                                               result.visual_share)], -1)
        layout = getattr(result, "layout", None)  # a Result read back from JSON, or an older one, may lack it
        layout = None if layout is None else Layout.from_dict(layout)
        tiled = layout is not None and not single_view(layout)
        view_images = tuple(view_image(image, v.box, v.grid, spans=v.spans()) for v in layout.views) if tiled else ()
        data = cls(
            image=view_images[0] if len(view_images) == 1 else model_view(image), grid=tuple(result.visual_grid),
            head_class=result.head_class,
            stats=stats, head_maps=_array(result.maps.head), head_attention=_array(result.maps.head_attention),
            layer_maps=_array(result.maps.layer),
            group_maps=_array(result.maps.group), group_uniform=_array(result.maps.group_uniform),
            groups=result.groups, method=result.method, temperature=result.config["temperature"],
            merged=result.method == "hap" and result.config["merge"] != "none",
            visual_per_layer=list(result.visual_per_layer), curve=result.curve, layout=layout if tiled else None,
            view_images=view_images,
        )
        return data.at_layer(default_layer(result.groups, stats[..., 0]) if layer is None else layer)

    def at_layer(self, layer: int) -> ViewData:
        """The same run with the per-head maps of `layer`; ValueError outside the decoder's layers."""
        layers = self.shape[0]
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < layers:
            raise ValueError(f"layer={layer!r} is outside the decoder's layers 0..{layers - 1}")
        return replace(self, layer=int(layer))

    def on_grid(self, values) -> np.ndarray:
        """`[V]` values -> `[rows, cols]` float array."""
        return np.asarray(values, dtype=float).reshape(self.grid)

    def on_views(self, values) -> list[np.ndarray]:
        """Per-token `values` [V] (float or bool) on each panel's grid: `[rows, cols]` of the one grid, or of each view
        of a tiled layout (NaN / False where a cell holds no token)."""
        values = np.asarray(values)
        if self.layout is None:
            return [values.reshape(self.grid).astype(bool if values.dtype == bool else float)]
        return [view.values(values if values.dtype == bool else values.astype(float)) for view in self.layout.views]

    def panels(self, title: str, scores=None, present=None, outline: bool = True) -> list[Panel]:
        """A map of the visual tokens as panels over the image: `scores` [V] (NaN: absent, dimmed) or none, `present`
        bool [V] the tokens not dimmed (None: every scored one), `outline`: the answering patches outlined where
        known. One panel, or for a tiled layout one per view of it, titled with the view's name, each on the image
        under that view (a cell holding no token is dimmed)."""
        cells = [None] * self.views_count() if scores is None else self.on_views(scores)
        if present is None:  # the scored tokens, None where every one is
            shown = [None if c is None or not np.isnan(c).any() else ~np.isnan(c) for c in cells]
        else:
            shown = self.on_views(np.asarray(present, dtype=bool))
        if self.layout is None:
            return [Panel(title, self.image, cells[0], shown[0], self.outline() if outline else None)]
        return [Panel(f"{title}\n{view.name}", image, c, m, None, view.grid)
                for view, image, c, m in zip(self.layout.views, self.view_images, cells, shown)]

    def views_count(self) -> int:
        """Panels per map: 1, or the tiled layout's views."""
        return 1 if self.layout is None else len(self.layout.views)

    def outline(self) -> np.ndarray | None:
        """bool [rows, cols] answering patches to outline on every map, None without ground truth."""
        return None if self.truth is None else np.asarray(self.truth.patches, dtype=bool).reshape(self.grid)

    def cuts(self) -> list[tuple[int, str]]:
        """(first layer, label) of every group, for the boundaries drawn on layer x head views."""
        return [(g.layers[0], f"group {g.index}: {len(g.kept)} of {self.shape[2]} tokens") for g in self.groups]

    def title_fields(self) -> dict[str, str]:
        """What view titles may name: {method}, {temperature}, {layer}, {classes}, {grounding}, {curve}."""
        counts = class_counts(self.head_class)
        c = self.curve
        curve = "" if c is None else (f"; AutoPrune MI_1 {c['mi1']:.3f} -> slope {c['slope']:.3f} "
                                      f"(budget {c['budget']}, S {c['first_keep']})")
        return dict(method=self.method, temperature=f"{self.temperature:g}", layer=str(self.layer),
                    classes=", ".join(f"{n} {c}" for c, n in counts.items()), grounding=grounding_caption(self.truth),
                    curve=curve)


def _array(values) -> np.ndarray:
    return np.asarray(values, dtype=float)


# --- helpers on plain data -------------------------------------------------------------------------
def model_view(image: Image.Image | str | Path | None, size: int = VIEW_PIXELS) -> np.ndarray:
    """The image (or its file) as one grid over the whole of it covers it, `[size, size, 3]` uint8: squashed to a
    square here and stretched back to the grid's shape when drawn (a grid over part of the image, such as LLaVA-1.5's
    centre crop, is a layout's view: `view_image`). Without an image, a neutral grey square.
    """
    if image is None:
        return np.full((size, size, 3), 128, np.uint8)
    image = _rgb(image)
    return np.asarray(image.resize((size, size), Image.Resampling.BICUBIC))


def _rgb(image: Image.Image | str | Path) -> Image.Image:
    """The image, or its file, in RGB."""
    if isinstance(image, (str, Path)):
        with Image.open(image) as opened:
            return opened.convert("RGB")
    return image.convert("RGB")


def single_view(layout: Layout) -> bool:
    """Whether `layout` is one grid over the whole image, drawn as before tiling (`model_view`)."""
    return len(layout.views) == 1 and tuple(layout.views[0].box) == WHOLE


def view_image(image: Image.Image | str | Path | None, box: tuple[float, float, float, float],
               grid: tuple[int, int], size: int = VIEW_PIXELS, spans: tuple | None = None) -> np.ndarray:
    """The part of the uploaded image under one view of a tiled layout: the rectangle `box` (fractions of the
    image, beyond [0, 1] where the view covers padding, drawn grey), at the aspect of the view's `grid` (rows, cols),
    `size` pixels on its longer side -> `[height, width, 3]` uint8. With `spans` (`TokenView.spans`: the columns'
    and rows' (start, end) on the image) each equal cell of the panel shows exactly the pixels its token sees, a strip
    that no patch sees left out; without, the box cut into equal cells."""
    rows, cols = grid
    width, height = (size, max(1, round(size * rows / cols))) if cols >= rows else (max(1, round(size * cols / rows)),
                                                                                    size)
    if image is None:
        return np.full((height, width, 3), 128, np.uint8)
    image = _rgb(image)
    columns, row_spans = spans if spans is not None else TokenView("", grid, (), box).spans()
    xs, ys = cell_samples(columns, image.width, 4 * size), cell_samples(row_spans, image.height, 4 * size)
    pixels = np.asarray(image)[ys.clip(0, image.height - 1)][:, xs.clip(0, image.width - 1)]
    pixels[(ys < 0) | (ys >= image.height)] = 128
    pixels[:, (xs < 0) | (xs >= image.width)] = 128
    return np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.BICUBIC))


def cell_samples(spans: np.ndarray, length: int, most: int) -> np.ndarray:
    """long [cells * k]: the image pixel (along an axis of `length` pixels; outside [0, length): none) under each of
    k equal steps through each cell of `spans` [cells, 2] (fractions), k about the widest cell's pixels but at most
    `most` samples in all (enough to draw the panel smoothly, few enough for a 40-megapixel upload)."""
    spans = np.asarray(spans, float)
    k = max(1, min(math.ceil(((spans[:, 1] - spans[:, 0]) * length).max()), most // len(spans)))
    steps = (np.arange(k) + 0.5) / k
    return np.floor((spans[:, :1] + (spans[:, 1:] - spans[:, :1]) * steps) * length).astype(int).ravel()


def dim(view: np.ndarray, present: np.ndarray) -> np.ndarray:
    """`view` [h, w, 3] with the patches of the tokens not `present` (bool [rows, cols]) dimmed."""
    rows, cols = present.shape
    h, w = view.shape[:2]
    pixel_present = present[np.arange(h) * rows // h][:, np.arange(w) * cols // w]  # [h, w]
    return (view * np.where(pixel_present, 1.0, PRUNED_BRIGHTNESS)[..., None]).astype(np.uint8)


def relative(scores: np.ndarray) -> np.ndarray:
    """Scores divided by the panel's highest (NaN kept): a flat map stays flat, a focused one shows its peaks."""
    finite = scores[np.isfinite(scores)]
    high = finite.max() if finite.size else 0.0
    return scores / high if high > 0 else np.where(np.isnan(scores), np.nan, 0.0)


def top_k(scores: np.ndarray, k: int) -> set[int]:
    """Indices of the k highest finite scores of `[V]`, ties broken by position (as `hap.fusion.select_top`)."""
    finite = np.where(np.isnan(scores), -np.inf, scores)
    return set(np.argsort(-finite, kind="stable")[:k].tolist())


def scored_layers(paq: np.ndarray) -> list[int]:
    """Layers of `paq` [layers, heads] whose attention was captured (not all NaN)."""
    return [l for l, row in enumerate(np.asarray(paq, dtype=float)) if not np.isnan(row).all()]


def default_layer(groups: Sequence[Group], paq: np.ndarray) -> int:
    """The layer to show per-head maps for: the last one scoring the first cut, else the first captured."""
    if groups and groups[0].scored_by:
        return groups[0].scored_by[-1]
    layers = scored_layers(paq)
    return layers[0] if layers else 0


def grounding_caption(truth: Truth | None) -> str:
    """What the grounding grid's title says: the Spearman with PAQ, or why there is no grid."""
    if truth is None:
        return NO_TRUTH
    if truth.grounding is None:
        return f"no patch answers {truth.question!r} (answered from the prompt alone)"
    rho = "undefined" if truth.spearman is None else f"{truth.spearman:.2f}"
    return f"Spearman with PAQ {rho}"


def grounding_high(values: np.ndarray) -> float:
    """Top of the grounding colour scale: the highest finite value, at least 2 (1 = no preference sits inside)."""
    finite = values[np.isfinite(values)]
    return max(2.0, float(finite.max()) if finite.size else 0.0)


def outline_segments(mask: np.ndarray) -> tuple[list[float | None], list[float | None]]:
    """(x, y) polyline of the outer edges of the `True` cells of a bool [rows, cols] mask, cell centres on the
    integers, segments separated by None (plotly) / NaN once converted (matplotlib)."""
    padded = np.pad(np.asarray(mask, dtype=bool), 1)
    xs: list[float | None] = []
    ys: list[float | None] = []
    for r, c in zip(*np.nonzero(padded[1:-1, 1:-1])):
        for dr, dc, (x0, y0, x1, y1) in ((-1, 0, (-0.5, -0.5, 0.5, -0.5)), (1, 0, (-0.5, 0.5, 0.5, 0.5)),
                                         (0, -1, (-0.5, -0.5, -0.5, 0.5)), (0, 1, (0.5, -0.5, 0.5, 0.5))):
            if not padded[r + 1 + dr, c + 1 + dc]:
                xs += [c + x0, c + x1, None]
                ys += [r + y0, r + y1, None]
    return xs, ys


def class_counts(head_class: list[list[str]]) -> dict[str, int]:
    """How many scored heads of `head_class` [layers][heads] fall in each class."""
    flat = [c for row in head_class for c in row if c]
    return {c: flat.count(c) for c in CLASSES[1:]}


def multiples_columns(count: int) -> int:
    """Columns of a grid of `count` small multiples: 4 per row, 8 for the 16+ heads or layers of real models."""
    return 4 if count <= 8 else 8


def _layers(layers: Sequence[int]) -> str:
    if not layers:
        return "no attention (random)"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {', '.join(map(str, layers))}"


def _span(group: Group) -> str:
    return f"group {group.index} (layers {group.layers[0]}-{group.layers[1] - 1})"


# --- each view's inputs ----------------------------------------------------------------------------
def class_grid(data: ViewData) -> HeadGrid:
    """Class codes [layers, heads] with every head's statistics for hover."""
    codes = np.array([[CLASSES.index(c) for c in row] for row in data.head_class], dtype=float)
    return HeadGrid(codes, data.cuts(), data.stats)


def paq_grid(data: ViewData) -> HeadGrid:
    """PAQ [layers, heads]."""
    return HeadGrid(data.stats[..., 0], data.cuts())


def head_map_panels(data: ViewData) -> Panels:
    """Per-head token maps of `data.layer`, before fusion."""
    layer, heads = data.layer, data.shape[1]
    panels = [
        panel for h in range(heads) for panel in data.panels(
            f"L{layer} H{h}: {data.head_class[layer][h] or 'not scored'}\nPAQ {data.stats[layer, h, 0]:.3g}",
            data.head_maps[layer, h])
    ]
    return Panels(panels, data.grid, multiples_columns(len(panels)))


def layer_map_panels(data: ViewData) -> Panels:
    """Head-fused (softmax(PAQ / T) over heads) maps, one per captured layer."""
    layers = scored_layers(data.stats[..., 0])
    panels = [panel for l in layers for panel in data.panels(f"layer {l} (head fusion)", data.layer_maps[l])]
    return Panels(panels, data.grid, multiples_columns(len(panels)))


def group_map_panels(data: ViewData) -> Panels:
    """Layer-fused maps, one per group: the scores that chose the group's tokens."""
    panels = [panel for g in data.groups
              for panel in data.panels(f"{_span(g)}\nscored by {_layers(g.scored_by)}", data.group_maps[g.index])]
    return Panels(panels, data.grid, cols=3 * data.views_count())


def comparison_panels(data: ViewData) -> Panels:
    """The uniform head average of every group (first row), then the PAQ-weighted maps with their top-k overlap."""
    uniform, weighted = [], []
    for g in data.groups:
        k, plain, paq = len(g.kept), data.group_uniform[g.index], data.group_maps[g.index]
        shared = len(top_k(plain, k) & top_k(paq, k))
        uniform += data.panels(f"group {g.index}: uniform average", plain)
        weighted += data.panels(f"group {g.index}: PAQ-weighted\n{shared} of the top {k} shared", paq)
    return Panels(uniform + weighted, data.grid, cols=max(1, len(data.groups) * data.views_count()))


def mask_panels(data: ViewData) -> Panels:
    """The image dimmed outside the tokens each group runs on (with a merge, the dimmed ones live on in them)."""
    visual = data.shape[2]
    panels = []
    for g in data.groups:
        present = np.zeros(visual, dtype=bool)
        present[list(g.kept)] = True
        title = f"{_span(g)}:\n{len(g.kept)}/{visual} kept" + (",\nthe rest merged into them" if data.merged else "")
        panels += data.panels(title, present=present)
    return Panels(panels, data.grid, cols=3 * data.views_count(), width=650)


def grounding_grid(data: ViewData) -> HeadGrid:
    """Grounding [layers, heads] on the answering patches (NaN everywhere without them), with the layers whose
    input no longer held any of them marked unknown."""
    truth = data.truth
    if truth is None or truth.grounding is None:
        return HeadGrid(np.full(data.shape[:2], np.nan), data.cuts())
    unknown = [truth.unknown(layer) for layer in range(data.shape[0])]
    return HeadGrid(np.asarray(truth.grounding, dtype=float), data.cuts(), unknown=unknown)


def head_panel(data: ViewData, head: int) -> Panels:
    """One head of `data.layer`, its map over the image (the head inspector); ValueError outside the heads."""
    heads = data.shape[1]
    if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or not 0 <= head < heads:
        raise ValueError(f"head={head!r} is outside the layer's heads 0..{heads - 1}")
    layer = data.layer
    title = f"layer {layer} head {head}: {data.head_class[layer][head] or 'not scored'}"
    panels = data.panels(title, data.head_maps[layer, head])
    return Panels(panels, data.grid, cols=len(panels), width=1000)  # as tall as a map of a three-column row


# --- plotly ----------------------------------------------------------------------------------------
def class_grid_plotly(grid: HeadGrid, title: str) -> go.Figure:
    """Layer x head grid coloured by class; hover shows every statistic of STATS."""
    import plotly.graph_objects as go

    n = len(CLASSES)
    scale = [[i / n + e / n, CLASS_COLORS[i]] for i in range(n) for e in (0, 1)]
    labels = [[CLASS_LABELS[int(c)] for c in row] for row in grid.values]
    hover = "<br>".join(f"{name} %{{customdata[{i}]:.3f}}" for i, name in enumerate(STATS))
    fig = go.Figure(go.Heatmap(
        z=grid.values, customdata=grid.stats, text=labels, zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=1, ygap=1,
        colorbar=dict(tickvals=list(range(n)), ticktext=list(CLASS_LABELS), title="class"),
        hovertemplate=f"layer %{{y}} head %{{x}}: <b>%{{text}}</b><br>{hover}<extra></extra>",
    ))
    return _layer_head_layout(fig, grid, title)


def paq_plotly(grid: HeadGrid, title: str) -> go.Figure:
    """PAQ per layer and head, with the group boundaries (where tokens are cut) marked."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(
        z=grid.values, colorscale="Viridis", zmin=0, colorbar=dict(title="PAQ"),
        hovertemplate="layer %{y} head %{x}<br>PAQ %{z:.3f}<extra></extra>",
    ))
    return _layer_head_layout(fig, grid, title)


def grounding_plotly(grid: HeadGrid, title: str) -> go.Figure:
    """Grounding per layer and head: above 1 (red) the head looks at the answering patches more than their area;
    grey where it is unknown, the reason on hover."""
    import plotly.graph_objects as go

    high = grounding_high(grid.values)
    scale = [[0.0, "#2166ac"], [1.0 / high, "#f7f7f7"], [1.0, "#b2182b"]]  # white at 1: no preference
    fig = go.Figure(go.Heatmap(
        z=grid.values, colorscale=scale, zmin=0.0, zmax=high, colorbar=dict(title="grounding"), hoverongaps=False,
        hovertemplate="layer %{y} head %{x}<br>grounding %{z:.2f}<extra></extra>",
    ))
    unknown = grid.unknown_mask()
    if unknown.any():
        why = np.array(grid.unknown, dtype=object)[:, None].repeat(unknown.shape[1], 1)
        fig.add_trace(go.Heatmap(
            z=np.where(unknown, 0.0, np.nan), text=why, colorscale=[[0, UNKNOWN_COLOR], [1, UNKNOWN_COLOR]],
            showscale=False, hoverongaps=False, name="unknown",
            hovertemplate="layer %{y} head %{x}<br>grounding unknown: %{text}<extra></extra>",
        ))
    return _layer_head_layout(fig, grid, title)


def _layer_head_layout(fig: go.Figure, grid: HeadGrid, title: str) -> go.Figure:
    """Shared layout of the layer x head views: layer 0 on top, one tick per layer, cut lines."""
    layers, heads = grid.values.shape
    for layer, label in grid.cuts:
        fig.add_hline(y=layer - 0.5, line=dict(color="white", width=2, dash="dash"))
        fig.add_annotation(x=1.0, xref="paper", xanchor="right", y=layer - 0.5, yanchor="top", text=label,
                           showarrow=False, font=dict(color="white", size=11), bgcolor="rgba(0,0,0,0.45)")
    fig.update_yaxes(title="layer", range=[layers - 0.5, -0.5], dtick=_tick(layers))
    fig.update_xaxes(title="head", range=[-0.5, heads - 0.5], dtick=_tick(heads))
    fig.update_layout(title=title, height=max(320, 60 + 22 * layers), margin=dict(l=50, r=20, t=50, b=40))
    return fig


def _tick(count: int) -> int:
    return 1 if count <= 16 else 4


def _data_uri(background: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(background).save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def panels_plotly(multiples: Panels, title: str) -> go.Figure:
    """Small multiples: each panel's image with its token map blended over it."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = multiples.panels
    if not panels:
        return _no_cuts_plotly(title)
    cols = min(multiples.cols, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    titles = [wrap_title(p.title, int((multiples.width - COLORBAR_PX) / cols / TITLE_CHAR_PX)) for p in panels]
    lines = max(t.count("<br>") + 1 for t in titles)
    title = wrap_title(title, int(multiples.width / FIGURE_TITLE_CHAR_PX))
    top = FIGURE_TITLE_PAD_PX + (title.count("<br>") + 1) * FIGURE_TITLE_LINE_PX + 10 + lines * TITLE_LINE_PX
    height = top - 20 + rows_n * (20 + lines * TITLE_LINE_PX + multiples.width // max(cols, 3))
    fig = make_subplots(rows_n, cols, subplot_titles=titles, horizontal_spacing=0.02,
                        vertical_spacing=(10 + lines * TITLE_LINE_PX) / height)
    uris: dict[int, str] = {}  # one encoded image per image shown: the dimmed patches are drawn over it
    for i, panel in enumerate(panels):
        grid_rows, grid_cols = grid = panel.grid or multiples.grid
        fig.add_layout_image(source=uris.setdefault(id(panel.view), _data_uri(panel.view)), x=-0.5, y=-0.5,
                             sizex=grid_cols, sizey=grid_rows, xanchor="left", yanchor="top", sizing="stretch",
                             layer="below", row=i // cols + 1, col=i % cols + 1)
        for trace in _panel_traces(panel, grid):
            fig.add_trace(trace, i // cols + 1, i % cols + 1)
        if panel.outline is not None and panel.outline.any():
            xs, ys = outline_segments(panel.outline)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=OUTLINE_COLOR, width=2),
                                     hoverinfo="skip", showlegend=False), i // cols + 1, i % cols + 1)
        suffix = "" if i == 0 else str(i + 1)
        fig.layout[f"xaxis{suffix}"].update(range=[-0.5, grid_cols - 0.5])
        fig.layout[f"yaxis{suffix}"].update(scaleanchor=f"x{suffix}", autorange="reversed",
                                            range=[grid_rows - 0.5, -0.5])
    fig.update_xaxes(visible=False, constrain="domain")
    fig.update_yaxes(visible=False, constrain="domain")
    fig.update_annotations(font_size=11)
    fig.update_layout(title=dict(text=title, y=1, yref="container", yanchor="top", pad=dict(t=FIGURE_TITLE_PAD_PX)),
                      height=height, margin=dict(l=10, r=10, t=top, b=10),
                      coloraxis=dict(colorscale=[[at, f"rgba({r},{g},{b},{a})"] for at, (r, g, b, a) in MAP_STOPS],
                                     cmin=0, cmax=1, colorbar=dict(title="score /<br>highest", len=0.6)))
    return fig


def wrap_title(title: str, chars: int) -> str:
    """A subplot title broken at spaces so that no line is longer than `chars` (at least 12; a longer word stays
    whole), its own line breaks ("\n") kept, lines joined by "<br>": it then fits its panel, at the edges too."""
    return "<br>".join(part for line in title.split("\n") for part in textwrap.wrap(line, max(chars, 12)) or [""])


def _no_cuts_plotly(title: str, text: str = NO_CUTS) -> go.Figure:
    """An empty figure that says there is nothing to show."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_annotation(text=text, showarrow=False)
    fig.update_layout(title=title, height=200, xaxis_visible=False, yaxis_visible=False)
    return fig


def _panel_traces(panel: Panel, grid: tuple[int, int]) -> list:
    """What one panel draws over its image (a layout image, below): the absent tokens' patches dimmed, then its token
    map (or, for a mask, the pruned patches dimmed by a layer naming each token on hover)."""
    import plotly.graph_objects as go

    index = np.arange(grid[0] * grid[1]).reshape(grid)
    dark = f"rgba(0,0,0,{1 - PRUNED_BRIGHTNESS:g})"  # over a patch: PRUNED_BRIGHTNESS of its brightness left
    if panel.scores is None and panel.present is not None:
        return [go.Heatmap(
            z=panel.present.astype(float), text=np.where(panel.present, "kept", "pruned"), customdata=index,
            showscale=False, colorscale=[[0, dark], [1, "rgba(0,0,0,0)"]], zmin=0, zmax=1,
            hovertemplate="token %{customdata} (row %{y}, col %{x}): %{text}<extra></extra>")]
    traces = []
    if panel.present is not None:
        traces.append(go.Heatmap(z=np.where(panel.present, np.nan, 1.0), colorscale=[[0, dark], [1, dark]],
                                 showscale=False, hoverinfo="skip", hoverongaps=False))
    if panel.scores is not None:
        traces.append(go.Heatmap(
            z=relative(panel.scores), customdata=np.stack([panel.scores, index], -1), coloraxis="coloraxis",
            hoverongaps=False,
            hovertemplate="token %{customdata[1]} (row %{y}, col %{x})<br>score %{customdata[0]:.3g}"
                          "<br>%{z:.0%} of the panel's highest<extra></extra>",
        ))
    return traces


SWEEP_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")  # one per method, cycled
SWEEP_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "triangle-down")
SWEEP_SPREAD = 0.5  # the methods' markers share this fraction of the log step between two budgets
SWEEP_SAME, SWEEP_DIFFERENT = "#a1d99b", "#fc9272"  # grid cells: the unpruned answer or another one


def same_answer(answer: str, reference: str) -> bool:
    """Whether two answers say the same, case, spacing and trailing punctuation aside."""
    def words(text: str) -> str:
        return " ".join(text.lower().split()).rstrip(" .!?,;:")
    return words(answer) == words(reference)


def sweep_offsets(retain: Sequence[float], count: int) -> np.ndarray:
    """Multiplicative x offsets `[count]` that set `count` methods' markers side by side around each budget of
    `retain` (log-spaced), spread over `SWEEP_SPREAD` of the log step so coinciding points stay visible."""
    logs = np.log10(np.asarray(retain, dtype=float))
    step = float(np.abs(np.diff(logs)).mean()) if len(logs) > 1 else 0.1
    return 10 ** ((np.arange(count) - (count - 1) / 2) * SWEEP_SPREAD * step / max(count, 1))


def sweep_plotly(sweep: dict, title: str) -> go.Figure:
    """A budget sweep, `{"retain": [R], "methods": {name: {"answers": [R], "answer_prob": [R]}}, "unpruned":
    {"answer": str, ...}}`, 1.0 on the left: the probability each method gives the unpruned answer against the
    retained fraction (top; log axis, each method its own colour, dash and marker, set slightly apart so that
    coinciding lines stay visible), and a methods x budgets grid of the answers (bottom; green where the answer is
    the unpruned one, red where it differs)."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    retain, methods = sweep["retain"], sweep["methods"]
    reference = sweep["unpruned"]["answer"]
    names = list(methods)
    fig = make_subplots(2, 1, vertical_spacing=0.14, row_heights=[0.5, 0.5], subplot_titles=[
        "probability of the unpruned answer", "answer (green: the unpruned one, red: another)"])
    offsets = sweep_offsets(retain, len(names))
    for i, name in enumerate(names):
        color = qualitative.Plotly[i % len(qualitative.Plotly)]
        fig.add_trace(go.Scatter(
            x=np.asarray(retain) * offsets[i], y=methods[name]["answer_prob"], customdata=retain, name=name,
            mode="lines+markers", line=dict(color=color, dash=SWEEP_DASHES[i % len(SWEEP_DASHES)], width=2),
            marker=dict(symbol=SWEEP_SYMBOLS[i % len(SWEEP_SYMBOLS)], size=9, line=dict(width=1, color="white")),
            hovertemplate=f"{name}: retain %{{customdata:.3g}}<br>p = %{{y:.3f}}<extra></extra>"), 1, 1)
    answers = [["(out of reach)" if a is None else a or "(empty)" for a in methods[n]["answers"]] for n in names]
    same = [[np.nan if a is None else float(same_answer(a, reference)) for a in methods[n]["answers"]] for n in names]
    probs = [[np.nan if p is None else p for p in methods[n]["answer_prob"]] for n in names]
    columns = [f"{r:.3g}" for r in retain]
    fig.add_trace(go.Heatmap(
        z=same, x=list(range(len(retain))), y=names, text=answers,
        customdata=np.dstack([probs, [columns] * len(names)]),
        texttemplate="%{text}", textfont=dict(size=12), zmin=0, zmax=1, showscale=False, xgap=2, ygap=2,
        colorscale=[[0, SWEEP_DIFFERENT], [0.5, SWEEP_DIFFERENT], [0.5, SWEEP_SAME], [1, SWEEP_SAME]],
        hovertemplate="%{y} at retain %{customdata[1]}: %{text}<br>p(unpruned answer) = %{customdata[0]:.3f}"
                      "<extra></extra>", showlegend=False), 2, 1)
    logs = np.log10(np.asarray(retain, dtype=float))
    half = float(np.abs(np.diff(logs)).mean()) / 2 if len(logs) > 1 else 0.1
    label = "visual tokens retained (layer average)"
    fig.update_xaxes(type="log", range=[logs[0] + half, logs[-1] - half], tickvals=retain, ticktext=columns,
                     title=label, row=1, col=1)
    fig.update_xaxes(range=[-0.5, len(retain) - 0.5], tickvals=list(range(len(retain))), ticktext=columns,
                     title=label, row=2, col=1)  # columns under the budgets above (log-spaced budgets)
    fig.update_yaxes(range=[-0.03, 1.03], title="p", row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    refused = sweep.get("refused") or {}
    if refused:  # named, not silently missing: the reasons are in the JSON's "refused"
        title = f"{title}<br><sup>not run on this model: {', '.join(refused)} (the JSON's \"refused\" says why)</sup>"
    fig.update_layout(title=title, height=560 + 34 * len(names), margin=dict(l=90, r=20, t=90, b=50),
                      legend=dict(title="method", y=1.0, yanchor="top"))
    return fig


# --- matplotlib ------------------------------------------------------------------------------------
def class_grid_draw(grid: HeadGrid, title: str) -> Figure:
    """Layer x head grid coloured by class, with a legend."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    fig, ax, _ = _layer_head_draw(grid, title, cmap=ListedColormap(CLASS_COLORS), vmin=-0.5,
                                  vmax=len(CLASSES) - 0.5)
    ax.legend(handles=[Patch(color=c, label=l) for c, l in zip(CLASS_COLORS, CLASS_LABELS)],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    return fig


def paq_draw(grid: HeadGrid, title: str) -> Figure:
    """PAQ per layer and head, with a colour bar."""
    fig, ax, image = _layer_head_draw(grid, title, cmap="viridis", vmin=0)
    fig.colorbar(image, ax=ax, label="PAQ")
    return fig


def grounding_draw(grid: HeadGrid, title: str) -> Figure:
    """Grounding per layer and head, diverging around 1, with a colour bar; grey where it is unknown."""
    from matplotlib.colors import ListedColormap, TwoSlopeNorm
    from matplotlib.patches import Patch

    fig, ax, image = _layer_head_draw(grid, title, cmap="RdBu_r",
                                      norm=TwoSlopeNorm(1.0, 0.0, grounding_high(grid.values)))
    fig.colorbar(image, ax=ax, label="grounding")
    unknown = grid.unknown_mask()
    if unknown.any():
        ax.imshow(np.where(unknown, 0.0, np.nan), aspect="auto", interpolation="nearest",
                  cmap=ListedColormap([UNKNOWN_COLOR]))
        ax.legend(handles=[Patch(color=UNKNOWN_COLOR, label="unknown: answering patches cut before the layer")],
                  loc="upper left", bbox_to_anchor=(0, -0.12), fontsize=7)
    return fig


def _layer_head_draw(grid: HeadGrid, title: str, **imshow) -> tuple:
    """(figure, axes, image) of a layer x head matrix with the cut lines."""
    from matplotlib.figure import Figure

    layers, heads = grid.values.shape
    fig = Figure(figsize=(max(6.0, 1.6 + 0.3 * heads), max(3.0, 1.2 + 0.3 * layers)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(grid.values, aspect="auto", interpolation="nearest", **imshow)
    for layer, label in grid.cuts:
        ax.axhline(layer - 0.5, color="white", linestyle="--", linewidth=1.5)
        ax.text(heads - 0.6, layer - 0.4, label, color="white", ha="right", va="top", fontsize=7,
                bbox=dict(facecolor="black", alpha=0.45, linewidth=0))
    ax.set(xlabel="head", ylabel="layer", title=title)
    ax.set_xticks(range(0, heads, _tick(heads)))
    ax.set_yticks(range(0, layers, _tick(layers)))
    return fig, ax, image


def panels_draw(multiples: Panels, title: str) -> Figure:
    """Small multiples: each panel's image with its token map blended over it."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LinearSegmentedColormap, Normalize
    from matplotlib.figure import Figure

    panels = multiples.panels
    cmap = LinearSegmentedColormap.from_list(
        "hap_map", [(at, (r / 255, g / 255, b / 255, a)) for at, (r, g, b, a) in MAP_STOPS])
    cols = max(1, min(multiples.cols, len(panels)))
    rows_n = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(2.6 * cols, 2.6 * rows_n + 0.5), layout="constrained")
    axes = fig.subplots(rows_n, cols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        grid_rows, grid_cols = panel.grid or multiples.grid
        extent = (-0.5, grid_cols - 0.5, grid_rows - 0.5, -0.5)
        ax.imshow(panel.background(), extent=extent)
        if panel.scores is not None:
            ax.imshow(relative(panel.scores), extent=extent, cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        if panel.outline is not None and panel.outline.any():
            xs, ys = (np.array(v, dtype=float) for v in outline_segments(panel.outline))  # None -> NaN: breaks
            ax.plot(xs, ys, color=OUTLINE_COLOR, linewidth=1.5)
        ax.set_title(panel.title, fontsize=7)
    for ax in axes:
        ax.axis("off")
    if any(p.scores is not None for p in panels):
        fig.colorbar(ScalarMappable(Normalize(0, 1), cmap), ax=axes.tolist(), shrink=0.6, label="score / highest")
    fig.suptitle(title if panels else f"{title}: {NO_CUTS}")
    return fig


# --- visual tokens per layer -------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenCounts:
    """What each decoder layer ran on, and for AutoPrune the curve it chose."""

    processed: list[int]  # [layers] visual tokens each layer processed (recycled ones included)
    after_drop: list[int] | None  # AutoPrune: [layers] visual tokens after each layer's own drop (its accounting)
    planned: list[float] | None  # AutoPrune: [layers - 1] (S - 1) x kp_l, the tokens its curve keeps after layer l


def token_counts(data: ViewData) -> TokenCounts:
    """The per-layer counts of `data` (every token in every layer for a run without cuts)."""
    layers, _, visual = data.shape
    processed = list(data.visual_per_layer) or [visual] * layers
    c = data.curve
    if c is None:
        return TokenCounts(processed, None, None)
    return TokenCounts(processed, list(c["counts"]), [(c["first_keep"] - 1) * f for f in c["fractions"]])


def _count_series(counts: TokenCounts) -> list[tuple[str, list[int], list[float]]]:
    """(name, layers, values) of each line to draw."""
    layers = list(range(len(counts.processed)))
    series = [("processed", layers, counts.processed)]
    if counts.after_drop is not None:
        series.append(("after the layer's drop (AutoPrune's accounting)", layers, counts.after_drop))
    if counts.planned is not None:
        series.append(("curve: (S - 1) x kp_l", layers[1:], counts.planned))
    return series


def counts_plotly(counts: TokenCounts, title: str) -> go.Figure:
    """Visual tokens per decoder layer (and AutoPrune's curve), one line each."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=x, y=y, name=name, mode="lines+markers", line=dict(shape="hv" if i < 2 else
                                                                                        "linear"))
                     for i, (name, x, y) in enumerate(_count_series(counts))])
    fig.update_layout(title=dict(text=title, font=dict(size=13)), xaxis_title="decoder layer",
                      yaxis_title="visual tokens", height=300, margin=dict(l=50, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.3))
    return fig


def counts_draw(counts: TokenCounts, title: str) -> Figure:
    """The matplotlib twin of `counts_plotly`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2), layout="constrained")
    ax = fig.subplots()
    for i, (name, x, y) in enumerate(_count_series(counts)):
        ax.plot(x, y, marker="o", label=name, drawstyle="steps-post" if i < 2 else "default")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("visual tokens")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    return fig


# --- the one list of views -------------------------------------------------------------------------
@dataclass(frozen=True)
class View:
    """One view: its name (the app's output and the PNG file), page label, title and the three steps."""

    name: str
    label: str
    title: str  # a str.format template over `ViewData.title_fields`
    inputs: Callable[[ViewData], Any]  # -> HeadGrid | Panels
    plotly: Callable[[Any, str], go.Figure]
    draw: Callable[[Any, str], Figure]

    def title_for(self, data: ViewData) -> str:
        return self.title.format(**data.title_fields())

    def figure(self, data: ViewData) -> go.Figure:
        """The plotly figure for the page."""
        return self.plotly(self.inputs(data), self.title_for(data))

    def png(self, data: ViewData, folder: Path) -> Path:
        """`folder/<name>.png` drawn with matplotlib; returns its path."""
        path = folder / f"{self.name}.png"
        self.draw(self.inputs(data), self.title_for(data)).savefig(path, dpi=PNG_DPI)
        return path


VIEWS: tuple[View, ...] = (
    View("kept_masks", "Kept visual tokens per group", "Kept visual tokens ({method})",
         mask_panels, panels_plotly, panels_draw),
    View("token_counts", "Visual tokens per layer", "Visual tokens each layer processed ({method}){curve}",
         token_counts, counts_plotly, counts_draw),
    View("head_classes", "Head classes", "Head classes: {classes}", class_grid, class_grid_plotly, class_grid_draw),
    View("paq", "PAQ", "PAQ = (1 - sink share) x (1 - dispersion); dashed: token cuts", paq_grid, paq_plotly,
         paq_draw),
    View("grounding", "Grounding on the answering patches",
         "Grounding on the answering patches: {grounding}", grounding_grid, grounding_plotly, grounding_draw),
    View("head_maps", "Per head, before fusion", "Per-head maps of layer {layer}, before fusion",
         head_map_panels, panels_plotly, panels_draw),
    View("layer_maps", "Per layer, after head fusion",
         "After head fusion: softmax(PAQ / T) over heads, T = {temperature}", layer_map_panels, panels_plotly,
         panels_draw),
    View("group_maps", "Per group, after layer fusion", "After layer fusion: the map that chose each group's tokens",
         group_map_panels, panels_plotly, panels_draw),
    View("uniform_vs_paq", "Uniform average vs PAQ weighting",
         "Uniform head averaging (top) vs PAQ weighting (bottom)", comparison_panels, panels_plotly, panels_draw),
)
VIEW = {v.name: v for v in VIEWS}


def figures(data: ViewData) -> dict[str, go.Figure]:
    """Every plotly view, keyed by name, in VIEWS order."""
    return {v.name: v.figure(data) for v in VIEWS}


def export_png(run: Result | ViewData, out_dir: str | Path, image: Image.Image | str | Path | None = None,
               layer: int | None = None) -> list[Path]:
    """Write every view as `out_dir/<name>.png` with matplotlib; returns the paths in VIEWS order.

    `run` is a `hap.Result` (then `image` and `layer` go to `ViewData.from_result`;
    maps are drawn on grey without an image) or a `ViewData` already built.
    """
    data = run if isinstance(run, ViewData) else ViewData.from_result(run, image, layer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [v.png(data, out) for v in VIEWS]
