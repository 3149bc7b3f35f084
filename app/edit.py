"""The image editor's value as the image the model sees, and what an edit changed in a run.

The page's image input is gradio's ImageEditor (brush, eraser, crop). Its value (`{"background", "layers",
"composite"}`, files in gradio's upload cache, each path checked by `app.uploads.allowed_path`) becomes one image
source for `hap.runs.inputs.load_image`, the same checked path as an upload: the background as uploaded when nothing
was drawn, erased or cropped (so a scene keeps the ground truth in its file), else the composite. `EditDiff`
compares the run on the edited image with the run on the original: answers, head classes, kept tokens per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from hap import views
from hap.runs.inputs import InputLimits, load_image

from .uploads import REFUSED, allowed_path

EDIT_TOLERANCE = 8  # largest per-channel difference of an unedited composite (a browser's own JPEG decoding)
NO_EDIT = ("The image is as uploaded. Edit it (brush, eraser or crop in the editor) and run again: this section "
           "then compares the run on the edited image with the run on the original.")


@dataclass(frozen=True)
class ImageInput:
    """One request's image: what `load_image` reads, the name to show, and the original when it was edited."""

    source: str | Image.Image
    name: str
    original: str | None = None  # the background as uploaded, when the composite differs from it

    @property
    def edited(self) -> bool:
        return self.original is not None


def _path(file) -> str | None:
    """The checked path (`allowed_path`) of one of gradio's FileData dicts, None for none; ValueError(REFUSED) for a
    path outside the upload cache and the examples, whatever else the dict carries."""
    if not isinstance(file, dict) or file.get("path") in (None, ""):
        return None
    return allowed_path(file["path"])


def _name(file, path: str) -> str:
    return Path(str(file.get("orig_name") or path)).name


def is_editor_value(image) -> bool:
    return isinstance(image, dict) and {"background", "composite"} <= set(image)


def image_input(image, limits: InputLimits) -> ImageInput:
    """The request's image: an upload (FileData), the editor's value or, in-process, a PIL image; ValueError
    when there is none, and ValueError(REFUSED) when it is none of these or names a file that is not an upload or
    an example (`app.uploads`). An edited composite is checked like an upload."""
    if image is None:
        raise ValueError("no image: upload one or click an example")
    if isinstance(image, Image.Image):
        return ImageInput(image, "image")
    if is_editor_value(image):
        background, composite = _path(image["background"]), _path(image["composite"])
        if background is None and composite is None:
            raise ValueError("no image: upload one or click an example")
        if composite is None:
            return ImageInput(background, _name(image["background"], background))
        if background is None:
            return ImageInput(composite, "drawing")
        name = _name(image["background"], background)
        if not differs(load(background, name, limits), load(composite, f"{name} (edited)", limits)):
            return ImageInput(background, name)
        return ImageInput(composite, f"{name} (edited)", background)
    path = _path(image)
    if path is None:
        raise ValueError(REFUSED)
    return ImageInput(path, _name(image, path))


def load(source, name: str, limits: InputLimits) -> Image.Image:
    """The checked image as RGB (`hap.runs.inputs.load_image`); ValueError naming the file."""
    try:
        return load_image(source, limits)
    except ValueError as err:
        raise ValueError(f"image {name!r}: {err}") from err


def kept_changes(before: Sequence[Sequence[int]], after: Sequence[Sequence[int]]
                 ) -> list[tuple[set[int], set[int], set[int]]]:
    """Per group, the kept tokens of two runs compared: (kept in both, only before, only after)."""
    return [(set(b) & set(a), set(b) - set(a), set(a) - set(b)) for b, a in zip(before, after)]


def differs(a: Image.Image, b: Image.Image, tolerance: int = EDIT_TOLERANCE) -> bool:
    """Whether `b` is an edit of `a`: another size (a crop) or a pixel changed by more than `tolerance`."""
    if a.size != b.size:
        return True
    return int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max()) > tolerance


