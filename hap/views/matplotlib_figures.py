"""The views drawn with matplotlib, for files (`export_png`, the CLI's `--figures`): the twins of `plotly_figures`.
matplotlib is imported when a figure is built, so `import hap` needs none of it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from .builders import TokenCounts, count_series
from .data import CLASSES, HeadGrid, Panels
from .style import (CLASS_COLORS, CLASS_LABELS, MAP_STOPS, NO_CUTS, OUTLINE_COLOR, UNKNOWN_COLOR, grounding_high,
                    outline_segments, relative, tick)

PNG_DPI = 120


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
    ax.set_xticks(range(0, heads, tick(heads)))
    ax.set_yticks(range(0, layers, tick(layers)))
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


def counts_draw(counts: TokenCounts, title: str) -> Figure:
    """The matplotlib twin of `counts_plotly`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2), layout="constrained")
    ax = fig.subplots()
    for i, (name, x, y) in enumerate(count_series(counts)):
        ax.plot(x, y, marker="o", label=name, drawstyle="steps-post" if i < 2 else "default")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("visual tokens")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    return fig
