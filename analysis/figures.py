"""Every view of the design card (DESIGN.md section 7) from one `hap.Result` and the image.

Plain arrays in, figures out: plotly for the app (`head_class_figure`, `paq_figure`,
`head_maps_figure`, `layer_maps_figure`, `group_maps_figure`, `uniform_vs_paq_figure`,
`kept_mask_figure`, or all of them from `figures`), matplotlib PNG files for the CLI
(`export_png`). Nothing here touches a model.

Token maps are the selection scores s_v = ||M[:, v]||_2 of `hap.Result.maps`, drawn on the visual
grid over the image as the model sees it (`model_view`), transparent where low and red where high.
Each small multiple is divided by its own highest score (heads differ in scale by orders of
magnitude), so a dispersed head looks flat and a focused one shows its peaks; hovering shows the
raw score. Tokens that
an earlier cut already removed are NaN in the maps; their patches are dimmed.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from PIL import Image
from plotly.subplots import make_subplots

CLASSES = ("", "sink", "dispersed", "optimal")  # index = colour code; "" = layer not scored
CLASS_LABELS = ("not scored", "sink", "dispersed", "optimal")
CLASS_COLORS = ("#d9d9d9", "#d62728", "#ffb000", "#2ca02c")
# Token maps over the image: low scores transparent (the image shows), high scores opaque red.
MAP_STOPS = ((0.0, (255, 255, 255, 0.0)), (0.4, (255, 200, 0, 0.35)), (1.0, (215, 0, 0, 0.9)))  # (at, RGBA)
MAP_PLOTLY = [[at, f"rgba({r},{g},{b},{a})"] for at, (r, g, b, a) in MAP_STOPS]
MAP_MPL = LinearSegmentedColormap.from_list("hap_map", [(at, (r / 255, g / 255, b / 255, a))
                                                        for at, (r, g, b, a) in MAP_STOPS])
PRUNED_BRIGHTNESS = 0.2  # kept-token masks: pruned patches keep this fraction of their brightness
COMPARISON_TITLE = "Uniform head averaging (top) vs PAQ weighting (bottom)"
VIEW_PIXELS = 336  # side of the image under the maps (LLaVA-1.5's input size)


@dataclass
class Panel:
    """One small multiple: a token map (or none) over the image, tokens outside the sequence dimmed."""

    title: str
    view: np.ndarray  # [height, width, 3] uint8 image spanning the whole visual grid
    scores: np.ndarray | None = None  # [rows, cols] raw token scores, NaN where the token is absent
    present: np.ndarray | None = None  # bool [rows, cols] tokens in the sequence (None: all of them)

    @classmethod
    def map(cls, title: str, view: np.ndarray, scores: np.ndarray) -> Panel:
        """A token map; the tokens it has no score for (already pruned) are dimmed."""
        absent = np.isnan(scores)
        return cls(title, view, scores, ~absent if absent.any() else None)

    def background(self) -> np.ndarray:
        return self.view if self.present is None else dim(self.view, self.present)


# --- image and grid helpers ---------------------------------------------------------------------
def model_view(image: Image.Image | str | Path | None, center_crop: bool = True, size: int = VIEW_PIXELS) -> np.ndarray:
    """The image (or its file) as the visual grid covers it, `[size, size, 3]` uint8.

    CLIP-style processors (LLaVA-1.5, the tiny model) resize the short side and crop the centre
    square (`center_crop=True`); others (SigLIP, Qwen2-VL) let the grid cover the whole image
    (False): it is squashed to a square here and stretched back to the grid's shape when drawn.
    Without an image, a neutral grey square.
    """
    if image is None:
        return np.full((size, size, 3), 128, np.uint8)
    if isinstance(image, (str, Path)):
        with Image.open(image) as opened:
            image = opened.convert("RGB")
    image = image.convert("RGB")
    if center_crop:
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image = image.crop((left, top, left + side, top + side))
    return np.asarray(image.resize((size, size), Image.Resampling.BICUBIC))


def to_grid(result, values) -> np.ndarray:
    """`[visual]` values (tensor or array) -> `[rows, cols]` float array on the visual grid."""
    return np.asarray(values, dtype=float).reshape(result.visual_grid)


def dim(view: np.ndarray, present: np.ndarray) -> np.ndarray:
    """`view` with the patches of the tokens not `present` (bool [rows, cols]) dimmed."""
    rows, cols = present.shape
    h, w = view.shape[:2]
    pixel_present = present[np.arange(h) * rows // h][:, np.arange(w) * cols // w]  # [h, w]
    return (view * np.where(pixel_present, 1.0, PRUNED_BRIGHTNESS)[..., None]).astype(np.uint8)


def scored_layers(result) -> list[int]:
    """Layers whose attention was captured (their head statistics are not NaN)."""
    return [l for l in range(result.num_layers) if not np.isnan(np.asarray(result.paq[l], dtype=float)).all()]


def default_layer(result) -> int:
    """The layer to show per-head maps for: the last one scoring the first cut, else the first captured."""
    if result.groups and result.groups[0].scored_by:
        return result.groups[0].scored_by[-1]
    layers = scored_layers(result)
    return layers[0] if layers else 0


def relative(scores: np.ndarray) -> np.ndarray:
    """Scores divided by the panel's highest (NaN kept): a flat map stays flat, a focused one shows its peaks."""
    high = np.nanmax(_fill(scores))
    return scores / high if high > 0 else np.where(np.isnan(scores), np.nan, 0.0)


