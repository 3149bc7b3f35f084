"""The result a visitor meets: a shipped example analysed on the default model, shown without a click.

The page opens with an example in the image editor and its question in the prompt box (their values when the page is
built: the server never sets the editor after the page has loaded), and the answer cards, the kept tokens and every
tab filled from that example's `/analyze` run at the page's default settings, run once per server and kept
(`Arrival`). Which example (`opening`): with the shipped model (or any local folder) first in HAP_APP_MODELS, the first
synthetic scene asked its own question; with a hub checkpoint first (a GPU Space), its first photograph, once that
model is loaded (a visitor's Run loads it), and until then the shipped model's result on the first scene
(`stand_in`), which the note above the answer cards says.

Two events of the page's load do it (`app.layout`): `shown` answers at once from what is kept (no model call, off the
model lane), and where a result is still missing it sets a trigger (`PENDING`) whose change runs `compute` on the model
lane, one request at a time with the others: once the results exist, a page load queues nothing there. A failed run
is kept as its message, which the note gives; the page opens whatever happens. The result is every output of the run
by name, states included, so the other tabs (keeps, sweep, causal, inspector, lab, follow-up) work on it as on a Run.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from . import images
from .models import LOADED
from .settings import TINY_MODEL, examples, is_local, knob_defaults
from .uploads import file_data

LOG = logging.getLogger("hap.app")
NOTE = "arrival"  # the note above the answer cards (its elem_id too)
PENDING = "arrival_pending"  # the trigger of `compute` (a state)
IDLE = "**Start here.** Upload an image or pick an example, ask a question and press **Run**."


@dataclass(frozen=True)
class Example:
    """One example as the page opens on it: its image file, its question and the model it is run on."""

    image: str
    prompt: str
    model: str

    def __str__(self) -> str:
        return f"{Path(self.image).stem.replace('_', ' ')}, \"{self.prompt}\""


def opening(models: list[str]) -> Example | None:
    """The example the page opens with, on the default model `models[0]`: a hub checkpoint's first photograph, else
    the first synthetic scene (None where there is none)."""
    scenes, photos = examples(models)
    if not is_local(models[0]) and photos:
        return Example(*photos[0][:2], models[0])
    return Example(*scenes[0][:2], models[0]) if scenes else None


def stand_in(models: list[str]) -> Example | None:
    """The shipped model's first scene, shown until the hub checkpoint listed first is loaded (None where the
    default model is local, or the shipped model is not offered)."""
    scenes, _ = examples(models)
    if is_local(models[0]) or TINY_MODEL not in models or not scenes:
        return None
    return Example(*scenes[0][:2], TINY_MODEL)


class Arrival:
    """The results shown on arrival, run once each through `handler` (an `app.handler.Handler`) and kept."""

    def __init__(self, handler, models: list[str]) -> None:
        self.handler, self.models = handler, models
        self.opening, self.stand_in = opening(models), stand_in(models)
        self.kept: dict[Example, dict[str, object] | str] = {}  # outputs by name, or why the run failed
        self.lock = threading.Lock()

    def result(self, example: Example | None) -> dict[str, object] | None:
        found = self.kept.get(example)
        return found if isinstance(found, dict) else None

    def best(self) -> Example | None:
        """The example whose kept result the page shows: the opening one, else the stand-in."""
        return next((e for e in (self.opening, self.stand_in) if self.result(e) is not None), None)

    def todo(self) -> Example | None:
        """The example to run next: the opening one where its model can run without replacing another (a local
        folder, or the model already loaded), else the stand-in while nothing can be shown."""
        first, other = self.opening, self.stand_in
        if first is not None and first not in self.kept and (is_local(first.model) or LOADED.name == first.model):
            return first
        if other is not None and other not in self.kept and self.best() is None:
            return other
        return None

    def note(self, todo: Example | None) -> str:
        """The note above the answer cards: what they show, and what is on its way."""
        shown, first = self.best(), self.opening
        failed = [f"{e} on {e.model} could not be analysed ({self.kept[e].rstrip('.')})"
                  for e in (first, self.stand_in) if isinstance(self.kept.get(e), str)]
        lines = []
        if shown is not None:
            lines.append(f"**On arrival:** {shown} on {shown.model}, at the default settings, analysed once for every "
                         "visitor. Pick another example or upload an image, then press **Run**.")
            if shown is not first:
                lines.append(f"This is the shipped model's result, shown until {first.model} is loaded (press Run to "
                             "load it and analyse the image in the editor).")
        if todo is not None:
            lines.append(f"**Analysing** {todo} on {todo.model}, once per server: the page fills in when it is done.")
        lines += [f"{line}." for line in failed]
        return "\n\n".join(lines) or IDLE

    def outputs(self, todo: Example | None) -> dict[str, object]:
        """The outputs by name (`app.present.OUTPUTS`) of the result shown, and the note; with no result yet, the
        head lab's head picker on the default model's shape (it is clicked to make a plan)."""
        images.restore()  # the result's images, were any removed from disk
        shown = self.result(self.best())
        if shown is None:
            shown = {}
            try:
                shown["lab_heads"] = self.handler.lab_pickers(self.models[0], "", None, None)[0]
            except gr.Error as err:  # an unreadable config: the picker waits for a run
                LOG.warning("no head picker on arrival: %s", err.message)
        return {**shown, NOTE: self.note(todo)}

    def shown(self) -> dict[str, object]:
        """The page's load: what is kept, at once; where a result is missing, a new `PENDING` value (its change runs
        `compute`). Never raises: the page opens whatever happens."""
        def show() -> dict[str, object]:
            todo = self.todo()
            return {**self.outputs(todo), **({PENDING: f"{todo} {time.monotonic()}"} if todo is not None else {})}

        return safely(show)

    def compute(self) -> dict[str, object]:
        """Run the missing result (on the model lane), keep it, and show the best one (a result still missing waits
        for the next visit's trigger). Never raises."""
        with self.lock:
            todo = self.todo()
            if todo is not None:
                self.kept[todo] = self.run(todo)
        return safely(lambda: self.outputs(None))

    def run(self, example: Example) -> dict[str, object] | str:
        """The outputs of `example`'s `/analyze` run at its model's default settings, its images pinned, after one
        warm-up run of it (causal off, not kept: a model's first run pays one-off costs, which its first card's latency
        would show as the method's); the message where it fails."""
        request = dict(image=file_data(Path(example.image)), prompt=example.prompt, model_name=example.model,
                       **knob_defaults(example.model))
        try:
            self.handler.analyze(**{**request, "causal": "off"})
            with images.pinning():
                return self.handler.analyze(**request)
        except gr.Error as err:
            return err.message
        except Exception as err:  # noqa: BLE001 - the page opens whatever happens
            LOG.exception("the arrival run of %s failed", example)
            return f"{err.__class__.__name__}: {err}"


def safely(show) -> dict[str, object]:
    """`show()`, or where it raises, the note saying so (logged): the page opens whatever happens."""
    try:
        return show()
    except Exception as err:  # noqa: BLE001
        LOG.exception("the result on arrival could not be shown")
        return {NOTE: f"The result on arrival could not be shown ({err.__class__.__name__}: {err}). {IDLE}"}


def seen() -> gr.Markdown:
    """The note once the visitor's own run replaced the result it describes: hidden."""
    return gr.Markdown(visible=False)
