"""What the plotly and the matplotlib drawings share: colours, the token maps' colour stops, the outline of the
answering patches, the grounding scale's top and the tick step of the layer x head grids.

Token maps are selection scores s_v = ||M[:, v]||_2 (docs/method.md §6), drawn over the image, transparent where low
and red where high. Each small multiple is divided by its own highest score (`relative`: heads differ in scale by
orders of magnitude), so a dispersed head looks flat and a focused one shows its peaks; hovering shows the raw score.
Tokens an earlier cut already removed are NaN in the maps; their patches are dimmed (`data.dim`).
"""

from __future__ import annotations

import numpy as np

CLASS_LABELS = ("not scored", "sink", "dispersed", "optimal")
CLASS_COLORS = ("#d9d9d9", "#d62728", "#ffb000", "#2ca02c")
# Token maps over the image: low scores transparent (the image shows), high scores opaque red.
MAP_STOPS = ((0.0, (255, 255, 255, 0.0)), (0.4, (255, 200, 0, 0.35)), (1.0, (215, 0, 0, 0.9)))  # (at, RGBA)
NO_CUTS = "nothing to show: this method made no cuts"
UNKNOWN_COLOR = "#9e9e9e"  # grounding unknown: grey, never 0
OUTLINE_COLOR = "#00e5ff"  # the answering patches' outline on every map


def relative(scores: np.ndarray) -> np.ndarray:
    """Scores divided by the panel's highest (NaN kept): a flat map stays flat, a focused one shows its peaks."""
    finite = scores[np.isfinite(scores)]
    high = finite.max() if finite.size else 0.0
    return scores / high if high > 0 else np.where(np.isnan(scores), np.nan, 0.0)


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


def tick(count: int) -> int:
    """The tick step of a layer or head axis of `count` entries."""
    return 1 if count <= 16 else 4
