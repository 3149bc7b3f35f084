"""PyramidDrop as its official code runs it (docs/method.md §7): G cuts, the cut entering layer l scored by the last
token's head-mean attention computed with layer l's own norm, q/k projections and RoPE on the tokens about to enter
it (a lookahead); positions renumbered 0..T'-1 after each drop."""

from __future__ import annotations

from .base import Pruner


class PDrop(Pruner):
    name = "pdrop"
    fixed_rows = "last"
    lookahead = True
    renumber = True


PRUNER = PDrop
