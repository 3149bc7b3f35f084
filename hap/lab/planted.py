"""The hooks of `hap.plant` (docs/method.md §14): a plan of planted sink / dispersed heads applied to one model
instance for a block, on every forward (prefill, decode, pruned or not, with or without a KV cache).

Where it acts: the input of each planted layer's attention output projection (`o_proj`), which holds the query
heads' outputs side by side. For a planted head the hook recomputes, from the layer's own q projection and the keys
and values the layer attended over (its KV cache, or its input without one), the head's stock attention rows
(`hap.scoring.capture.prompt_logits`: causal, padding and any merge bias, grouped-query heads expanded), plants them
(`hap.lab.plan.plant_attention`) and writes the planted output `A' V'` for the rows after the image (the sink
tokens' values zeroed for a planted sink). HAP's capture of the prompt rows at that layer (`decoder._record`)
applies the same `plant_attention` through `hap.patch.hooks.ROWS`, so the pruner scores what the model runs, under
SDPA or eager alike. Which keys are visual or sink tokens is known by their unpruned positions: those of the
running `hap.patch` prefill's kept tokens (`PruneState.key_origins`), else the keys in order.

A massive plan (`Plan.massive`, the default) also adds the sink tokens' massive activation
(`hap.lab.plan.massive_activation`) to the hidden states entering the first layer holding a planted sink head, in
the prefill with the image, before any other hook of that layer (so a `hap.patch` cut entering it, its capture and
the norm sink test see it); the residual stream carries it on, and the KV cache holds what it did to the keys and
values of every later layer.

Every hook is removable and is removed when the block ends, error or not; the model is then the stock one.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from ..patch import adapter_for, hooks
from ..patch.decoder import _cached_keys, _heads, _take, decoder_of, layer_windows
from ..scoring.capture import prompt_attention, prompt_logits
from .plan import (DEFAULT_SINK_COUNT, Plan, classifier_report, massive_activation, plant_attention, planted_values,
                   redundant_tokens)


def _fit(x: torch.Tensor, batch: int) -> torch.Tensor:
    """`x [b, ...]` for a batch of `batch` rows: as is, or its first row repeated (a batch-1 input the causal
    analysis repeats at the decoder, or a fanned-out prefill's shared layers)."""
    return x if x.shape[0] == batch else x[:1].expand(batch, *x.shape[1:])


class Planting:
    """The hooks of one plan on one model (attached to it through `hap.patch.hooks`), and what its last prefill
    planted."""

    def __init__(self, model, plan: Plan) -> None:
        self.model, self.plan = model, plan
        self.image_token = model.config.image_token_id
        self.visual_pos: torch.Tensor | None = None  # long [batch, N] unpruned positions of the image's tokens
        self.sink_index: torch.Tensor | None = None  # long [batch, k] the sink tokens (visual indices) of the prefill
        self.step_mask: torch.Tensor | None = None  # the forward's 2-D attention mask (None: no padding)
        self.fresh = False  # a prompt with the image is entering the decoder
        self.prefill = False  # the decoder's forward now running is that prompt's
        self.inputs: dict[int, tuple] = {}  # layer -> (its attention's input, (cos, sin), cache) of this forward
        self.handles: list = []

    def attach(self) -> None:
        lm = decoder_of(self.model)
        self.handles.append(self.model.model.register_forward_pre_hook(self.model_pre_hook, with_kwargs=True))
        self.handles.append(lm.register_forward_pre_hook(self.decoder_pre_hook, with_kwargs=True))
        if self.plan.massive_layer is not None:
            self.handles.append(lm.layers[self.plan.massive_layer].register_forward_pre_hook(
                self.massive_input, with_kwargs=True, prepend=True))
        for index in self.plan.layers:
            layer = lm.layers[index]
            self.handles.append(layer.self_attn.register_forward_pre_hook(partial(self.attention_input, index),
                                                                          with_kwargs=True))
            self.handles.append(layer.self_attn.o_proj.register_forward_pre_hook(partial(self.head_outputs, index),
                                                                                  prepend=True))
            hooks.ROWS[layer] = partial(self.capture, index)
        hooks.attach(self.model, self)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        for index in self.plan.layers:
            hooks.ROWS.pop(decoder_of(self.model).layers[index], None)
        hooks.detach(self.model, self)

    def unshared(self) -> str | None:
        """Its runs decode one at a time: its hooks follow one run's kept tokens (`hap.patch.hooks.Plugin`)."""
        return "a head-lab plan is planted (its hooks follow one run's kept tokens)"

    def annotate(self, result) -> None:
        """The plan and what the run's head classes found of it, as `result.plant` (`hap.patch.hooks.Plugin`)."""
        result.plant = self.report(result.head_class)

    def model_pre_hook(self, module, args, kwargs) -> None:
        """A prompt with the image: its visual tokens (sink tokens checked against their count); a step continuing
        a cache keeps them; any other input has no image to plant on."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.step_mask = kwargs.get("attention_mask")
        if input_ids is not None and bool((input_ids == self.image_token).any()):
            visual = input_ids == self.image_token
            counts = visual.sum(-1)
            if not bool((counts == counts[0]).all()):
                raise ValueError(f"hap.plant: every sample needs the same number of visual tokens; got "
                                 f"{counts.tolist()}")
            self.plan.check_tokens(int(counts[0]))
            B, T = visual.shape
            self.visual_pos = torch.arange(T, device=visual.device).expand(B, T)[visual].view(B, -1)
            self.fresh = True
        else:
            cache = kwargs.get("cache")
            if cache is None or cache.get_seq_length() == 0:
                self.visual_pos = None

    def decoder_pre_hook(self, module, args, kwargs) -> None:
        """The prefill's sink tokens: the plan's, or the most redundant visual tokens of each image (one, or the
        plan's count)."""
        self.prefill, self.fresh = self.fresh, False
        if not self.prefill:
            return
        if self.plan.sink_tokens is None or isinstance(self.plan.sink_tokens, int):
            embeds = kwargs["inputs_embeds"]
            self.sink_index = redundant_tokens(_take(embeds, self.visual_pos.to(embeds.device)),
                                               self.plan.sink_tokens or DEFAULT_SINK_COUNT)
        else:
            tokens = torch.tensor(self.plan.sink_tokens, device=self.visual_pos.device)
            self.sink_index = tokens.expand(self.visual_pos.shape[0], -1)
        self.sink_index = self.sink_index.to(self.visual_pos.device)

    def massive_input(self, module, args, kwargs) -> tuple | None:
        """Before the first layer holding a planted sink head, in the prefill with the image: the sink tokens' rows
        of its input gain the massive activation (rows placed by their unpruned positions, as the keys are)."""
        if not self.prefill or self.visual_pos is None:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        B, T, _ = hidden.shape
        origins = self.origins(self.plan.massive_layer, B, T).to(hidden.device)
        visual_pos = _fit(self.visual_pos, B).to(hidden.device)
        visual = (origins[..., None] == visual_pos[:, None, :]).any(-1)  # [B, T]
        sinks = visual_pos.gather(1, _fit(self.sink_index, B).to(hidden.device))
        sink = (origins[..., None] == sinks[:, None, :]).any(-1)
        hidden = massive_activation(hidden, visual, sink)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def attention_input(self, index: int, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.inputs[index] = (hidden, kwargs["position_embeddings"], kwargs.get("cache"))

    def head_outputs(self, index: int, module, args: tuple) -> tuple | None:
        """Before layer `index`'s o_proj: the planted heads' outputs replaced on the rows after the image."""
        hidden, rotary, cache = self.inputs.pop(index)
        if self.visual_pos is None:
            return None
        x = args[0]  # [B, Tq, H * d]
        attn = module_attention(self.model, index)
        B, Tq, _ = x.shape
        q = _heads(attn, attn.q_proj(hidden), "q_norm", rotary)  # [B, H, Tq, d]
        k, v = _cached_keys(cache, index), _cached_keys(cache, index, "values")
        if k is None:  # no cache: the keys and values of this input
            k = _heads(attn, attn.k_proj(hidden), "k_norm", rotary)
            v = attn.v_proj(hidden).view(B, Tq, -1, attn.head_dim).transpose(1, 2)
        Tk, H = k.shape[2], q.shape[1]
        origins = self.origins(index, B, Tk).to(x.device)
        visual_pos = _fit(self.visual_pos, B).to(x.device)
        visual = (origins[..., None] == visual_pos[:, None, :]).any(-1)  # [B, Tk]
        sink = (origins[..., None] == visual_pos.gather(1, _fit(self.sink_index, B).to(x.device))[:, None, :]).any(-1)
        rows = origins[:, Tk - Tq:] > visual_pos[:, -1:]  # [B, Tq] the text after the image
        if not bool(rows.any()):
            return None
        valid = None if self.step_mask is None else _fit(self.step_mask, B).to(x.device).gather(1, origins).bool()
        probs = prompt_attention(prompt_logits(q, k, torch.arange(Tk - Tq, Tk, device=x.device), valid, attn.scaling,
                                               self.bias(index, Tk)))  # [B, H, Tq, Tk] float32
        sinks, dispersed = self.plan.at_layer(index)
        heads = sinks + dispersed
        planted = plant_attention(probs[:, heads], visual, sink, list(range(len(sinks))),
                                  list(range(len(sinks), len(heads))), self.plan.strength)
        group = H // k.shape[1]
        values = planted_values(v[:, [h // group for h in heads]].float(), sink, [h in sinks for h in heads])
        out = (planted @ values).transpose(1, 2).to(x.dtype)  # [B, Tq, Hp, d]
        y = x.reshape(B, Tq, H, -1).clone()
        y[:, :, heads] = torch.where(rows[:, :, None, None], out, y[:, :, heads])
        return (y.view(B, Tq, -1), *args[1:])

    def origins(self, index: int, batch: int, keys: int) -> torch.Tensor:
        """long [batch, keys] the unpruned position of each key of layer `index` (`PruneState.key_origins` while
        `hap.patch` prunes this forward, else the keys in order)."""
        state = self.prune_state()
        if state is None:
            return torch.arange(keys, device=self.visual_pos.device).expand(batch, keys)
        return _fit(state.key_origins(index, keys), batch)

    def bias(self, index: int, keys: int) -> torch.Tensor | None:
        """float [batch, keys] the merge's attention bias at layer `index` (0 on tokens generated since), or None."""
        state = self.prune_state()
        bias = None if state is None else state.bias_at(index)
        return None if bias is None else torch.nn.functional.pad(bias, (0, keys - bias.shape[1]))

    def prune_state(self):
        """The `PruneState` of the `hap.patch` pruning this forward, or None (stock forward)."""
        patch = getattr(self.model, "_hap", None)
        return patch.state if patch is not None and patch.mode is not None else None

    def capture(self, index: int, attn: torch.Tensor, visual_pos: torch.Tensor, kept_orig: torch.Tensor
                ) -> torch.Tensor:
        """HAP's captured prompt rows of layer `index` (`attn [batch, H, P, T]`, the current visual tokens at
        `visual_pos [batch, N]`, originally `kept_orig [batch, N]`) as the planted heads run them."""
        B, _, _, T = attn.shape
        visual_pos, kept_orig = _fit(visual_pos, B), _fit(kept_orig, B)
        is_sink = (kept_orig[..., None] == _fit(self.sink_index, B).to(kept_orig.device)[:, None, :]).any(-1)
        visual = torch.zeros(B, T, dtype=torch.bool, device=attn.device).scatter(1, visual_pos, True)
        sink = torch.zeros(B, T, dtype=torch.bool, device=attn.device).scatter(1, visual_pos, is_sink)
        sinks, dispersed = self.plan.at_layer(index)
        return plant_attention(attn, visual, sink, sinks, dispersed, self.plan.strength)

    def report(self, head_class: list[list[str]] | None = None) -> dict:
        """The plan as JSON, the sink tokens its last prefill used (sample 0) and, given a run's head classes
        `[layers][heads]`, the classifier's precision / recall on the plan (`hap.lab.plan.classifier_report`)."""
        used = None if self.sink_index is None else self.sink_index[0].tolist()
        out = {**self.plan.to_json(), "sink_tokens_used": used}
        if head_class is not None:
            out["classifier"] = classifier_report(self.plan, head_class)
        return out


def module_attention(model, index: int) -> torch.nn.Module:
    """Decoder layer `index`'s attention module."""
    return decoder_of(model).layers[index].self_attn


@contextmanager
def plant(model, sink=(), dispersed=(), sink_tokens=None, strength: float = 0.9, massive: bool = True):
    """`with hap.plant(model, sink=[(l, h), ...], dispersed=[...], sink_tokens=None, strength=0.9, massive=True) as
    lab:` every forward of `model` in the block (`hap.run`, `generate`, the causal and utility paths) runs the
    planted heads (docs/method.md §14, `hap.lab.plan`); after it the model is the stock one, error or not. `sink`,
    `dispersed`: iterables of (layer, query head); `sink_tokens`: visual-token indices, or a count k for the k most
    redundant visual tokens of each image (background patches), None for the most redundant one; `strength` in
    [0, 1]; `massive`: the sink tokens also carry a massive activation in the residual stream from the input of the
    first planted sink layer on, as real sink tokens do (False: attention and values only). A bad plan raises
    ValueError naming the field and the allowed range. `lab.report()` gives the plan and the sink tokens its last
    prefill used."""
    plan = Plan.of(sink, dispersed, sink_tokens, strength, massive)
    adapter_for(model)
    text = model.config.text_config
    plan.check_model(text.num_hidden_layers, text.num_attention_heads, layer_windows(text), type(model).__name__)
    if any(isinstance(plugin, Planting) for plugin in hooks.attached(model)):
        raise ValueError("a plan is already planted on this model: one hap.plant block at a time")
    lab = Planting(model, plan)
    if not plan.empty:
        lab.attach()
    try:
        yield lab
    finally:
        lab.detach()
