"""The layers before the first cut, computed once for every run of one input (docs/method.md §9).

A sweep prefills one prompt dozens of times: each method at each budget. Every run that cuts entering layer K or
later (HAP, uniform, FastV, PyramidDrop, DART, ... at every budget) gives layers 0..K-1 the same hidden states, so
those layers compute the same thing again and again. `sharing_layers(model)` memoises, for a block, each decoder
layer's feed-forward block on its input: a prefill whose input to layer l's feed-forward block equals
(`torch.equal`) the input of the last prefill that ran it reads that prefill's output instead. The feed-forward block
is the bulk of a layer's work (3 n d m of the 2 n d (d_q + d_kv) + 2 n^2 d_q + 3 n d m MACs of §8: 84% on Qwen2-0.5B
at 750 tokens); the attention still runs in every run, so each run's hooks capture their own maps and write their
own KV cache, and a head-lab plan acts as without the block.

Exact by construction: an output is reused only for an input equal to the one that produced it, so every run gives
the same numbers as without the block (`tests/test_sharing.py`). One entry per layer (the last prefill's input and
output, about two hidden-state stacks); decode steps (one token) and passes with autograd on are never memoised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from weakref import WeakSet

import torch

from .patch.decoder import decoder_of

BLOCK = "mlp"  # the decoder layer's feed-forward block (every family here names it so)
ACTIVE: WeakSet = WeakSet()  # the models inside a `sharing_layers` block


@dataclass
class LayerMemo:
    """Per decoder layer, the last memoised prefill's feed-forward (input, output), and how often one was reused."""

    entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def run(self, index: int, compute, hidden: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s feed-forward output on `hidden` [B, T, D]: the stored one where the stored input equals
        `hidden`, else `compute(hidden)`, then stored. Decode steps (T = 1) and autograd passes: computed only."""
        if hidden.shape[1] < 2 or torch.is_grad_enabled():
            return compute(hidden)
        stored = self.entries.get(index)
        if stored is not None and stored[0].shape == hidden.shape and torch.equal(stored[0], hidden):
            self.hits += 1
            return stored[1]
        self.misses += 1
        out = compute(hidden)
        self.entries[index] = (hidden, out)
        return out


@contextmanager
def sharing_layers(model) -> Iterator[LayerMemo]:
    """Inside the block, `model`'s decoder layers reuse the feed-forward output of an equal input (module
    docstring). The model is as before after the block, even on error (a forward already wrapped, e.g. by
    accelerate's device hooks, is wrapped in turn and given back); blocks on one model do not nest."""
    if model in ACTIVE:
        raise RuntimeError("sharing_layers blocks on one model do not nest")
    blocks = [block for layer in decoder_of(model).layers if (block := getattr(layer, BLOCK, None)) is not None]
    saved = [vars(block).get("forward") for block in blocks]  # an instance-level wrapper to give back, or None
    memo = LayerMemo()
    for index, block in enumerate(blocks):
        block.forward = partial(memo.run, index, block.forward)
    ACTIVE.add(model)
    try:
        yield memo
    finally:
        ACTIVE.discard(model)
        for block, forward in zip(blocks, saved):
            del block.forward
            if forward is not None:
                block.forward = forward
