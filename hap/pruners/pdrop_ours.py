"""Our earlier PyramidDrop variant, reported as ours (docs/method.md §7): FastV's rule at every cut of the pyramid
(the last token's attention in the layer that just ran), original positions kept."""

from __future__ import annotations

from .base import Pruner


class PDropOurs(Pruner):
    name = "pdrop_ours"
    fixed_rows = "last"


PRUNER = PDropOurs
