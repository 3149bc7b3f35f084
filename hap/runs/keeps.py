"""What each method keeps: every pruning method of the registry on one input at one budget, side by side.

`keeps(model, processor, image, prompt, config)` runs every method that prunes (`pruning()`: the method knob's
choices, registered pruners included, but `none`) at `config`'s budget, its other knobs unchanged, prepared once and the answers decoded as one batch
(`hap.runs.run.run_prepared`, as `hap.runs.run.run_together` runs them; the image encoded once where the caller holds a
`hap.runs.features` cache). A method the model refuses (`hap.patch.refusal`: VisionZip without a [CLS] token,
PyramidDrop on M-RoPE, ...) is listed with the reason, never run. Runs the caller already has (the page's chosen
method and uniform averaging) are reused, not repeated.

What a method keeps (`Kept`): the visual tokens its first cut keeps (`Result.groups[0].kept`, the set its later cuts,
if any, choose from), the decoder layer the cut enters, its answer, the layer-averaged retained tokens and prefill
FLOPs ratio it achieved, and its overlap with HAP's: the share of HAP's (visual token, decoder layer) pairs that the
method also runs (`overlap`). For two methods cutting once before the same layer this is the share of HAP's kept
tokens it also keeps; with HAP's geometric groups it compares what each actually runs in every layer, so methods at
one budget compare fairly.

`keeps_panels(data, found)` draws it: one small map per method over the analysed image (`hap.views.ViewData`: the
image, a tiled layout's views, the scene's answering patches outlined where known), its kept tokens bright and the
rest dimmed, titled "fastv: 'red' · 71% of HAP's". `keeps_plotly` / `keeps_draw` are the page's and the files'
figures (`hap.views.panels_plotly` / `panels_draw`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import HAPConfig
from ..methods import DEFAULT, METHODS, NONE
from ..patch import refusal as patch_refusal, visual_tokens
from ..patch.decoder import decoder_shape
from ..planning.budget import plan
from ..views import PNG_DPI, Panels, ViewData, panels_draw, panels_plotly
from .inputs import DEFAULT_LIMITS, InputLimits
from .run import for_config, prepare, run_prepared
from .trace import Result

if TYPE_CHECKING:
    import plotly.graph_objects as go
    from matplotlib.figure import Figure

REFERENCE = DEFAULT  # the method every other one is compared with
TITLE = "What each method keeps at {budget}: kept tokens bright, the rest dimmed"
ANSWER_CHARS = 24  # a panel title quotes the answer up to this many characters
TITLE_CHARS = 110  # a refusal line of the title wraps here


def pruning() -> list[str]:
    """Every method that prunes, in the registry's order (the method knob's choices but `none`)."""
    return [m for m in METHODS if m != NONE]


@dataclass
class Kept:
    """What one method kept on the input, at the budget."""

    method: str
    answer: str
    kept: list[int]  # visual indices (0..V-1, the original order) its first cut keeps
    cut_layer: int  # the decoder layer its first cut enters (0: before the first layer)
    cuts: int  # how many cuts it makes (its later ones choose among `kept`)
    retained_tokens: float  # visual tokens present, averaged over the decoder layers (the budget's measure)
    flops_ratio: float  # achieved prefill FLOPs / unpruned
    present: np.ndarray = field(repr=False)  # bool [layers, V] the visual tokens each decoder layer runs
    overlap_with_hap: float | None = None  # `overlap` with HAP's run; None where HAP did not run

    @classmethod
    def of(cls, result: Result) -> Kept:
        first = result.groups[0] if result.groups else None
        return cls(result.method, result.answer, sorted(first.kept) if first else list(range(result.num_visual)),
                   first.layers[0] if first else result.num_layers, len(result.groups), result.retained_tokens,
                   result.flops_ratio, presence(result))

    def to_json(self) -> dict:
        return {"kept": [int(v) for v in self.kept], "cut_layer": self.cut_layer, "cuts": self.cuts,
                "answer": self.answer, "retained_tokens": self.retained_tokens, "flops_ratio": self.flops_ratio,
                "overlap_with_hap": self.overlap_with_hap}


@dataclass
class Keeps:
    """Every method's `Kept` on one input at one budget (registry order), and the methods the model refused."""

    budget: dict  # {"retain": ..., "flops_ratio": ...}: the budget every method was given
    methods: dict[str, Kept]
    refused: dict[str, str]  # method -> why the model does not take it

    def to_json(self) -> dict:
        """The `keeps` entry of the `/analyze` JSON (docs/app.md)."""
        return {**self.budget, "methods": {m: k.to_json() for m, k in self.methods.items()},
                "refused": dict(self.refused)}


def presence(result: Result) -> np.ndarray:
    """bool `[layers, V]`: the visual tokens each decoder layer of `result` runs (every one before its first cut; a
    recycled cluster mean is no token of the image)."""
    present = np.ones((result.num_layers, result.num_visual), dtype=bool)
    for group in result.groups:
        start, end = group.layers
        present[start:end] = False
        present[start:end, list(group.kept)] = True
    return present


def overlap(present: np.ndarray, reference: np.ndarray) -> float | None:
    """Share of `reference`'s (layer, token) pairs (bool `[layers, V]`) that `present` also holds; None when the
    reference runs none."""
    total = int(reference.sum())
    return None if total == 0 else float((present & reference).sum() / total)


