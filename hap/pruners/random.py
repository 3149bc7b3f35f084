"""Random pruning: HAP's schedule, each cut a seeded uniform choice (`seed`); no maps captured."""

from __future__ import annotations

import torch

from .base import Pruner


class Random(Pruner):
    name = "random"
    maps = False

    def scores(self, state, cut):
        gen = torch.Generator().manual_seed(state.config.seed * 1009 + cut.index)
        return torch.rand(state.visual_pos.shape[1], generator=gen).expand(state.row_valid.shape[0], -1)


PRUNER = Random
