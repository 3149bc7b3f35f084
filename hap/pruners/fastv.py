"""FastV (docs/method.md §7): one cut entering layer K, scored by the last token's head-mean attention in layer K-1;
original positions kept."""

from __future__ import annotations

from .base import Pruner


class FastV(Pruner):
    name = "fastv"
    fixed_rows = "last"
    fixed_cuts = 1


PRUNER = FastV
