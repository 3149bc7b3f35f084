"""Each view's own plain inputs from a `ViewData`: a layer x head `HeadGrid`, small-multiple `Panels` or the
per-layer `TokenCounts`. Builders read arrays only; drawing them is `plotly_figures` and `matplotlib_figures`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .. import Group

from .data import CLASSES, HeadGrid, Panels, ViewData, scored_layers


def top_k(scores: np.ndarray, k: int) -> set[int]:
    """Indices of the k highest finite scores of `[V]`, ties broken by position (as `hap.scoring.fusion.select_top`)."""
    finite = np.where(np.isnan(scores), -np.inf, scores)
    return set(np.argsort(-finite, kind="stable")[:k].tolist())


def multiples_columns(count: int) -> int:
    """Columns of a grid of `count` small multiples: 4 per row, 8 for the 16+ heads or layers of real models."""
    return 4 if count <= 8 else 8


def _layers(layers: Sequence[int]) -> str:
    if not layers:
        return "no attention (random)"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {', '.join(map(str, layers))}"


def _span(group: Group) -> str:
    return f"group {group.index} (layers {group.layers[0]}-{group.layers[1] - 1})"


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
    """The uniform head average of every group (first row), then the maps the run fused with its own head weights
    (PAQ, static; `ViewData.weighting`) with their top-k overlap."""
    uniform, weighted = [], []
    for g in data.groups:
        k, plain, paq = len(g.kept), data.group_uniform[g.index], data.group_maps[g.index]
        shared = len(top_k(plain, k) & top_k(paq, k))
        uniform += data.panels(f"group {g.index}: uniform average", plain)
        weighted += data.panels(f"group {g.index}: {data.weighting}\n{shared} of the top {k} shared", paq)
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


def count_series(counts: TokenCounts) -> list[tuple[str, list[int], list[float]]]:
    """(name, layers, values) of each line to draw."""
    layers = list(range(len(counts.processed)))
    series = [("processed", layers, counts.processed)]
    if counts.after_drop is not None:
        series.append(("after the layer's drop (AutoPrune's accounting)", layers, counts.after_drop))
    if counts.planned is not None:
        series.append(("curve: (S - 1) x kp_l", layers[1:], counts.planned))
    return series
