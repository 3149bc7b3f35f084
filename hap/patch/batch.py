"""Several prefills of one prompt decoded as one batch (docs/method.md §9): the answers of the runs a request
compares (the stock model, the method, uniform averaging; the sweep's methods x budgets) generated together.

Each run prefills alone, batch 1, with its own hooks (`decoder.Patch`), and leaves a KV cache whose layers have
their own lengths (a layer after a cut holds only its group's kept tokens). `merge_caches` stacks the runs' caches
into one batch, layer by layer, each run's keys and values left-padded to the longest run's at that layer
(layer 0 to the prompt's length, so `generate` counts positions as on an unpruned cache), and `BatchDecode`
hooks each decoder layer of the continued `generate` with the mask of that layer: the padding masked out, each run's
own merge bias on its prompt keys, the generated tokens open to all. Where a run's pruner renumbers positions
(`PruneState.decode_shift`), its rows of the layer's positions and rotary tables are lowered as its own decode steps
would be. Keys carry their rotary embedding from the prefill, so where they sit in the padded cache does not matter.

The batch changes no answer beyond the rounding of a batched matmul (tests compare every token with the runs
decoded one by one). `refusal` names what it does not batch (then each run decodes alone): layers of several
attention kinds or sliding windows (their caches are not plain growing ones), an attention implementation that takes
no 4-D mask (flash), a head-lab plan (its hooks follow one run's kept tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from . import hooks
from .decoder import Patch, decoder_of, decoder_shape

MASKED_ATTENTION = ("sdpa", "eager")  # attention implementations that take a 4-D additive mask


@dataclass
class Prefilled:
    """One run's prefill: its hooks (removed from the model; `patch.state` is None for an unpruned, untraced run), the
    KV cache it wrote (batch 1, each layer its own length), its prompt and first token `first` long [1, T + 1], and
    the M-RoPE offset the model kept after it (`rope_deltas` [1, 1] of Qwen2/2.5/3-VL; None elsewhere)."""

    patch: Patch
    cache: DynamicCache
    first: torch.Tensor
    rope_deltas: torch.Tensor | None = None

    @property
    def prompt_len(self) -> int:
        return self.first.shape[1] - 1

    def shift(self, layer: int) -> int:
        """Positions a decode step at `layer` is lowered by (`PruneState.decode_shift` of its group; 0 before a cut)."""
        state = self.patch.state
        cut = None if state is None else state.group_of(layer)
        return 0 if cut is None else state.decode_shift(cut)

    def bias(self, layer: int) -> torch.Tensor | None:
        """float [1, T_group] the merge bias on the prompt keys of `layer`'s group, or None."""
        state = self.patch.state
        return None if state is None else state.bias_at(layer)


def refusal(model) -> str | None:
    """Why the runs of `model` cannot be decoded as one batch (each then decodes alone), or None."""
    attention = getattr(decoder_of(model).config, "_attn_implementation", None) or ""
    if attention not in MASKED_ATTENTION:
        return f"its attention ({attention!r}) takes no per-layer mask"
    tc = model.config.text_config
    if any(t != "full_attention" for t in getattr(tc, "layer_types", None) or []) or decoder_shape(model).windows:
        return "its layers differ in attention kind or slide a window (their caches are not plain growing ones)"
    return next((why for why in (plugin.unshared() for plugin in hooks.attached(model)) if why), None)


def merge_caches(runs: list[Prefilled], prompt_len: int, room: int = 0) -> tuple[DynamicCache, list[torch.Tensor]]:
    """(one cache of the runs' caches stacked along the batch, [layers] float [B, K_l] the additive mask of each
    layer's K_l cached keys: 0 or the run's merge bias on its own keys, the dtype's minimum on the padding).

    Layer l's keys and values are left-padded with zeros to its longest run's length K_l (layer 0: at least
    `prompt_len`, the unpruned cache's length, which `generate` counts positions from), in buffers with `room` more
    token slots that the decode steps fill in place (`GrowingLayer`)."""
    layers, masks = [], []
    for index in range(len(runs[0].cache.layers)):
        own = [run.cache.layers[index] for run in runs]
        length = max(max(layer.keys.shape[2] for layer in own), prompt_len if index == 0 else 0)
        dtype = own[0].keys.dtype
        (_, heads, _, dim), (_, value_heads, _, value_dim) = own[0].keys.shape, own[0].values.shape
        keys = own[0].keys.new_empty(len(runs), heads, length + room, dim)  # the room is written before it is read
        values = own[0].values.new_empty(len(runs), value_heads, length + room, value_dim)
        rows = []
        for b, (run, layer) in enumerate(zip(runs, own)):
            pad = length - layer.keys.shape[2]
            keys[b, :, :pad], values[b, :, :pad] = 0, 0  # masked, but zero: a masked NaN would still spread
            keys[b, :, pad:length] = layer.keys[0]  # one copy of each run's cache
            values[b, :, pad:length] = layer.values[0]
            row = torch.zeros(length, dtype=dtype, device=layer.keys.device)
            row[:pad] = torch.finfo(dtype).min
            bias = run.bias(index)
            if bias is not None:  # the group's prompt keys are the cache's; a cut before layer 0 too
                row[pad:pad + bias.shape[-1]] += bias[0].to(row)
            rows.append(row)
        layers.append(GrowingLayer(keys, values, length))
        masks.append(torch.stack(rows))
    cache = DynamicCache()
    cache.layers = layers
    return cache, masks