def keeps(model, processor, image, prompt: str, config: HAPConfig, max_new_tokens: int = 32,
          limits: InputLimits = DEFAULT_LIMITS, history: Sequence[tuple[str, str]] = (),
          done: Mapping[str, Result] = (), methods: Sequence[str] | None = None) -> Keeps:
    """Every method of `methods` (default `pruning()`) at `config`'s budget (its other knobs unchanged) on one input,
    untraced, prepared once and decoded as one batch where the model allows; `done`: results of some of them already
    run on this input at this budget (reused). A method the model refuses, or whose budget it cannot reach
    (`refusal`; downsample on dynamic resolution: an image the processor's pixel bounds cannot shrink to it,
    `hap.runs.run.for_config`), is listed in `refused` with the reason, before any run; the others run, the input
    prepared once (the resized image once for a method that resizes it)."""
    methods = pruning() if methods is None else list(methods)
    done = dict(done)
    p = prepare(model, processor, image, prompt, max_new_tokens, limits, history)
    num_visual = int(visual_tokens(model, p.inputs)[0].sum())  # the image's own count (no newline tokens)
    jobs, refused = {}, {}
    for m in (m for m in methods if m not in done):
        cfg = replace(config, method=m)
        why = refusal(model, cfg, num_visual, p.prompt_len - num_visual)
        if why is None:
            try:
                jobs[m] = (for_config(model, processor, p, cfg), cfg, False)
            except ValueError as err:  # the processor's pixel bounds cannot shrink the image to the budget
                why = str(err)
        if why is not None:
            refused[m] = why
    if jobs:
        done.update(zip(jobs, run_prepared(model, processor, list(jobs.values()), max_new_tokens)))
    found = {m: Kept.of(done[m]) for m in methods if m in done}
    if REFERENCE in found:
        for kept in found.values():
            kept.overlap_with_hap = overlap(kept.present, found[REFERENCE].present)
    budget = {"retain": config.retain, "flops_ratio": config.flops_ratio}
    return Keeps(budget, found, refused)


def refusal(model, config: HAPConfig, num_visual: int | None = None, text_tokens: int = 0) -> str | None:
    """Why `config` does not run on `model`: the model refuses the method (`hap.patch.refusal`; a file the method needs
    that does not load), or, for an input of `num_visual` visual and `text_tokens` text tokens (None: not checked),
    its budget is out of the method's reach on this decoder (`hap.planning.budget.plan`); None when it runs."""
    try:
        why = patch_refusal(model, config)
        if why is None and num_visual is not None:
            plan(config, decoder_shape(model), num_visual, text_tokens)
    except (ValueError, OSError) as err:
        return str(err)
    return why


def budget_text(budget: dict) -> str:
    """The budget in words: "retain 0.111" or "FLOPs ratio 0.3" (the model's default retain where neither is set)."""
    if budget.get("flops_ratio") is not None:
        return f"FLOPs ratio {budget['flops_ratio']:g}"
    return "the model's default budget" if budget.get("retain") is None else f"retain {budget['retain']:g}"


def panel_title(kept: Kept) -> str:
    """"fastv: 'red' · 71% of HAP's" (HAP's own panel: "· HAP's own"), then the kept count, where it was cut and how
    many cuts follow."""
    answer = kept.answer if len(kept.answer) <= ANSWER_CHARS else kept.answer[:ANSWER_CHARS - 1] + "…"
    if kept.method == REFERENCE:
        share = "HAP's own"
    else:
        share = "HAP did not run" if kept.overlap_with_hap is None else f"{kept.overlap_with_hap:.0%} of HAP's"
    later = f", then {kept.cuts - 1} more cut{'s' * (kept.cuts > 2)}" if kept.cuts > 1 else ""
    return f"{kept.method}: {answer!r} · {share}\n{len(kept.kept)} kept entering layer {kept.cut_layer}{later}"


def keeps_panels(data: ViewData, found: Keeps) -> Panels:
    """One map per method that ran over the analysed image (`data`: its image, a tiled layout's views, the answering
    patches outlined where the scene has ground truth), its first cut's kept tokens bright, the rest dimmed."""
    visual = data.shape[2]
    panels = []
    for kept in found.methods.values():
        mask = np.zeros(visual, dtype=bool)
        mask[kept.kept] = True
        panels += data.panels(panel_title(kept), present=mask)
    return Panels(panels, data.grid, cols=max(1, 4 // data.views_count()) * data.views_count())


def title(found: Keeps) -> str:
    """The figure's title: the budget. The refused methods are no part of it (`refused_lines`)."""
    return TITLE.format(budget=budget_text(found.budget))


def refused_lines(refused: Mapping[str, str]) -> list[str]:
    """One line per refused method with its reason: "cdpruner refused: ..." (the `refused` of `Keeps` or of its
    JSON)."""
    return [f"{m} refused: {why}" for m, why in refused.items()]


def keeps_plotly(data: ViewData, found: Keeps, width: int | None = None) -> go.Figure:
    """The page's figure of `keeps_panels`: the maps only (the page lists `refused_lines` beside it), its titles
    wrapped for `width` px (None: `Panels`' default, the page's width)."""
    panels = keeps_panels(data, found)
    return panels_plotly(panels if width is None else replace(panels, width=width), title(found))


def keeps_draw(data: ViewData, found: Keeps) -> Figure:
    """The matplotlib figure of `keeps_panels`, the refused methods under the title (a file has no side text), each
    line wrapped at TITLE_CHARS."""
    lines = [line for refused in refused_lines(found.refused) for line in textwrap.wrap(refused, TITLE_CHARS)]
    return panels_draw(keeps_panels(data, found), "\n".join([title(found), *lines]))


def keeps_png(data: ViewData, found: Keeps, folder: str | Path) -> Path:
    """`folder/keeps.png` (`keeps_draw`); returns its path."""
    path = Path(folder) / "keeps.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    keeps_draw(data, found).savefig(path, dpi=PNG_DPI)
    return path
