"""A pruner of one's own, in one file, as the README shows it: `HAP_PRUNERS=own_pruners` (with tests/ on the Python
path) offers it to the CLI, the app, the benchmark and lmms-eval; `tests/test_own_pruner.py` imports it."""

import hap
from hap.pruners.base import Pruner


@hap.pruners.register
class Norm(Pruner):
    """Keep the visual tokens whose hidden states entering the cut are longest, on HAP's schedule."""

    name = "norm_test"
    maps = False  # no decoder attention captured
    embeds = True  # the hidden states entering each cut, `cut.embeds` [batch, visual, D]

    def scores(self, state, cut):
        return cut.embeds.float().norm(dim=-1)  # [batch, visual], higher = keep