def _fill(row) -> np.ndarray:
    """`row` as a float array, with a -inf appended so nanmax of an all-NaN row is -inf, not a warning."""
    return np.append(np.asarray(row, dtype=float), -math.inf)


def _cut_rows(result) -> list[tuple[int, str]]:
    """(first layer, label) of every group, for the boundaries drawn on layer x head views."""
    return [
        (g.layers[0], f"group {g.index}: {len(g.kept)} of {result.num_visual} tokens")
        for g in result.groups
    ]


def class_counts(result) -> dict[str, int]:
    """How many scored heads fall in each class."""
    flat = [c for row in result.head_class for c in row if c]
    return {c: flat.count(c) for c in CLASSES[1:]}


def class_title(result) -> str:
    """'Head classes: 3 sink, 20 dispersed, 9 optimal'."""
    return "Head classes: " + ", ".join(f"{v} {k}" for k, v in class_counts(result).items())


# --- panels of the map views --------------------------------------------------------------------
def head_map_panels(result, view: np.ndarray, layer: int) -> list[Panel]:
    """Per-head token maps of `layer`, before fusion."""
    if not 0 <= layer < result.num_layers:
        raise ValueError(f"layer={layer} is outside the decoder's layers 0..{result.num_layers - 1}")
    panels = []
    for h in range(result.num_heads):
        cls = result.head_class[layer][h] or "not scored"
        paq = float(result.paq[layer, h])
        scores = to_grid(result, result.maps.head[layer, h])
        panels.append(Panel.map(f"L{layer} H{h}: {cls}\nPAQ {paq:.3g}", view, scores))
    return panels


def layer_map_panels(result, view: np.ndarray) -> list[Panel]:
    """Head-fused (softmax(PAQ / T) over heads) maps, one per captured layer."""
    return [
        Panel.map(f"layer {l} (head fusion)", view, to_grid(result, result.maps.layer[l]))
        for l in scored_layers(result)
    ]


def group_map_panels(result, view: np.ndarray) -> list[Panel]:
    """Layer-fused maps, one per group: the scores that chose the group's tokens."""
    return [
        Panel.map(
            f"group {g.index} (layers {g.layers[0]}-{g.layers[1] - 1})\nscored by {_layers(g.scored_by)}",
            view,
            to_grid(result, result.maps.group[g.index]),
        )
        for g in result.groups
    ]


def comparison_panels(result, view: np.ndarray) -> list[Panel]:
    """The uniform head average of every group (first row), then the PAQ-weighted maps with their top-k overlap."""
    uniform, weighted = [], []
    for g in result.groups:
        k = len(g.kept)
        plain, paq = (np.asarray(m[g.index], dtype=float) for m in (result.maps.group_uniform, result.maps.group))
        shared = len(_top(plain, k) & _top(paq, k))
        uniform.append(Panel.map(f"group {g.index}: uniform average", view, to_grid(result, plain)))
        weighted.append(Panel.map(f"group {g.index}: PAQ-weighted\n{shared} of the top {k} shared", view,
                              to_grid(result, paq)))
    return uniform + weighted


def mask_panels(result, view: np.ndarray) -> list[Panel]:
    """The image dimmed outside the tokens each group runs on."""
    return [
        Panel(
            f"group {g.index} (layers {g.layers[0]}-{g.layers[1] - 1}): {len(g.kept)}/{result.num_visual} kept",
            view,
            present=to_grid(result, result.kept_mask(g.index).numpy()) > 0,
        )
        for g in result.groups
    ]


