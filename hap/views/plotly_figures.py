"""The views drawn with plotly, for the page: the layer x head grids, the small multiples over the image and the
per-layer token counts. plotly is imported when a figure is built, so `import hap` needs none of it."""

from __future__ import annotations

import base64
import io
import math
import textwrap
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import plotly.graph_objects as go

from .builders import TokenCounts, count_series
from .data import CLASSES, PRUNED_BRIGHTNESS, STATS, HeadGrid, Panel, Panels
from .style import (CLASS_COLORS, CLASS_LABELS, MAP_STOPS, NO_CUTS, OUTLINE_COLOR, UNKNOWN_COLOR, grounding_high,
                    outline_segments, relative, tick)

TITLE_CHAR_PX = 6.5  # a subplot title character's width at font size 11, rounded up: the wrapping budget
TITLE_LINE_PX = 15  # a subplot title line's height
COLORBAR_PX = 100  # the width the small multiples' colour bar takes from the panels
FIGURE_TITLE_CHAR_PX = 9  # a figure title character's width at plotly's title size (17), rounded up
FIGURE_TITLE_LINE_PX = 22  # a figure title line's height
FIGURE_TITLE_PAD_PX = 60  # the figure title's distance from the figure's top edge (the page's plot label and
#                           plotly's mode bar sit above it)


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
    return layer_head_layout(fig, grid, title)


def paq_plotly(grid: HeadGrid, title: str) -> go.Figure:
    """PAQ per layer and head, with the group boundaries (where tokens are cut) marked."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(
        z=grid.values, colorscale="Viridis", zmin=0, colorbar=dict(title="PAQ"),
        hovertemplate="layer %{y} head %{x}<br>PAQ %{z:.3f}<extra></extra>",
    ))
    return layer_head_layout(fig, grid, title)


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
    return layer_head_layout(fig, grid, title)


def layer_head_layout(fig: go.Figure, grid: HeadGrid, title: str) -> go.Figure:
    """Shared layout of the layer x head views: layer 0 on top, one tick per layer, cut lines."""
    layers, heads = grid.values.shape
    for layer, label in grid.cuts:
        fig.add_hline(y=layer - 0.5, line=dict(color="white", width=2, dash="dash"))
        fig.add_annotation(x=1.0, xref="paper", xanchor="right", y=layer - 0.5, yanchor="top", text=label,
                           showarrow=False, font=dict(color="white", size=11), bgcolor="rgba(0,0,0,0.45)")
    fig.update_yaxes(title="layer", range=[layers - 0.5, -0.5], dtick=tick(layers))
    fig.update_xaxes(title="head", range=[-0.5, heads - 0.5], dtick=tick(heads))
    fig.update_layout(title=title, height=max(320, 60 + 22 * layers), margin=dict(l=50, r=20, t=50, b=40))
    return fig


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


def counts_plotly(counts: TokenCounts, title: str) -> go.Figure:
    """Visual tokens per decoder layer (and AutoPrune's curve), one line each."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=x, y=y, name=name, mode="lines+markers", line=dict(shape="hv" if i < 2 else
                                                                                        "linear"))
                     for i, (name, x, y) in enumerate(count_series(counts))])
    fig.update_layout(title=dict(text=title, font=dict(size=13)), xaxis_title="decoder layer",
                      yaxis_title="visual tokens", height=300, margin=dict(l=50, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.3))
    return fig
