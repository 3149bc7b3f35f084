"""The pruning methods: one module per method, each a `Pruner` (`hap.pruners.base`) on one executor
(docs/method.md §7, §9), and the one registry (`METHODS`) that the knobs, the page, the CLI, the sweep, the
benchmark and the lmms-eval plugin read.

Every method runs through the same cuts, the same FLOPs accounting and the same selection; a pruner says what it
needs captured, where it cuts, how it selects and how positions continue:

    method     cuts                  scored by (rows; layers)                      heads               positions
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
    divprune   1 before layer 0      - (max-min diversity of the projected tokens)  -                  renumbered
    dart       1 at K (>= 1)         - (layer K-1's keys: pivots; its final-normed output: least similar)  original
    vispruner  1 before layer 0      - (the tower's [CLS] attention, then duplicate removal)  -         renumbered
    cdpruner   1 before layer 0      - (DPP on the projected tokens x CLIP relevance to the raw question)  renumbered
    hawk       1 before layer 0      question; layer 0's q.k before RoPE, L2-normalised per head  static (a file)  original
    downsample 1 before layer 0      - (each view's grid average-pooled, no scoring)  -                renumbered
               (Qwen2-VL family: the image resized before the processor, no cut)
    none       no cuts

`pdrop` and `visionzip` follow their official code (docs/method.md §7): PyramidDrop scores the cut entering
layer l with layer l's own norm, q/k projections and RoPE applied to the tokens about to enter it, and both
renumber positions 0..T'-1 after a drop (RoPE distances between the remaining tokens shrink); HAP and the
other methods keep each token's original position. `sparsevlm` (v1.5) and `autoprune` follow theirs too
(`hap.pruners.sparsevlm`, `hap.pruners.autoprune`, `hap.pruners.recycle`): each cut is scored by the attention of the layer
that just ran, averaged over heads and then over the scoring rows (not the L2 norm over rows), its dropped tokens
are partly recycled into cluster means placed after the kept ones, and positions are renumbered. `pdrop_ours` is
our earlier PyramidDrop variant, reported as ours: FastV's rule at every cut of the pyramid (the last token's
attention in the layer that just ran), original positions kept (on the shipped model it scored above the official
rule, docs/method.md §7).

The 2025 pruners (`divprune`, `dart`, `vispruner`, `cdpruner`, `downsample`) keep what their official code keeps on
the same inputs (docs/method.md §7); their rules are pure tensor functions in their modules, the executor hands them
the cues they name (`Pruner.embeds`, `cls_cues`, `clip`, `layer_states`), and a family a rule does not carry over to
is refused before any work (`Pruner.refuses`, the adapters' [CLS] and M-RoPE refusals).
`hawk` (CVPR 2026) reads layer 0's pre-RoPE logits (`Pruner.logits`) and a model's static head importance
(`Pruner.static_heads`: the `head_importance` knob's file, else the model folder's, found by `hap.patch.apply`, which
refuses without one and names the command that measures it; HAP's `head_weight="static"` reads the same file).

HAP's own knobs beyond the paper (docs/method.md §10: `head_weight`, `sink_ranking`, `score_layers`, `merge`, `diversity`,
`first_cut`) shape the `hap` pruner only; the baselines score as published (`rows` applies to `uniform` too).

Adding a method to the package: its module here (a `Pruner` subclass named by `PRUNER`), its test, and its name in
`hap.methods.BUILT_IN`. A method of your own, outside the package: `@hap.pruners.register` on its class, its module
named in `HAP_PRUNERS` (`hap.methods`). The registry (`hap.methods`) imports no method module until the method is
asked for, so `hap.knobs` can read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..methods import METHODS, load_plugins, pruner_class, register, unregister

if TYPE_CHECKING:
    from ..config import HAPConfig
    from .base import Pruner

__all__ = ["METHODS", "cls_user", "load_plugins", "pruner_class", "pruner_for", "register", "unregister"]


def pruner_for(config: HAPConfig) -> Pruner:
    """The pruner `config` asks for, its scoring knobs taken from `config`."""
    return pruner_class(config.method).from_config(config)


def cls_user(config: HAPConfig) -> str:
    """Who asks for the vision tower's [CLS] cues in `config`, for a refusal: the knob that asks (`Pruner.cls_knob`,
    HAP's `first_cut='vision'`) where the method asks only through a knob, else the method."""
    knob = pruner_for(config).cls_knob
    return knob or f"method={config.method!r}"
