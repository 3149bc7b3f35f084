"""The hook machinery shared by the adapters of Hugging Face VLMs whose decoder is a stack of
Llama-style layers (`input_layernorm`, `self_attn.{q,k}_proj`, RoPE from `position_embeddings`,
a dynamic KV cache): LLaVA with a Llama or Qwen2 decoder, Qwen2-VL, Qwen2.5-VL. Each adapter
(`llava.py`, `qwen2_vl.py`) says where the decoder and the image token are and how the visual
tokens lie on the image; this module does the rest.

Only forward hooks on one instance, removable by `remove_patch`; no class is modified and the
decoder layers keep their attention implementation (SDPA, eager, ...). Modifications of the
stock forward, all made by hooks:

- multimodal-model pre-hook: finds the visual tokens (`input_ids == image_token_id`) and plans the
  prefill (`PruneState.start`); on a decode step it keeps the step's 2-D mask.
- decoder-layer pre-hook, prefill: recomputes the prompt rows of the layers whose maps are
  needed (from the layer's own norm, q/k projections and RoPE); at a cut, gathers the kept tokens
  of the hidden states, the RoPE (cos, sin), the position ids (originals: no RoPE shift) and
  rebuilds the mask for the shorter sequence, then hands those to every later layer, so each
  later layer writes a shorter KV cache.
- decoder-layer pre-hook, decode: layers after a cut get a mask sized to their own cache.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from transformers.masking_utils import create_causal_mask

from ..budget import DecoderShape
from ..capture import prompt_attention
from ..config import HAPConfig
from ..pruner import PruneState


@dataclass
class Patch:
    """Everything the patch attaches to the model as `model._hap`."""

    config: HAPConfig
    trace: bool
    handles: list = field(default_factory=list)
    state: PruneState | None = None
    mode: str | None = None  # "prefill", "decode" or None (not pruning this forward)
    step_mask: torch.Tensor | None = None
    overrides: dict = field(default_factory=dict)
    pending: tuple | None = None  # (queries, hidden) of a capture waiting for the layer's cached keys
    cache: object | None = None  # the KV cache the pruned prefill wrote: only its decode steps are pruned
    prefill_started: float = 0.0
    prefill_seconds: float = 0.0


def decoder_of(model) -> torch.nn.Module:
    """The text decoder (a module with `.layers`); the same path in every supported architecture."""
    return model.model.language_model


def check_decoder(model) -> None:
    """Refuse decoders this machinery would get wrong."""
    layer_types = getattr(model.config.text_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{type(model).__name__} has {sorted(set(layer_types))} layers; HAP supports full-attention decoders only"
        )


def decoder_shape(model) -> DecoderShape:
    tc = model.config.text_config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    return DecoderShape(tc.num_hidden_layers, tc.hidden_size, tc.intermediate_size, kv_heads * head_dim)


def apply_patch(model, config: HAPConfig, trace: bool = False) -> Patch:
    """Patch `model` in place so that its forward and `generate` prune as `config` says."""
    check_decoder(model)
    if hasattr(model, "_hap"):
        remove_patch(model)
    patch = Patch(config=config, trace=trace)
    shape = decoder_shape(model)
    image_token = model.config.image_token_id
    lm = decoder_of(model)
    text_config = lm.config

    def on_model(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        patch.overrides = {}
        if config.method == "none" and not trace:
            patch.mode = None
        elif input_ids is not None and bool((input_ids == image_token).any()):
            cache = kwargs.get("cache")
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("HAP prunes a fresh prefill: an image cannot be added to an existing KV cache")
            patch.prefill_started = time.perf_counter()
            patch.state = PruneState.start(
                config, input_ids == image_token, kwargs.get("attention_mask"), shape, trace
            )
            patch.mode = "prefill"
        elif patch.cache is not None and kwargs.get("cache") is patch.cache and patch.state.schedule is not None:
            patch.mode = "decode"
            patch.step_mask = kwargs.get("attention_mask")
        else:
            patch.mode = None

    def on_decoder_done(module, args, kwargs, output):
        if patch.mode == "prefill":
            patch.prefill_seconds = time.perf_counter() - patch.prefill_started

    def make_layer_hook(index: int):
        def on_layer(layer, args, kwargs):
            if patch.mode is None:
                return None
            hidden = args[0] if args else kwargs.pop("hidden_states")
            rest = args[1:]
            kwargs.update(patch.overrides)
            st = patch.state
            if patch.mode == "prefill":
                patch.cache = kwargs.get("cache")
                if index in st.lookahead_layers:
                    q, k = _queries(st, layer, hidden, kwargs), _keys(layer, hidden, kwargs)
                    _record(st, layer, index, q, k, hidden, lookahead=True)
                if st.cut_index(index) is not None:
                    hidden = _cut(st, text_config, index, hidden, kwargs)
                    patch.overrides = {
                        k: kwargs[k] for k in ("attention_mask", "position_embeddings", "position_ids") if k in kwargs
                    }
                if index in st.capture_layers:
                    q = _queries(st, layer, hidden, kwargs)
                    if kwargs.get("use_cache") and kwargs.get("cache") is not None:
                        patch.pending = (q, hidden)  # keys come from the cache once the layer ran
                    else:
                        _record(st, layer, index, q, _keys(layer, hidden, kwargs), hidden)
            elif st.cut_index(index) is not None:
                step_mask = st.decode_attention_mask(index, patch.step_mask)
                kwargs["attention_mask"] = create_causal_mask(
                    config=text_config,
                    inputs_embeds=hidden,
                    attention_mask=None if step_mask is None else step_mask.to(hidden.device),
                    cache=kwargs.get("cache"),
                    position_ids=None,
                    layer_idx=index,
                )
                patch.overrides = {"attention_mask": kwargs["attention_mask"]}
            return (hidden, *rest), kwargs

        return on_layer

    def make_layer_done_hook(index: int):
        def on_layer_done(layer, args, kwargs, output):
            if patch.pending is not None:
                (q, hidden), patch.pending = patch.pending, None
                k = _cached_keys(kwargs["cache"], index)
                _record(st=patch.state, layer=layer, index=index, q=q,
                        k=k if k is not None else _keys(layer, hidden, kwargs), hidden=hidden)

        return on_layer_done

    patch.handles.append(model.model.register_forward_pre_hook(on_model, with_kwargs=True))
    patch.handles.append(lm.register_forward_hook(on_decoder_done, with_kwargs=True))
    for i, layer in enumerate(lm.layers):
        patch.handles.append(layer.register_forward_pre_hook(make_layer_hook(i), with_kwargs=True))
        patch.handles.append(layer.register_forward_hook(make_layer_done_hook(i), with_kwargs=True))
    model._hap = patch
    return patch


def remove_patch(model) -> None:
    """Remove every hook `apply_patch` added; the model is stock again."""
    patch = getattr(model, "_hap", None)
    if patch is None:
        return
    for handle in patch.handles:
        handle.remove()
    del model._hap


def _rope(attn_module) -> callable:
    """The decoder's own `apply_rotary_pos_emb` (Llama, Qwen2, Mistral... define it in their module)."""
    return sys.modules[type(attn_module).__module__].apply_rotary_pos_emb


