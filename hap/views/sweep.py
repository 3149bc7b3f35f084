"""The figure of a budget sweep: several runs of one question, each method at each retained fraction, against the
unpruned answer (`sweep_plotly`; plotly imported when it is built)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import plotly.graph_objects as go

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