class GrowingLayer(DynamicLayer):
    """A dynamic cache layer whose keys and values [B, heads, length, dim] are the first `length` slots of buffers
    with room for more: a decode step writes its token into the slots after them instead of concatenating a copy of
    the whole layer (`DynamicLayer.update`); the buffers grow (by concatenation) only once they are full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self.key_buffer, self.value_buffer = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self.key_buffer = torch.cat([self.keys, key_states], dim=-2)
            self.value_buffer = torch.cat([self.values, value_states], dim=-2)
        else:
            self.key_buffer[:, :, start:end] = key_states
            self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


class BatchDecode:
    """The hooks of a batched continuation (`decode`): each layer's mask, and where a run renumbers its positions,
    its rows of the layer's positions and rotary tables."""

    def __init__(self, runs: list[Prefilled], masks: list[torch.Tensor], pad: list[int]) -> None:
        self.masks = masks
        self.patch = runs[0].patch  # the adapter's rotary tables and decode positions (one model)
        self.shifts = [torch.tensor([run.shift(i) for run in runs]) for i in range(len(masks))]  # [layers] long [B]
        self.pad = torch.tensor(pad, device=masks[0].device)  # [B] each run's left padding to the longest prompt
        self.cache: DynamicCache | None = None
        self.positions: torch.Tensor | None = None  # this step's position ids as on an unpruned cache
        self.handles: list = []

    def attach(self, model, cache: DynamicCache) -> None:
        self.cache = cache
        self.handles.append(model.model.register_forward_pre_hook(self.model_pre_hook, with_kwargs=True))
        for i, layer in enumerate(decoder_of(model).layers):
            self.handles.append(layer.register_forward_pre_hook(partial(self.layer_pre_hook, i), with_kwargs=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def model_pre_hook(self, module, args, kwargs) -> tuple[tuple, dict]:
        """A decode step: its position ids (those `generate` passes, else counted from layer 0's padded cache, as the
        stock model would on an unpruned one)."""
        if kwargs.get("position_ids") is None and any(bool(s.any()) for s in self.shifts):
            ids = kwargs.get("input_ids", args[0] if args else None)
            new = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
            start = self.cache.get_seq_length(0)  # the longest prompt's count; a shorter one's less its padding
            steps = torch.arange(start, start + new, device=self.masks[0].device)[None] - self.pad[:, None]
            kwargs["position_ids"] = self.patch.decode_positions(module, steps)
        self.positions = kwargs.get("position_ids")
        return args, kwargs

    def layer_pre_hook(self, index: int, layer, args, kwargs):
        """Layer `index` of a decode step: the mask over its padded cache plus the step's tokens; the renumbered
        runs' positions."""
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] > 1:
            raise ValueError("a batched continuation decodes one token per step")
        prefix = self.masks[index].to(hidden.device, hidden.dtype)
        grown = self.cache.layers[index].keys.shape[2] - prefix.shape[1] + 1  # the tokens generated, this step's
        kwargs["attention_mask"] = torch.cat([prefix, prefix.new_zeros(prefix.shape[0], grown)], 1)[:, None, None, :]
        shift = self.shifts[index]
        if bool(shift.any()):
            positions = self.positions.to(hidden.device) - shift.to(hidden.device).view(-1, 1)
            kwargs["position_ids"] = positions
            kwargs["position_embeddings"] = self.patch.kinds.rotary(hidden, positions, self.patch.kinds.types[index])
        return args, kwargs


def decode(model, runs: list[Prefilled], max_new_tokens: int, firsts: list[torch.Tensor] | None = None,
           **generate_kwargs):
    """Continue the runs' greedy answers as one batch, `max_new_tokens` more at most, from each run's prompt and
    first token (`firsts`: others in their place, long [1, T_b + 1] each, e.g. a forced first token); prompts of
    different lengths are left-padded to the longest, T. Returns `generate`'s output, whose `sequences` [B, T + 1 + n]
    hold the generated tokens from column T. The runs' caches are read, not changed. The model must be unpatched
    (the runs' own hooks removed)."""
    firsts = firsts or [run.first for run in runs]
    T = max(run.prompt_len for run in runs)
    pad = [T - run.prompt_len for run in runs]
    sequences = torch.cat([torch.nn.functional.pad(f, (p, 0)) for f, p in zip(firsts, pad)])
    attention = torch.cat([torch.nn.functional.pad(torch.ones_like(f), (p, 0)) for f, p in zip(firsts, pad)])
    cache, masks = merge_caches(runs, T, room=max_new_tokens + 1)
    hooks = BatchDecode(runs, masks, pad)
    hooks.attach(model, cache)
    inner, deltas = model.model, getattr(model.model, "rope_deltas", None)
    if runs[0].rope_deltas is not None:  # each run's own M-RoPE offset (positions count each row's real tokens)
        inner.rope_deltas = torch.cat([run.rope_deltas for run in runs])
    try:
        return model.generate(input_ids=sequences, attention_mask=attention, cache=cache,
                              max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, **generate_kwargs)
    finally:
        hooks.detach()
        if runs[0].rope_deltas is not None:
            inner.rope_deltas = deltas
