"""Extension points of the execution path: where a plug-in that changes what the model runs registers, so that the
method's path (`hap.patch`, `hap.run`) never imports it. The head lab (`hap.lab`) is one: it plants heads through
these, and nothing outside the lab imports the lab.

- `ROWS`: decoder layer module -> `rows(attn [batch, heads, P, T], visual_pos [batch, N_cur], kept_orig [batch, N_cur])
  -> attn`, the prompt rows that layer really runs where a plug-in changed its attention; the executor's capture passes
  what it computed through it, so the pruner scores what the model runs.
- `ATTACHED`: model -> the plug-ins attached to it (`Plugin`), asked whether their runs can share one decode batch and
  given each run's result to annotate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol
from weakref import WeakKeyDictionary

import torch

Rows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ROWS: WeakKeyDictionary = WeakKeyDictionary()  # decoder layer module -> Rows, while a plug-in changes its attention
ATTACHED: WeakKeyDictionary = WeakKeyDictionary()  # model -> list[Plugin]


class Plugin(Protocol):
    """A plug-in attached to one model."""

    def unshared(self) -> str | None:
        """Why runs of the model cannot be decoded as one batch while it is attached, or None."""

    def annotate(self, result) -> None:
        """Add the plug-in's record of a run to its `hap.runs.trace.Result`."""


def attach(model, plugin: Plugin) -> None:
    """Attach `plugin` to `model` (`ATTACHED`)."""
    ATTACHED.setdefault(model, []).append(plugin)


def detach(model, plugin: Plugin) -> None:
    """Detach `plugin` from `model`."""
    plugins = ATTACHED.get(model, [])
    if plugin in plugins:
        plugins.remove(plugin)
    if not plugins:
        ATTACHED.pop(model, None)


def attached(model) -> list[Plugin]:
    """The plug-ins attached to `model`, in attach order."""
    return list(ATTACHED.get(model, ()))


def captured_rows(layer: torch.nn.Module, attn: torch.Tensor, visual_pos: torch.Tensor,
                  kept_orig: torch.Tensor) -> torch.Tensor:
    """The prompt rows `attn` [batch, heads, P, T] that decoder layer `layer` runs: as computed, or as a plug-in
    changed them (`ROWS`)."""
    rows = ROWS.get(layer)
    return attn if rows is None else rows(attn, visual_pos.to(attn.device), kept_orig.to(attn.device))