@dataclass(frozen=True)
class EditDiff:
    """What an edit changed in one method's run: before = the original image, after = the edited one. Kept tokens are
    compared by index only on one token grid: a crop on a model of dynamic resolution (Qwen2-VL) changes the grid,
    and then the two runs' kept tokens are shown side by side, not compared."""

    answers: tuple[str, str]  # (before, after)
    classes: list[tuple[int, int, str, str]]  # (layer, head, class before, class after) of the heads that changed
    scored_heads: int  # heads classed in both runs
    kept: list[tuple[set[int], set[int], set[int]]] | None  # per group: (in both, only before, only after); None
    #                                                         where the grids differ
    after: views.ViewData  # the edited run, drawn under the diff
    before: views.ViewData  # the run on the original

    @classmethod
    def of(cls, before: views.ViewData, after: views.ViewData, answers: tuple[str, str]) -> EditDiff:
        pairs = [(layer, head, b, a) for layer, (row_b, row_a) in enumerate(zip(before.head_class, after.head_class))
                 for head, (b, a) in enumerate(zip(row_b, row_a)) if b and a]
        kept = kept_changes([g.kept for g in before.groups], [g.kept for g in after.groups]) \
            if before.grid == after.grid else None
        return cls(answers, [p for p in pairs if p[2] != p[3]], len(pairs), kept, after, before)

    def to_json(self) -> dict:
        """The diff for API callers: answers, changed heads, both token grids and per group the kept tokens only
        before / after ("kept"; None where the grids differ, and then "kept_by_run": each run's kept tokens)."""
        out = {"answer_original": self.answers[0], "answer_edited": self.answers[1],
               "classes_changed": [list(c) for c in self.classes], "scored_heads": self.scored_heads,
               "grids": {"original": list(self.before.grid), "edited": list(self.after.grid)}, "kept": None}
        if self.kept is None:
            out["kept_by_run"] = [{"group": a.index, "original": sorted(b.kept), "edited": sorted(a.kept)}
                                  for b, a in zip(self.before.groups, self.after.groups)]
        else:
            out["kept"] = [{"group": g.index, "both": len(both), "only_original": sorted(lost),
                            "only_edited": sorted(gained)} for g, (both, lost, gained) in zip(self.after.groups,
                                                                                            self.kept)]
        return out

    def text(self) -> str:
        """Markdown: the answers, the heads whose class changed, the kept tokens that changed per group (or, where
        the grids differ, each run's count)."""
        before, after = self.answers
        lines = [f"**The edit's effect on {self.after.method}.** Answer on the original: **{before}**; on the edited "
                 f"image: **{after}**" + (" (unchanged)." if before == after else "."),
                 f"- Head classes: {len(self.classes)} of the {self.scored_heads} heads scored in both runs changed"
                 + (": " + ", ".join(f"layer {l} head {h} {b} → {a}" for l, h, b, a in self.classes[:12])
                    + (", ..." if len(self.classes) > 12 else "") if self.classes else "") + "."]
        if self.kept is None:
            (rb, cb), (ra, ca) = self.before.grid, self.after.grid
            lines.append(f"- The edit changed the token grid ({rb} x {cb} tokens on the original, {ra} x {ca} on the "
                         "edited image: a crop on a model of dynamic resolution), so a token index covers different "
                         "patches in the two runs: their kept tokens are shown side by side, not compared.")
            lines += [f"- Group {a.index}: {len(b.kept)} of {self.before.shape[2]} tokens kept on the original, "
                      f"{len(a.kept)} of {self.after.shape[2]} on the edited image."
                      for b, a in zip(self.before.groups, self.after.groups)]
            lines.append("\nAn edited scene has no saved ground truth: its answering patches are not outlined.")
            return "\n".join(lines)
        for g, (both, lost, gained) in zip(self.after.groups, self.kept):
            lines.append(f"- Group {g.index}: {len(both)} kept tokens in both runs, {len(lost)} kept only on the "
                         f"original, {len(gained)} only on the edited image.")
        lines.append("\nAn edited scene has no saved ground truth: its answering patches are not outlined. A crop "
                     "changes what each token covers, so compare tokens by grid position only.")
        return "\n".join(lines)

    def figure(self):
        """Each group's kept tokens over the edited image (the rest dimmed), with the tokens kept only after the edit
        marked + and those kept only before marked x; where the grids differ, each run's kept tokens over its own
        image, side by side."""
        import plotly.graph_objects as go

        if self.kept is None:
            return self.side_by_side()
        data = self.after
        grid_cols = data.grid[1]
        panels = []
        for g, (both, lost, gained) in zip(data.groups, self.kept):
            present = np.zeros(data.shape[2], dtype=bool)
            present[list(both | gained)] = True
            panels.append(views.Panel(f"group {g.index}: +{len(gained)} / x{len(lost)}", data.image,
                                      present=present.reshape(data.grid)))
        fig = views.panels_plotly(views.Panels(panels, data.grid, cols=3, width=650),
                                  "Kept tokens after the edit (+ only after, x only before)")
        for i, (_, lost, gained) in enumerate(self.kept):
            for tokens, symbol, color, label in ((gained, "cross", "#2ca02c", "kept only after the edit"),
                                                 (lost, "x", "#d62728", "kept only before the edit")):
                index = sorted(tokens)
                fig.add_trace(go.Scatter(
                    x=[t % grid_cols for t in index], y=[t // grid_cols for t in index], mode="markers",
                    marker=dict(symbol=symbol, color=color, size=7), name=label, showlegend=i == 0,
                    hovertemplate=f"token %{{customdata}}: {label}<extra></extra>", customdata=index,
                ), i // 3 + 1, i % 3 + 1)
        return fig

    def side_by_side(self):
        """Each group's kept tokens on the original (left, its grid) and on the edited image (right, its grid)."""
        runs = (("original", self.before), ("edited", self.after))
        shown = [[replace(p, title=f"{name}, {p.title}", grid=data.grid) for p in views.mask_panels(data).panels]
                 for name, data in runs]
        panels = [p for pair in zip(*shown) for p in pair]
        return views.panels_plotly(views.Panels(panels, self.after.grid, cols=2, width=650),
                                   "Kept tokens on the original (left) and the edited image (right): the token grids "
                                   "differ, so no token is compared")