@torch.no_grad()
def _queries(st: PruneState, layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Post-RoPE queries of the prompt rows only: `[batch, heads, P, head_dim]`."""
    attn = layer.self_attn
    B, T, _ = hidden.shape
    rows = st.row_positions(T).to(hidden.device)
    q = attn.q_proj(layer.input_layernorm(hidden[:, rows])).view(B, len(rows), -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    cos, sin = kwargs["position_embeddings"]
    return _rope(attn)(q, q, cos[:, rows], sin[:, rows])[0]


@torch.no_grad()
def _keys(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Post-RoPE keys of every token, recomputed: `[batch, kv_heads, T, head_dim]`."""
    attn = layer.self_attn
    B, T, _ = hidden.shape
    k = attn.k_proj(layer.input_layernorm(hidden)).view(B, T, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    cos, sin = kwargs["position_embeddings"]
    return _rope(attn)(k, k, cos, sin)[0]


def _cached_keys(cache, index: int) -> torch.Tensor | None:
    """The keys layer `index` just wrote to a dynamic cache (this prefill only), else None."""
    layers = getattr(cache, "layers", None)
    return getattr(layers[index], "keys", None) if layers is not None and index < len(layers) else None


@torch.no_grad()
def _record(st: PruneState, layer, index: int, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor,
            lookahead: bool = False) -> None:
    rows = st.row_positions(hidden.shape[1]).to(q.device)
    key_valid = st.key_valid()
    key_valid = None if key_valid is None else key_valid.to(q.device)
    st.record(index, prompt_attention(q, k, rows, key_valid, layer.self_attn.scaling), hidden, lookahead)


@torch.no_grad()
def _cut(st: PruneState, text_config, index: int, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Apply the cut entering layer `index` to the hidden states and the layer kwargs (in place)."""
    keep = st.cut(index)  # [B, T']
    B = hidden.shape[0]

    def take(x: torch.Tensor) -> torch.Tensor:  # [B|1, T, ...] -> [B, T', ...]
        x = x.expand(B, *x.shape[1:])
        index = keep.to(x.device).view(B, -1, *([1] * (x.dim() - 2)))
        return x.gather(1, index.expand(-1, -1, *x.shape[2:]))

    hidden = take(hidden)
    cos, sin = kwargs["position_embeddings"]
    kwargs["position_embeddings"] = (take(cos), take(sin))
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = take(kwargs["position_ids"])
    key_valid = st.key_valid()
    kwargs["attention_mask"] = create_causal_mask(
        config=text_config,
        inputs_embeds=hidden,
        attention_mask=None if key_valid is None else key_valid.to(hidden.device).long(),
        cache=kwargs.get("cache"),
        position_ids=None,
        layer_idx=index,
    )
    return hidden
