"""The figures of "Is PAQ right?" (docs/method.md §11, §12): causal head importance on the layer x head grid, PAQ
against it, token importance over the image with each group's kept tokens outlined, and head utility (each head's
map as the token scorer of one cut) with the uniform and PAQ-weighted references. Plain arrays in, plotly out
(imported when a figure is built)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..causal import kept_importance
from .data import HeadGrid, Panels, ViewData
from .plotly_figures import layer_head_layout, panels_plotly
from .style import tick

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
    return layer_head_layout(fig, grid, title)


def utility_plotly(grid: HeadGrid, title: str) -> go.Figure:
    """Head utility per layer and head: p(answer) after the cut entering the next layer that keeps the head's top
    tokens; blank where not scored (the last layer, the layers left out)."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(
        z=grid.values, colorscale="Greens", zmin=0.0, zmax=1.0, colorbar=dict(title="p(answer)"), hoverongaps=False,
        hovertemplate="layer %{y} head %{x}<br>p(answer) %{z:.3f} after a cut entering layer %{y} + 1<br>that keeps "
                      "this head's top tokens<extra></extra>",
    ))
    return layer_head_layout(fig, grid, title)


def scatter_plotly(paq, importance, rho: float | None, title: str, measure: str = "causal importance") -> go.Figure:
    """PAQ against a per-head `measure` (head importance, head utility), one point per head where both are finite
    (`[layers, heads]` each; NaN: not scored)."""
    import plotly.graph_objects as go

    paq, importance = np.asarray(paq, dtype=float), np.asarray(importance, dtype=float)
    layers, heads = np.indices(paq.shape)
    scored = np.isfinite(paq) & np.isfinite(importance)
    fig = go.Figure(go.Scatter(
        x=paq[scored], y=importance[scored], mode="markers", customdata=np.stack([layers[scored], heads[scored]], -1),
        marker=dict(color=layers[scored], colorscale="Viridis", size=8, colorbar=dict(title="layer")),
        hovertemplate=f"layer %{{customdata[0]}} head %{{customdata[1]}}<br>PAQ %{{x:.3f}}<br>{measure} %{{y:.3g}}"
                      "<extra></extra>",
    ))
    rho_text = "undefined" if rho is None else f"{rho:.2f}"
    fig.update_layout(title=f"{title}: Spearman {rho_text}", xaxis_title="PAQ", yaxis_title=measure,
                      height=360, margin=dict(l=50, r=20, t=50, b=40))
    return fig


def references_plotly(values, uniform, paq_weighted, paq, unpruned: float, title: str) -> go.Figure:
    """Per scored layer: every head's utility (a dot coloured by its PAQ), the best head, the uniform average's and
    the PAQ weighting's utility at the same cut, and p(answer) unpruned (`values, paq [layers, heads]`, `uniform,
    paq_weighted [layers]`, NaN where not scored)."""
    import plotly.graph_objects as go

    values, paq = np.asarray(values, dtype=float), np.asarray(paq, dtype=float)
    scored = np.flatnonzero(np.isfinite(np.asarray(uniform, dtype=float)))
    layers, heads = np.indices(values.shape)
    dots = np.isfinite(values)
    fig = go.Figure(go.Scatter(
        x=layers[dots], y=values[dots], mode="markers", name="one head",
        customdata=np.stack([heads[dots], paq[dots]], -1),
        marker=dict(color=paq[dots], colorscale="Viridis", size=7, opacity=0.8, colorbar=dict(title="PAQ", len=0.6)),
        hovertemplate="layer %{x} head %{customdata[0]}<br>PAQ %{customdata[1]:.3f}<br>p(answer) %{y:.3f}"
                      "<extra></extra>",
    ))
    lines = (("best head", np.nanmax(np.where(dots, values, -np.inf), 1), "dot"),
             ("uniform average", np.asarray(uniform, dtype=float), "dash"),
             ("PAQ weighting", np.asarray(paq_weighted, dtype=float), "solid"))
    for name, line, dash in lines:
        fig.add_trace(go.Scatter(x=scored, y=line[scored], mode="lines+markers", name=name, line=dict(dash=dash),
                                 hovertemplate=f"{name}, layer %{{x}}: p(answer) %{{y:.3f}}<extra></extra>"))
    fig.add_hline(y=unpruned, line=dict(color="grey", dash="dot"), annotation_text="unpruned",
                  annotation_position="top left")
    fig.update_xaxes(dtick=tick(values.shape[0]))
    fig.update_layout(title=title, xaxis_title="layer whose maps score the cut (entering the next layer)",
                      yaxis_title="p(answer) after the cut", yaxis_range=[0, 1.05], height=380,
                      margin=dict(l=50, r=20, t=50, b=40), legend=dict(orientation="h", y=-0.25))
    return fig


def token_panels(data: ViewData, tokens) -> Panels:
    """Token importance over the image: first with the answering patches outlined (a scene asked its own question),
    then once per group with its kept tokens outlined and the share of importance they hold in the title."""
    first = "token importance" + ("" if data.truth is None else "\n(outlined: answering patches)")
    panels = data.panels(first, tokens)
    shares = kept_importance(tokens, [g.kept for g in data.groups])
    for group, share in zip(data.groups, shares):
        kept = np.zeros(data.shape[2], dtype=bool)
        kept[np.asarray(group.kept, dtype=int)] = True
        held = "-" if share is None else f"{share:.0%}"
        title = f"group {group.index} (layers {group.layers[0]}-{group.layers[1] - 1}):\n{len(group.kept)} kept hold " \
                f"{held}"
        panels += [replace(p, outline=mask) for p, mask in zip(data.panels(title, tokens, outline=False),
                                                               data.on_views(kept))]
    return Panels(panels, data.grid, cols=4 * data.views_count(), width=1000)


def tokens_plotly(data: ViewData, tokens, title: str) -> go.Figure:
    return panels_plotly(token_panels(data, tokens), title)


def head_weights_plotly(layers: list[int], rows: dict[str, np.ndarray], title: str) -> go.Figure:
    """Per-head measures of the same heads side by side, one heat-row per measure and layer: `rows` maps a measure's
    name ("static importance", "PAQ weight", "utility") to `[len(layers), heads]` values (NaN: not measured), each
    drawn on its own colour scale from 0 to its largest value so the rows line up head by head."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(rows)
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=names)
    scales = ("Blues", "Oranges", "Greens")
    for i, name in enumerate(names):
        values = np.asarray(rows[name], dtype=float)
        high = float(np.nanmax(values)) if np.isfinite(values).any() else 1.0
        fig.add_trace(go.Heatmap(
            z=values, x=list(range(values.shape[1])), y=[f"layer {layer}" for layer in layers],
            colorscale=scales[i % len(scales)], zmin=0.0, zmax=high or 1.0, hoverongaps=False,
            colorbar=dict(title=name.split()[0], len=1 / len(names), y=1 - (i + 0.5) / len(names)),
            hovertemplate=f"%{{y}} head %{{x}}<br>{name} %{{z:.3f}}<extra></extra>",
        ), row=i + 1, col=1)
    fig.update_xaxes(title_text="head", dtick=tick(len(rows[names[0]][0])), row=len(names), col=1)
    fig.update_layout(title=title, height=120 + 70 * len(names) * max(1, len(layers)),
                      margin=dict(l=70, r=20, t=70, b=40))
    return fig
