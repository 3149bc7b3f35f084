"""The figures of "Is PAQ right?" (docs/method.md §11): causal head importance on the layer x head grid, PAQ against
it, and token importance over the image with each group's kept tokens outlined. Plain arrays in, plotly out
(imported when a figure is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .causal import kept_importance
from .views import HeadGrid, Panel, Panels, ViewData, _layer_head_layout, panels_plotly

if TYPE_CHECKING:
    import plotly.graph_objects as go


def importance_grid(data: ViewData, importance) -> HeadGrid:
    """Head importance `[layers, heads]` on the same grid (and cut marks) as PAQ."""
    return HeadGrid(np.asarray(importance, dtype=float), data.cuts())


def importance_plotly(grid: HeadGrid, title: str) -> go.Figure:
    """Head importance per layer and head: red helps the answer, blue hurts it, white does not matter."""
    import plotly.graph_objects as go

    high = float(np.nanmax(np.abs(grid.values))) or 1.0
    fig = go.Figure(go.Heatmap(
        z=grid.values, colorscale="RdBu", reversescale=True, zmin=-high, zmax=high, zmid=0.0,
        colorbar=dict(title="drop in<br>log p"),
        hovertemplate="layer %{y} head %{x}<br>importance %{z:.3g}<extra></extra>",
    ))
    return _layer_head_layout(fig, grid, title)


def scatter_plotly(paq, importance, rho: float | None, title: str) -> go.Figure:
    """PAQ against head importance, one point per scored head (`[layers, heads]` each; NaN PAQ: not scored)."""
    import plotly.graph_objects as go

    paq, importance = np.asarray(paq, dtype=float), np.asarray(importance, dtype=float)
    layers, heads = np.indices(paq.shape)
    scored = np.isfinite(paq)
    fig = go.Figure(go.Scatter(
        x=paq[scored], y=importance[scored], mode="markers", customdata=np.stack([layers[scored], heads[scored]], -1),
        marker=dict(color=layers[scored], colorscale="Viridis", size=8, colorbar=dict(title="layer")),
        hovertemplate="layer %{customdata[0]} head %{customdata[1]}<br>PAQ %{x:.3f}<br>importance %{y:.3g}"
                      "<extra></extra>",
    ))
    rho_text = "undefined" if rho is None else f"{rho:.2f}"
    fig.update_layout(title=f"{title}: Spearman {rho_text}", xaxis_title="PAQ", yaxis_title="causal importance",
                      height=360, margin=dict(l=50, r=20, t=50, b=40))
    return fig


def token_panels(data: ViewData, tokens) -> Panels:
    """Token importance over the image: first with the answering patches outlined (a scene asked its own question),
    then once per group with its kept tokens outlined and the share of importance they hold in the title."""
    scores = data.on_grid(tokens)
    first = "token importance" + ("" if data.truth is None else " (outlined: the answering patches)")
    panels = [Panel(first, data.image, scores, None, data.outline())]
    shares = kept_importance(tokens, [g.kept for g in data.groups])
    for group, share in zip(data.groups, shares):
        kept = np.zeros(scores.size, dtype=bool)
        kept[np.asarray(group.kept, dtype=int)] = True
        held = "-" if share is None else f"{share:.0%}"
        title = (f"group {group.index} (layers {group.layers[0]}-{group.layers[1] - 1}): "
                 f"{len(group.kept)} kept hold {held}")
        panels.append(Panel(title, data.image, scores, None, kept.reshape(data.grid)))
    return Panels(panels, data.grid, cols=4, width=1000)


def tokens_plotly(data: ViewData, tokens, title: str) -> go.Figure:
    return panels_plotly(token_panels(data, tokens), title)
