"""The one list of views, `VIEWS`: each view's name, page label, title, inputs (`builders`), plotly builder and
matplotlib drawing. The app's outputs, the CLI's `--figures` and `export_png` all walk it. Titles are templates over
`ViewData.title_fields`, written once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import plotly.graph_objects as go
    from matplotlib.figure import Figure
    from PIL import Image

    from .. import Result

from .builders import (class_grid, comparison_panels, grounding_grid, group_map_panels, head_map_panels,
                       layer_map_panels, mask_panels, paq_grid, token_counts)
from .data import ViewData
from .matplotlib_figures import PNG_DPI, class_grid_draw, counts_draw, grounding_draw, panels_draw, paq_draw
from .plotly_figures import class_grid_plotly, counts_plotly, grounding_plotly, panels_plotly, paq_plotly


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
         "Uniform head averaging (top) vs the run's own: {weighting} (bottom)", comparison_panels, panels_plotly,
         panels_draw),
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