def _top(scores: np.ndarray, k: int) -> set[int]:
    """Indices of the k highest finite scores, ties broken by position (as `hap.fusion.select_top`)."""
    finite = np.where(np.isnan(scores), -np.inf, scores)
    return set(np.argsort(-finite, kind="stable")[:k].tolist())


def _layers(layers: list[int]) -> str:
    if not layers:
        return "no attention (random)"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {', '.join(map(str, layers))}"


# --- plotly ---------------------------------------------------------------------------------------
def head_class_figure(result) -> go.Figure:
    """Layer x head grid coloured by class; hover shows PAQ, sink share, dispersion, visual share."""
    codes = np.array([[CLASSES.index(c) for c in row] for row in result.head_class], dtype=float)
    stats = np.stack([np.asarray(t, dtype=float) for t in (result.paq, result.sink_share, result.dispersion,
                                                            result.visual_share)], -1)  # [L, H, 4]
    labels = [[CLASS_LABELS[int(c)] for c in row] for row in codes]
    n = len(CLASSES)
    scale = [[i / n + e / n, CLASS_COLORS[i]] for i in range(n) for e in (0, 1)]
    fig = go.Figure(go.Heatmap(
        z=codes, customdata=stats, text=labels, zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=1, ygap=1,
        colorbar=dict(tickvals=list(range(n)), ticktext=list(CLASS_LABELS), title="class"),
        hovertemplate=("layer %{y} head %{x}: <b>%{text}</b><br>PAQ %{customdata[0]:.3f}<br>"
                       "sink share %{customdata[1]:.3f}<br>dispersion %{customdata[2]:.3f}<br>"
                       "visual share %{customdata[3]:.3f}<extra></extra>"),
    ))
    _layer_head_axes(fig, result, class_title(result))
    return fig


def paq_figure(result) -> go.Figure:
    """PAQ per layer and head, with the group boundaries (where tokens are cut) marked."""
    fig = go.Figure(go.Heatmap(
        z=np.asarray(result.paq, dtype=float), colorscale="Viridis", zmin=0, colorbar=dict(title="PAQ"),
        hovertemplate="layer %{y} head %{x}<br>PAQ %{z:.3f}<extra></extra>",
    ))
    _layer_head_axes(fig, result, "PAQ = (1 - sink share) x (1 - dispersion); dashed: token cuts")
    return fig


def _layer_head_axes(fig: go.Figure, result, title: str) -> None:
    """Shared layout of the layer x head views: layer 0 on top, one tick per layer, cut lines."""
    for layer, label in _cut_rows(result):
        fig.add_hline(y=layer - 0.5, line=dict(color="white", width=2, dash="dash"))
        fig.add_annotation(x=1.0, xref="paper", xanchor="right", y=layer - 0.5, yanchor="top", text=label,
                           showarrow=False, font=dict(color="white", size=11), bgcolor="rgba(0,0,0,0.45)")
    fig.update_yaxes(title="layer", range=[result.num_layers - 0.5, -0.5], dtick=1 if result.num_layers <= 16 else 4)
    fig.update_xaxes(title="head", range=[-0.5, result.num_heads - 0.5], dtick=1 if result.num_heads <= 16 else 4)
    fig.update_layout(title=title, height=max(320, 60 + 22 * result.num_layers), margin=dict(l=50, r=20, t=50, b=40))


