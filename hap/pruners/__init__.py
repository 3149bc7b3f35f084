"""The pruning methods: one module per method, each a `Pruner` (`hap.pruners.base`) on one executor
(docs/method.md §7, §9), and the one registry (`METHODS`) that the knobs, the page, the CLI, the sweep, the
benchmark and the lmms-eval plugin read.

Every method runs through the same cuts, the same FLOPs accounting and the same selection; a pruner says what it
needs captured, where it cuts, how it selects and how positions continue:

    method     cuts                  scored by (rows; layers)                      heads               positions after a cut
    hap        G after K             config.rows; the previous segment (or its last layer)  softmax(PAQ / T)  original
    uniform    G after K             config.rows; the whole previous segment       uniform (T = inf)   original
    pdrop      G after K             last token; the next layer (lookahead)        uniform             renumbered
    pdrop_ours G after K             last token; the segment's last layer          uniform             original
    fastv      1 at K                last token; layer K-1                         uniform             original
    random     G after K             - (a seeded uniform choice)                   -                   original
    visionzip  1 before layer 0      - (the vision tower's [CLS] attention, merged block)  -           renumbered
    sparsevlm  3 (official)          raters, mean; the layer that just ran, + recycling    uniform     renumbered
    autoprune  L-1 (every layer)     all text rows, mean; the layer that just ran, + [CLS] prior at layer 0,
                                     MI-driven schedule, + recycling               uniform             renumbered
    none       no cuts

`pdrop` and `visionzip` follow their official code (docs/method.md §7): PyramidDrop scores the cut entering
layer l with layer l's own norm, q/k projections and RoPE applied to the tokens about to enter it, and both
renumber positions 0..T'-1 after a drop (RoPE distances between the remaining tokens shrink); HAP and the
other methods keep each token's original position. `sparsevlm` (v1.5) and `autoprune` follow theirs too
(`hap.pruners.sparsevlm`, `hap.pruners.autoprune`, `hap.recycle`): each cut is scored by the attention of the layer
that just ran, averaged over heads and then over the scoring rows (not the L2 norm over rows), its dropped tokens
are partly recycled into cluster means placed after the kept ones, and positions are renumbered. `pdrop_ours` is
our earlier PyramidDrop variant, reported as ours: FastV's rule at every cut of the pyramid (the last token's
attention in the layer that just ran), original positions kept (on the shipped model it scored above the official
rule, docs/method.md §7).

HAP's own knobs beyond the paper (docs/method.md §10: `head_weight`, `sink_ranking`, `score_layers`, `merge`,
`first_cut`) shape the `hap` pruner only; the baselines score as published (`rows` applies to `uniform` too).

Adding a method: its module here (a `Pruner` subclass named by `PRUNER`), its test, and its name in `METHODS`.
The registry imports no module until a method is asked for, so `hap.knobs` can read it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import HAPConfig
    from .base import Pruner

# the registry: each name is its module's
METHODS = (
    "hap",
    "uniform",
    "fastv",
    "pdrop",
    "pdrop_ours",
    "random",
    "visionzip",
    "sparsevlm",
    "autoprune",
    "none",
)


def pruner_class(method: str) -> type[Pruner]:
    """The `Pruner` subclass of `method` (one of METHODS); ValueError names the known ones."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed; choose one of {', '.join(METHODS)}")
    return import_module(f"{__name__}.{method}").PRUNER


def pruner_for(config: HAPConfig) -> Pruner:
    """The pruner `config` asks for, its scoring knobs taken from `config`."""
    return pruner_class(config.method).from_config(config)
