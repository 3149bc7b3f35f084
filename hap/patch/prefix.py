"""The layers before the first cut, computed once for every run of one input (docs/method.md §9).

A sweep prefills one prompt dozens of times: each method at each budget. Every run that drops its first token
entering layer K or later (HAP, uniform, FastV, PyramidDrop, DART, ... at every budget; at a high budget HAP's first
group may keep every token, so K is later still) gives layers 0..K-1 the same hidden states, so those layers compute
the same thing again and again. `sharing_layers(model, depth)` memoises, for a block, the matrix products of each of
the first `depth` decoder layers (`BLOCKS`: the q, k, v and output projections and the feed-forward block, nearly all
of a layer's §8 MACs but the 2 n^2 d_q of the attention itself) on their input: a prefill whose input to one of them
equals (`torch.equal`) the input of the last prefill that ran it reads that prefill's output instead. The attention
still runs in every run, and the modules' hooks still fire, so each run's hooks capture their own maps and write
their own KV cache, and a head-lab plan acts as without the block.

Exact by construction: an output is reused only for an input equal to the one that produced it, so every run gives
the same numbers as without the block (`tests/test_prefix.py`). One entry per block (the last prefill's input and
output: a few hidden-state stacks of `depth` layers); decode steps (one token) and passes with autograd on are
never memoised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from weakref import WeakSet

import torch

from .decoder import decoder_of

BLOCKS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp")  # a decoder
#   layer's projections and feed-forward block, as every family here names them (one a layer lacks is not memoised)
ACTIVE: WeakSet = WeakSet()  # the models inside a `sharing_layers` block


@dataclass
class LayerMemo:
    """Per memoised block (layer, name), the last prefill's (input, output), and how often one was reused."""

    entries: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def run(self, key: tuple[int, str], compute, hidden: torch.Tensor) -> torch.Tensor:
        """Block `key`'s output on `hidden` [B, T, D]: the stored one where the stored input equals `hidden`, else
        `compute(hidden)`, then stored. Decode steps (T = 1) and autograd passes: computed only."""
        if hidden.shape[1] < 2 or torch.is_grad_enabled():
            return compute(hidden)
        stored = self.entries.get(key)
        if stored is not None and stored[0].shape == hidden.shape and torch.equal(stored[0], hidden):
            self.hits += 1
            return stored[1]
        self.misses += 1
        out = compute(hidden)
        self.entries[key] = (hidden, out)
        return out


@contextmanager
def sharing_layers(model, depth: int | None = None) -> Iterator[LayerMemo]:
    """Inside the block, the projections and feed-forward blocks (`BLOCKS`) of `model`'s first `depth` decoder layers
    (None: every layer) reuse the output of an equal input (module docstring). The model is as before after the
    block, even on error (a forward already wrapped, e.g. by accelerate's device hooks, is wrapped in turn and given
    back); blocks on one model do not nest."""
    if model in ACTIVE:
        raise RuntimeError("sharing_layers blocks on one model do not nest")
    blocks = {}
    for index, layer in enumerate(decoder_of(model).layers[:depth]):
        for name in BLOCKS:
            try:
                blocks[index, name] = layer.get_submodule(name)
            except AttributeError:  # e.g. a fused projection
                continue
    saved = {key: vars(block).get("forward") for key, block in blocks.items()}  # instance-level wrappers, or None
    memo = LayerMemo()
    for key, block in blocks.items():
        block.forward = partial(memo.run, key, block.forward)
    ACTIVE.add(model)
    try:
        yield memo
    finally:
        ACTIVE.discard(model)
        for key, block in blocks.items():
            del block.forward
            if saved[key] is not None:
                block.forward = saved[key]
