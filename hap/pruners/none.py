"""No pruning: the stock model (no cut, nothing captured)."""

from __future__ import annotations

from .base import Pruner


class NoPruning(Pruner):
    name = "none"
    fixed_cuts = 0


PRUNER = NoPruning