def _data_uri(background: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(background).save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def panels_figure(result, panels: list[Panel], title: str, cols: int = 4, width: int = 1000) -> go.Figure:
    """Small multiples: each panel's image with its token map blended over it (plotly).

    `width` is the pixel width the figure is expected to get, which sets its height.
    """
    fig = go.Figure()
    if not panels:
        fig.add_annotation(text="nothing to show: this method made no cuts", showarrow=False)
        fig.update_layout(title=title, height=200, xaxis_visible=False, yaxis_visible=False)
        return fig
    cols = min(cols, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig = make_subplots(rows_n, cols, subplot_titles=[p.title.replace("\n", "<br>") for p in panels],
                        horizontal_spacing=0.02, vertical_spacing=0.16 / rows_n)
    grid_rows, grid_cols = result.visual_grid
    index = np.arange(grid_rows * grid_cols).reshape(grid_rows, grid_cols)
    uris: dict[bytes, str] = {}  # one encoded image per set of dimmed tokens
    for i, panel in enumerate(panels):
        row, col = divmod(i, cols)
        h, w = panel.view.shape[:2]
        key = b"" if panel.present is None else panel.present.tobytes()
        if key not in uris:
            uris[key] = _data_uri(panel.background())
        uri = uris[key]
        fig.add_trace(go.Image(source=uri, x0=-0.5 + grid_cols / w / 2, dx=grid_cols / w,
                               y0=-0.5 + grid_rows / h / 2, dy=grid_rows / h, hoverinfo="skip"), row + 1, col + 1)
        if panel.scores is not None:
            fig.add_trace(go.Heatmap(
                z=relative(panel.scores), customdata=np.stack([panel.scores, index], -1), coloraxis="coloraxis",
                hoverongaps=False,
                hovertemplate="token %{customdata[1]} (row %{y}, col %{x})<br>score %{customdata[0]:.3g}"
                              "<br>%{z:.0%} of the panel's highest<extra></extra>",
            ), row + 1, col + 1)
        elif panel.present is not None:  # a mask: an invisible layer that names each token on hover
            state = np.where(panel.present, "kept", "pruned")
            fig.add_trace(go.Heatmap(
                z=panel.present.astype(float), text=state, customdata=index, showscale=False,
                colorscale=[[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0)"]],
                hovertemplate="token %{customdata} (row %{y}, col %{x}): %{text}<extra></extra>",
            ), row + 1, col + 1)
        suffix = "" if i == 0 else str(i + 1)
        fig.layout[f"yaxis{suffix}"].update(scaleanchor=f"x{suffix}", autorange="reversed")
    fig.update_xaxes(visible=False, range=[-0.5, grid_cols - 0.5], constrain="domain")
    fig.update_yaxes(visible=False, range=[grid_rows - 0.5, -0.5], constrain="domain")
    fig.update_annotations(font_size=11)
    fig.update_layout(title=title, height=70 + rows_n * (50 + width // max(cols, 3)),
                      margin=dict(l=10, r=10, t=90, b=10),
                      coloraxis=dict(colorscale=MAP_PLOTLY, cmin=0, cmax=1,
                                     colorbar=dict(title="score /<br>highest", len=0.6)))
    return fig


def multiples_columns(count: int) -> int:
    """Columns of a grid of `count` small multiples: 4 per row, 8 for the 16+ heads or layers of real models."""
    return 4 if count <= 8 else 8


def head_maps_figure(result, view: np.ndarray, layer: int | None = None) -> go.Figure:
    """(4a) Per-head token maps of one layer, before fusion."""
    layer = default_layer(result) if layer is None else layer
    return panels_figure(result, head_map_panels(result, view, layer),
                         f"Per-head maps of layer {layer}, before fusion", multiples_columns(result.num_heads))


def layer_maps_figure(result, view: np.ndarray) -> go.Figure:
    """(4b) Head-fused map per captured layer."""
    return panels_figure(result, layer_map_panels(result, view),
                         f"After head fusion: softmax(PAQ / T) over heads, T = {result.config['temperature']:g}",
                         multiples_columns(result.num_layers))


def group_maps_figure(result, view: np.ndarray) -> go.Figure:
    """(4c) Layer-fused map per group."""
    return panels_figure(result, group_map_panels(result, view),
                         "After layer fusion: the map that chose each group's tokens", cols=3)


def uniform_vs_paq_figure(result, view: np.ndarray) -> go.Figure:
    """(4d) Uniform head average beside the PAQ-weighted map, per group."""
    return panels_figure(result, comparison_panels(result, view), COMPARISON_TITLE, cols=max(1, len(result.groups)))


def kept_mask_figure(result, view: np.ndarray) -> go.Figure:
    """(5) The tokens each group runs on, over the image; pruned patches dimmed."""
    return panels_figure(result, mask_panels(result, view), f"Kept visual tokens ({result.method})", cols=3, width=650)


def figures(result, view: np.ndarray, layer: int | None = None) -> dict[str, go.Figure]:
    """Every plotly view, keyed by name."""
    return {
        "kept_masks": kept_mask_figure(result, view),
        "head_classes": head_class_figure(result),
        "paq": paq_figure(result),
        "head_maps": head_maps_figure(result, view, layer),
        "layer_maps": layer_maps_figure(result, view),
        "group_maps": group_maps_figure(result, view),
        "uniform_vs_paq": uniform_vs_paq_figure(result, view),
    }


# --- matplotlib -----------------------------------------------------------------------------------
def _mpl_layer_head(result, z: np.ndarray, title: str, **imshow) -> tuple:
    """(figure, axes, image) of a layer x head matrix with the cut lines (matplotlib)."""
    fig = Figure(figsize=(max(6.0, 1.6 + 0.3 * result.num_heads), max(3.0, 1.2 + 0.3 * result.num_layers)),
                 layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(z, aspect="auto", interpolation="nearest", **imshow)
    for layer, label in _cut_rows(result):
        ax.axhline(layer - 0.5, color="white", linestyle="--", linewidth=1.5)
        ax.text(result.num_heads - 0.6, layer - 0.4, label, color="white", ha="right", va="top", fontsize=7,
                bbox=dict(facecolor="black", alpha=0.45, linewidth=0))
    ax.set(xlabel="head", ylabel="layer", title=title)
    ax.set_xticks(range(0, result.num_heads, 1 if result.num_heads <= 16 else 4))
    ax.set_yticks(range(0, result.num_layers, 1 if result.num_layers <= 16 else 4))
    return fig, ax, image


def _mpl_panels(result, panels: list[Panel], title: str, cols: int = 4) -> Figure:
    """Small multiples: each panel's image with its token map blended over it (matplotlib)."""
    cols = max(1, min(cols, len(panels)))
    rows_n = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(2.6 * cols, 2.6 * rows_n + 0.5), layout="constrained")
    axes = fig.subplots(rows_n, cols, squeeze=False).ravel()
    grid_rows, grid_cols = result.visual_grid
    extent = (-0.5, grid_cols - 0.5, grid_rows - 0.5, -0.5)
    for ax, panel in zip(axes, panels):
        ax.imshow(panel.background(), extent=extent)
        if panel.scores is not None:
            ax.imshow(relative(panel.scores), extent=extent, cmap=MAP_MPL, vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(panel.title, fontsize=7)
    for ax in axes:
        ax.axis("off")
    if any(p.scores is not None for p in panels):
        fig.colorbar(ScalarMappable(Normalize(0, 1), MAP_MPL), ax=axes.tolist(), shrink=0.6,
                     label="score / highest")
    fig.suptitle(title if panels else f"{title}: nothing to show, this method made no cuts")
    return fig


def export_png(result, out_dir: str | Path, image: Image.Image | str | Path | None = None, layer: int | None = None,
               center_crop: bool = True) -> list[Path]:
    """Write every view as a PNG file with matplotlib; returns the paths.

    `image` is the input image or its path (maps are drawn on grey without it); `layer` picks the per-head
    maps (default: the last layer scoring the first cut); `center_crop` as in `model_view`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    view = model_view(image, center_crop)
    layer = default_layer(result) if layer is None else layer
    codes = np.array([[CLASSES.index(c) for c in row] for row in result.head_class])
    fig_classes, ax, _ = _mpl_layer_head(result, codes, class_title(result),
                                         cmap=ListedColormap(CLASS_COLORS), vmin=-0.5, vmax=len(CLASSES) - 0.5)
    ax.legend(handles=[Patch(color=c, label=l) for c, l in zip(CLASS_COLORS, CLASS_LABELS)],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    fig_paq, ax, image_paq = _mpl_layer_head(result, np.asarray(result.paq, dtype=float),
                                             "PAQ per head; dashed: token cuts", cmap="viridis", vmin=0)
    fig_paq.colorbar(image_paq, ax=ax, label="PAQ")
    views = {
        "head_classes": fig_classes,
        "paq": fig_paq,
        f"head_maps_layer{layer}": _mpl_panels(result, head_map_panels(result, view, layer),
                                                f"Per-head maps of layer {layer}, before fusion",
                                                multiples_columns(result.num_heads)),
        "layer_maps": _mpl_panels(result, layer_map_panels(result, view), "After head fusion (PAQ softmax over heads)",
                                  multiples_columns(result.num_layers)),
        "group_maps": _mpl_panels(result, group_map_panels(result, view), "After layer fusion, per group", cols=3),
        "uniform_vs_paq": _mpl_panels(result, comparison_panels(result, view), COMPARISON_TITLE,
                                      max(1, len(result.groups))),
        "kept_masks": _mpl_panels(result, mask_panels(result, view), f"Kept visual tokens ({result.method})", cols=3),
    }
    paths = []
    for name, fig in views.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        paths.append(path)
    return paths
