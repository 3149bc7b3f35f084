"""HAP's schedule with plain head averaging (T = inf) over every layer of the segment before a cut: the ablation of
the head weighting (docs/method.md §7)."""

from __future__ import annotations

import math

from .base import Pruner


class Uniform(Pruner):
    name = "uniform"

    @classmethod
    def from_config(cls, config):
        return cls(config.groups, config.rows, whole_segment=True, temperature=math.inf)


PRUNER = Uniform
