"""Every view of one run (the app's design card), drawn from plain arrays: plotly for the page, matplotlib for files.

Three steps, each its own function, and only the first reads a `hap.Result`:

1. `ViewData.from_result(result, image)`: the run as arrays on the visual grid (`data`).
2. `View.inputs(data)`: one view's own plain inputs, a layer x head `HeadGrid` or small-multiple `Panels` (`builders`).
3. `View.plotly(inputs, title)` or `View.draw(inputs, title)`: the figure (`plotly_figures`, `matplotlib_figures`).
   Builders take arrays, grids and titles, never a model or a `Result`.

Modules, each importing only those listed after it:

- `registry`: `VIEWS`, the one list of views; `figures` (plotly, the page) and `export_png` (matplotlib, files).
- `causal`: the figures of "Is PAQ right?" (causal head importance, head utility, token importance).
- `sweep`: the budget sweep's figure over several runs (`sweep_plotly`, `same_answer`).
- `plotly_figures`, `matplotlib_figures`: the drawings.
- `builders`: each view's inputs from a `ViewData`.
- `style`: what both drawings share (colours, relative map scores, the answering patches' outline).
- `data`: `ViewData`, `Panel(s)`, `HeadGrid`, `Truth` and the image under the grid.

The names other code reads as `hap.views.X` are re-exported here.
"""

from .builders import grounding_grid, head_map_panels, head_panel, mask_panels, token_counts, top_k
from .data import (CLASSES, NO_TRUTH, STATS, VIEW_PIXELS, Panel, Panels, Truth, ViewData, class_counts, default_layer,
                   model_view, scored_layers, single_view, view_image)
from .matplotlib_figures import PNG_DPI, grounding_draw, panels_draw
from .plotly_figures import (COLORBAR_PX, FIGURE_TITLE_CHAR_PX, FIGURE_TITLE_LINE_PX, FIGURE_TITLE_PAD_PX,
                             TITLE_CHAR_PX, TITLE_LINE_PX, panels_plotly, wrap_title)
from .registry import VIEW, VIEWS, export_png, figures
from .style import CLASS_COLORS, NO_CUTS, OUTLINE_COLOR, outline_segments
from .sweep import same_answer, sweep_plotly

__all__ = [
    "CLASSES", "CLASS_COLORS", "COLORBAR_PX", "FIGURE_TITLE_CHAR_PX", "FIGURE_TITLE_LINE_PX", "FIGURE_TITLE_PAD_PX",
    "NO_CUTS", "NO_TRUTH", "OUTLINE_COLOR", "PNG_DPI", "Panel", "Panels", "STATS", "TITLE_CHAR_PX", "TITLE_LINE_PX",
    "Truth", "VIEW", "VIEWS", "VIEW_PIXELS", "ViewData", "class_counts", "default_layer", "export_png", "figures",
    "grounding_draw", "grounding_grid", "head_map_panels", "head_panel", "mask_panels", "model_view",
    "outline_segments", "panels_draw", "panels_plotly", "same_answer", "scored_layers", "single_view", "sweep_plotly",
    "token_counts", "top_k", "view_image", "wrap_title"
]
