"""One run as the views need it: plain arrays on the visual grid, no model, no `Result`.

`ViewData.from_result(result, image)` is the only place a `hap.Result` is read: the run as arrays on the visual grid
(L layers, H heads, V visual tokens, G groups) plus the image as the grid covers it (`model_view`, `view_image`). The
views' own inputs are the plain containers here: a layer x head `HeadGrid` or a list of small-multiple `Panels`.

On a scene with known ground truth (`Truth`: the patches answering the question and each head's grounding on them,
computed outside this package), every map outlines the answering patches and the grounding grid sits beside PAQ;
without it the outline is absent and the grid says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from .. import Group, Result

from ..layout import WHOLE, Layout, TokenView
from ..methods import DEFAULT

CLASSES = ("", "sink", "dispersed", "optimal")  # index = colour code; "" = layer not scored
STATS = ("PAQ", "sink share", "dispersion", "visual share")  # the last axis of `ViewData.stats`
PRUNED_BRIGHTNESS = 0.2  # pruned patches keep this fraction of their brightness
VIEW_PIXELS = 336  # side of the image under the maps (LLaVA-1.5's input size)
NO_TRUTH = "no ground truth for this image"
CUT_BEFORE = "answering patches were cut before layer {layer}"  # why a layer's grounding is unknown


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
    """What a scene's ground truth says about one run, as plain arrays (computed by hap.views.ground_truth)."""

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
    method: str = DEFAULT
    temperature: float = 0.1
    merged: bool = False  # the dropped tokens were folded into the kept ones (HAP+ merge, docs/method.md §10)
    layer: int = 0  # the layer whose per-head maps are drawn
    truth: Truth | None = None  # the scene's ground truth, when the image carries it for this prompt
    visual_per_layer: Sequence[int] = ()  # [layers] visual tokens each layer processed (empty: every token)
    curve: dict | None = None  # AutoPrune's chosen curve (`Result.curve`), None for the other methods
    layout: Layout | None = None  # where each visual token lies on the uploaded image (`hap.layout`); None or one
    #                               view over the whole image: `image` and `grid` say it all
    view_images: tuple[np.ndarray, ...] = ()  # [views] the uploaded image under each view of a tiled `layout`
    weighting: str = "PAQ-weighted"  # how the run fused its heads (`head_weighting`): the maps `group_maps` hold

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
            merged=result.method == DEFAULT and result.config["merge"] != "none",
            visual_per_layer=list(result.visual_per_layer), curve=result.curve, layout=layout if tiled else None,
            view_images=view_images, weighting=head_weighting(result.config),
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
        """What view titles may name: {method}, {temperature}, {layer}, {classes}, {grounding}, {curve},
        {weighting}."""
        counts = class_counts(self.head_class)
        c = self.curve
        curve = "" if c is None else (f"; AutoPrune MI_1 {c['mi1']:.3f} -> slope {c['slope']:.3f} "
                                      f"(budget {c['budget']}, S {c['first_keep']})")
        return dict(method=self.method, temperature=f"{self.temperature:g}", layer=str(self.layer),
                    classes=", ".join(f"{n} {c}" for c, n in counts.items()), grounding=grounding_caption(self.truth),
                    curve=curve, weighting=self.weighting)


def head_weighting(config: dict) -> str:
    """How a run of `config` (`Result.config`) fused its heads, for the titles of its fused maps: by the static head
    importance (HAWK, head_weight="static"), alike (T = inf: the head average), or by softmax(PAQ / T)."""
    from ..config import HAPConfig
    from ..pruners import pruner_for

    pruner = pruner_for(HAPConfig(**config))
    if pruner.static_heads:
        return "static-weighted"
    return "uniform (the method's)" if math.isinf(pruner.temperature) else "PAQ-weighted"


def _array(values) -> np.ndarray:
    return np.asarray(values, dtype=float)


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


def class_counts(head_class: list[list[str]]) -> dict[str, int]:
    """How many scored heads of `head_class` [layers][heads] fall in each class."""
    flat = [c for row in head_class for c in row if c]
    return {c: flat.count(c) for c in CLASSES[1:]}
