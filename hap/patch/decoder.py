"""The hook machinery (docs/method.md §9) shared by the adapters of Hugging Face VLMs whose decoder is a stack of
Llama-style layers (`input_layernorm`, `self_attn.{q,k}_proj`, RoPE from `position_embeddings`,
a dynamic KV cache): LLaVA with a Llama or Qwen2 decoder, LLaVA-NeXT / OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Gemma 3. Each adapter (`llava.py`, `qwen2_vl.py`, ...) says where the decoder and the image token are and how the
visual tokens lie on the image, and where its layers differ in attention kind (Gemma 3's sliding / full layers) how
each kind builds its rotary table and mask (`LayerKinds`); this module does the rest. `Patch.origin` tells an adapter
which prompt positions the kept tokens came from (Qwen3-VL's DeepStack, Gemma 3's image blocks).

Only forward hooks on one instance, removable by `remove_patch`; no class is modified and the
decoder layers keep their attention implementation (SDPA, eager, ...). The hooks are the methods
of one `Patch` object, one per step of a forward:

- `model_pre_hook`: finds the visual tokens (`input_ids == image_token_id`) and plans the prefill
  (`PruneState.start`); on a decode step it keeps the step's 2-D mask and position ids.
- `layer_prefill`: recomputes the prompt rows of the layers whose maps are needed (from the layer's
  own norm, q/k projections and RoPE); at a cut, gathers the kept tokens of the hidden states, the
  RoPE (cos, sin), the position ids and rebuilds the mask for the shorter sequence, then hands those to
  every later layer, so each later layer writes a shorter KV cache. Kept tokens keep their original
  positions (no RoPE shift), except under a pruner that renumbers (`pdrop`, `visionzip`, `sparsevlm`,
  `autoprune`, `divprune`, `vispruner`, `cdpruner`, `scope`, `holov`, `prunesid`, `hiprune`, `downsample`, as their
  official code does): positions 0..T'-1
  after each cut. SparseVLM and AutoPrune also append their recycled tokens right after the kept visual ones;
  a pruner that reads the decoder's input (`Pruner.reads_input`: SparseVLM's raters) gets it before layer 0; a
  pruner that reads the layer before its cut (`Pruner.layer_states`: DART) gets that layer's keys and its output
  through the decoder's final norm.
- `layer_decode`: layers after a cut get a mask sized to their own cache; under `pdrop`, `visionzip`, `sparsevlm`,
  `autoprune`, `divprune`, `vispruner`, `cdpruner`, `scope`, `holov`, `prunesid`, `hiprune` and `downsample` also the
  step's positions lowered by the prompt
  tokens dropped so far (each layer's position is its own cache length), so a generated token follows its group's
  renumbered prompt (elsewhere the unpruned positions).
- `query_done`: a captured layer's prompt-row queries, taken from its own q projection (not recomputed).
- `layer_done`: the capture, once the layer cached its keys, reads them there.
- `decoder_done`: the prefill's wall time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..config import HAPConfig
from ..planning.flops import DecoderShape
from ..pruners import pruner_for
from ..pruners.cues import VisionCues
from ..pruners.merge import add_key_bias
from ..scoring.capture import prompt_attention, prompt_logits
from .hooks import captured_rows
from .state import PruneState

Positions = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None
# (input_ids [batch, T], the multimodal model's kwargs) -> (visual, image) bool [batch, T]: the tokens the pruner may
# drop, and every token of the image (where the prompt rows start after); default: both are the image token's ids
TokenMasks = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor]] | None
# (input_ids [batch, T], the multimodal model's kwargs) -> per sample, the (rows, cols) of each view's grid of visual
# tokens in token order (`Pruner.views`; default: none given, one square grid where the pruner needs one)
ViewGrids = Callable[[torch.Tensor, dict], list[tuple[tuple[int, int], ...]]] | None


@dataclass(frozen=True)
class LayerKinds:
    """The attention kinds of a decoder's layers, each with its own rotary table and mask (Gemma 3: "sliding_attention"
    and "full_attention"; `uniform_kinds`: one kind for every layer). A cut or a decode step entering layer i hands
    each later layer the (cos, sin) and the mask of its own kind, each mask sized to the first layer of that kind from
    i on (its cache length)."""

    types: tuple  # [layers] each layer's kind
    rotary: Callable  # (hidden [B, T, D], position_ids [B, T], kind) -> (cos, sin) [B, T, head_dim] each
    mask: Callable  # (kind, hidden [B, T, D], 2-D padding mask [B, kv] | None, cache, layer_idx, causal_skip) -> mask

    def first(self, kind, index: int) -> int:
        """The first layer of `kind` at or after layer `index`."""
        return next(j for j in range(index, len(self.types)) if self.types[j] == kind)


def uniform_kinds(model) -> LayerKinds:
    """One kind for every layer: the decoder's rotary embedding and its stock causal mask (`_mask`)."""
    lm = decoder_of(model)
    return LayerKinds((None,) * len(lm.layers), lambda hidden, positions, kind: lm.rotary_emb(hidden, positions),
                      lambda kind, *args: _mask(lm.config, *args))


def decoder_of(model) -> torch.nn.Module:
    """The text decoder (a module with `.layers`): `model.model.language_model`, `.text_model` in Idefics3 / SmolVLM."""
    inner = model.model
    return inner.text_model if hasattr(inner, "text_model") else inner.language_model


def attention_outputs(model) -> list[torch.nn.Module]:
    """Each decoder layer's attention output projection (`self_attn.o_proj`), in layer order. Its input
    `[batch, T, heads * head_dim]` holds the query heads' outputs side by side, head h in columns
    `[h * head_dim, (h + 1) * head_dim)` (with GQA too: one slice per query head)."""
    return [layer.self_attn.o_proj for layer in decoder_of(model).layers]


def check_decoder(model, kinds: LayerKinds | None = None) -> None:
    """Refuse decoders this machinery would get wrong: layers of several attention kinds, unless the adapter says how
    each kind builds its rotary table and mask (`kinds`)."""
    layer_types = getattr(model.config.text_config, "layer_types", None) or []
    if kinds is None and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{type(model).__name__} has {sorted(set(layer_types))} layers; HAP supports full-attention decoders only"
        )


def sliding_window(text_config) -> int | None:
    """The window of a decoder whose every layer slides one (Mistral: `sliding_window` set, no `layer_types`), else
    None (full attention, or per-layer types)."""
    if getattr(text_config, "layer_types", None):
        return None
    return getattr(text_config, "sliding_window", None)


def layer_windows(text_config) -> tuple[int | None, ...]:
    """[layers] each decoder layer's sliding window in tokens (None: full attention)."""
    types = getattr(text_config, "layer_types", None)
    if types:
        return tuple(text_config.sliding_window if t == "sliding_attention" else None for t in types)
    return (sliding_window(text_config),) * text_config.num_hidden_layers


def decoder_shape(model) -> DecoderShape:
    tc = model.config.text_config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    windows = layer_windows(tc)
    q_dim = tc.num_attention_heads * head_dim
    return DecoderShape(tc.num_hidden_layers, tc.hidden_size, tc.intermediate_size, kv_heads * head_dim,
                        windows if any(w is not None for w in windows) else (),
                        None if q_dim == tc.hidden_size else q_dim)


def image_tokens(model) -> int:
    """The visual tokens of one image on a fixed-resolution model (LLaVA-1.5: 576): its config's `image_seq_length`,
    else (image size / patch size)^2 of its vision tower."""
    seq = getattr(model.config, "image_seq_length", None)
    if seq:
        return int(seq)
    vision = model.config.vision_config
    return (vision.image_size // vision.patch_size) ** 2


def square_blocks(model, side: int) -> ViewGrids:
    """The view grids of an image whose visual tokens (`image_token_id`) come in blocks of `side` x `side`, one per
    tile, crop or view, each row-major (InternVL, SmolVLM / Idefics3, Gemma 3)."""
    def grids(input_ids: torch.Tensor, kwargs: dict) -> list[tuple[tuple[int, int], ...]]:
        counts = (input_ids == model.config.image_token_id).sum(1).tolist()
        return [((side, side),) * (n // (side * side)) for n in counts]
    return grids


def has_pixels(kwargs: dict) -> bool:
    """Whether a forward of the multimodal model carries an image: its pixels, or (inside `generate`, which encodes
    the image before the prefill) its encoded features."""
    return kwargs.get("pixel_values") is not None or bool((kwargs.get("mm_encoder_outputs") or {}).get("image"))


class Patch:
    """The hooks of one patched model (`model._hap`): one object whose methods are the named steps of a
    forward (model pre-hook, layer prefill, layer decode, layer done, decoder done)."""

    def __init__(self, model, config: HAPConfig, trace: bool, decode_positions: Positions = None,
                 priority: torch.Tensor | None = None, tail: int = 0, lead: int = 0,
                 token_masks: TokenMasks = None, kinds: LayerKinds | None = None, view_grids: ViewGrids = None) -> None:
        self.config, self.trace, self.priority, self.tail, self.lead = config, trace, priority, tail, lead
        self.view_grids = view_grids
        self.decode_positions = decode_positions or (lambda model, positions: positions)
        self.token_masks = token_masks or (lambda ids, kwargs: (ids == self.image_token,) * 2)
        self.shape = decoder_shape(model)
        self.image_token = model.config.image_token_id
        self.kinds = kinds or uniform_kinds(model)
        self.handles: list = []
        self.state: PruneState | None = None  # the last prefill's pruning state
        self.mode: str | None = None  # "prefill", "decode" or None (not pruning this forward)
        self.step_mask: torch.Tensor | None = None  # the decode step's 2-D mask as generate passes it
        self.step_positions: torch.Tensor | None = None  # the decode step's position ids, as on an unpruned cache
        self.overrides: dict = {}  # layer kind -> the layer kwargs a cut changed, handed to every later layer of it
        self.prompt: dict = {}  # the multimodal model's kwargs of the last prefill (for adapters: token type ids)
        self.origin: torch.Tensor | None = None  # long [B, T'] each token's prompt position since the prefill's
        #                                         first cut (-1: a recycled token); None before it (for adapters)
        self.pending: tuple | None = None  # (layer, hidden, rows) of a capture waiting for the layer to run
        self.pending_q: torch.Tensor | None = None  # [B, P, heads * head_dim] its rows of the layer's q projection
        self.rotary: tuple = (None, None)  # (the layers' cos, its rows' (cos, sin)): the same within a segment
        self.cache = None  # the KV cache the pruned prefill wrote: only its decode steps are pruned
        self.vision_cues: VisionCues | None = None  # the tower's cues captured before the next prefill
        self.clip = None  # (CLIPModel, tokenizer) of the `clip_model` knob, for a pruner that needs it (`ask`)
        self.question: torch.Tensor | None = None  # the question's cue (`Pruner.embed_question`), for the prefill
        self.final_norm = decoder_of(model).norm  # the decoder's final norm (`Pruner.layer_states`)
        self.keys_pending: tuple | None = None  # (layer, its input hidden states) whose keys the next cut reads
        self.layer_keys: torch.Tensor | None = None  # [B, T, kv_heads * head_dim] those keys, once the layer ran
        self.prefill_started = 0.0  # perf_counter when this forward's prefill started; 0.0 in a decode step
        self.prefill_seconds = 0.0

    def attach(self, model) -> None:
        """Register every hook on `model` (removable through `self.handles`)."""
        lm = decoder_of(model)
        self.handles.append(model.model.register_forward_pre_hook(self.model_pre_hook, with_kwargs=True))
        self.handles.append(lm.register_forward_hook(self.decoder_done, with_kwargs=True))
        for i, layer in enumerate(lm.layers):
            self.handles.append(layer.register_forward_pre_hook(partial(self.layer_pre_hook, i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(partial(self.layer_done, i), with_kwargs=True))
            self.handles.append(layer.self_attn.q_proj.register_forward_hook(partial(self.query_done, i)))

    def model_pre_hook(self, module, args, kwargs) -> tuple[tuple, dict]:
        """Before the multimodal model: a prompt with the image starts a pruned prefill (plans it); a
        decode step on the pruned prefill's cache keeps its 2-D mask; anything else runs stock."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.overrides, self.origin = {}, None
        fresh = (input_ids is not None and has_pixels(kwargs)
                 and bool((input_ids == self.image_token).any()))  # a prompt with the image (not a generated <image>)
        self.prefill_started = time.perf_counter() if fresh else 0.0  # timed whether it prunes or not
        if self.config.method == "none" and not self.trace:
            self.mode = None
        elif fresh:
            cache = kwargs.get("cache")
            if cache is not None and not isinstance(cache, DynamicCache):
                raise ValueError(
                    f"HAP prunes into a dynamic KV cache (each layer its own length); {type(cache).__name__} "
                    "(e.g. cache_implementation='static') is not supported: use the default cache"
                )
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("HAP prunes a fresh prefill: an image cannot be added to an existing KV cache")
            visual, image = self.token_masks(input_ids, kwargs)
            self.state = PruneState.start(
                self.config, visual, kwargs.get("attention_mask"), self.shape, self.trace,
                self.priority, self.tail, self.lead, image_mask=image, grids=self.grids(input_ids, kwargs),
            )
            self.state.vision, self.vision_cues = self.vision_cues, None
            self.state.question = self.question
            self.mode, self.prompt = "prefill", kwargs
        elif self.cache is not None and kwargs.get("cache") is self.cache and self.state.schedule is not None:
            self.mode = "decode"
            self.step_mask = kwargs.get("attention_mask")
            if kwargs.get("position_ids") is None:  # a hand-written loop: the stock model would count positions
                new = (input_ids if input_ids is not None else kwargs["inputs_embeds"]).shape[1]  # on the pruned cache
                positions = self.state.decode_positions(self.cache.get_seq_length(0), new)
                kwargs["position_ids"] = self.decode_positions(module, positions)
            self.step_positions = kwargs["position_ids"]
        else:
            self.mode = None
        return args, kwargs

    def grids(self, input_ids: torch.Tensor, kwargs: dict) -> tuple[tuple[int, int], ...]:
        """The view grids of the prompt (`ViewGrids`) where the pruner reads them (`Pruner.views`), else ().
        ValueError where the samples of a batch differ in them."""
        if self.view_grids is None or not pruner_for(self.config).views:
            return ()
        grids = self.view_grids(input_ids, kwargs)
        if any(g != grids[0] for g in grids):
            raise ValueError(f"method={self.config.method!r} pools each view's token grid: every sample of a batch "
                             f"needs the same view grids; got {grids}")
        return grids[0]

    def ask(self, question: str | None) -> None:
        """The raw question of the prompts to come, as the pruner's cue (`Pruner.embed_question`) where it reads one."""
        if self.clip is not None and question is not None:
            self.question = pruner_for(self.config).embed_question(self.clip, question)

    def layer_pre_hook(self, index: int, layer, args, kwargs):
        """Before decoder layer `index`: the prefill or decode step, with the earlier cuts' overrides."""
        if self.mode is None:
            return None
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs.update(self.overrides.get(self.kinds.types[index], {}))
        if self.mode == "prefill":
            hidden = self.layer_prefill(index, layer, hidden, kwargs)
        else:
            self.layer_decode(index, hidden, kwargs)
        return (hidden, *args[1:]), kwargs

    def layer_prefill(self, index: int, layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Prefill at layer `index`: a lookahead capture, the cut entering the layer, the layer's own capture
        (deferred to `layer_done` when the layer writes its keys to the cache). Returns the hidden states."""
        st = self.state
        self.cache = kwargs.get("cache")
        if index == 0 and st.pruner.reads_input:  # the decoder's input embeddings (SparseVLM's raters)
            st.pruner.on_input(st, hidden)
        if index in st.lookahead_layers:  # the layer has not run: project; pre-RoPE for first_cut="prerope" (§10)
            t0 = time.perf_counter()
            _lookahead(st, layer, index, hidden, kwargs, rope=st.pruner.first_cut != "prerope",
                       window=self.shape.window(index))
            st.scoring_seconds += time.perf_counter() - t0
        if st.pruner.layer_states and st.cut_index(index + 1) is not None:  # the next cut reads this layer's keys
            self.keys_pending = (index, hidden)
        if st.cut_index(index) is not None:
            length = hidden.shape[1]
            states = None
            if st.pruner.layer_states:
                states, self.layer_keys = (self.layer_keys, self.final_norm(hidden)), None
            hidden, keep = _cut(st, index, hidden, kwargs, states)
            self.origin = _origin(self.origin, keep, length)
            key_valid = st.key_valid()
            self.kind_overrides(index, hidden, None if key_valid is None else key_valid.long(), kwargs)
        if index in st.capture_layers:  # queries and keys come from the layer's own run
            self.pending = (index, hidden, st.row_positions(hidden.shape[1]).to(hidden.device))
        return hidden

    def layer_decode(self, index: int, hidden: torch.Tensor, kwargs: dict) -> None:
        """Decode step at layer `index`: a layer entering a cut gets a mask sized to its group's cache and, where
        positions were renumbered, the step's positions less the prompt tokens dropped so far
        (`PruneState.decode_shift`)."""
        if self.state.cut_index(index) is None:
            return
        shift = self.state.decode_shift(index)
        if shift:
            positions = self.step_positions.to(hidden.device) - shift
            kwargs.update(position_ids=positions, position_embeddings=self.kinds.rotary(
                hidden, positions, self.kinds.types[index]))
        self.kind_overrides(index, hidden, self.state.decode_attention_mask(index, self.step_mask), kwargs,
                            shift=bool(shift))

    def kind_overrides(self, index: int, hidden: torch.Tensor, mask_2d: torch.Tensor | None, kwargs: dict,
                       shift: bool = True) -> None:
        """The kwargs of every layer from `index` on, per kind (`self.overrides`), after a cut or a decode step's
        entry into a group: each kind's mask over the padding mask `mask_2d` [B, kv] (plus the group's merge bias);
        where the positions changed (`shift`: a cut, or a renumbered decode step) the positions in `kwargs` (layer
        `index`'s) and each kind's (cos, sin) of them. Layer `index`'s own `kwargs` are updated in place."""
        bias = self.state.key_bias.get(index)
        own = self.kinds.types[index]
        self.overrides = {}
        for kind in dict.fromkeys(self.kinds.types[index:]):
            mask = self.kinds.mask(kind, hidden, None if mask_2d is None else mask_2d.to(hidden.device),
                                   kwargs.get("cache"), self.kinds.first(kind, index), bias is None)
            out = {"attention_mask": mask if bias is None else add_key_bias(mask, bias, hidden.dtype)}
            if shift:
                out["position_embeddings"] = kwargs["position_embeddings"] if kind == own else self.kinds.rotary(
                    hidden, kwargs["position_ids"], kind)
                if kwargs.get("position_ids") is not None:
                    out["position_ids"] = kwargs["position_ids"]
            self.overrides[kind] = out
        kwargs.update(self.overrides[own])

    def row_rotary(self, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the prompt rows `rows` [B, P], gathered once for the layers sharing one rotary embedding."""
        if self.rotary[0] is not cos:
            self.rotary = (cos, (_take(cos, rows), _take(sin, rows)))
        return self.rotary[1]

    @torch.no_grad()
    def query_done(self, index: int, module, args, output: torch.Tensor) -> None:
        """After the q projection of decoder layer `index`: keep the prompt rows of a pending capture."""
        if self.pending is not None and self.pending[0] == index:
            t0 = time.perf_counter()
            self.pending_q = _take(output, self.pending[2])
            self.state.scoring_seconds += time.perf_counter() - t0

    @torch.no_grad()
    def layer_done(self, index: int, layer, args, kwargs, output) -> None:
        """After decoder layer `index`: the keys a next cut reads (`layer_keys`); the pending capture, with the rows'
        queries of its q projection (RoPE applied here) and the keys it cached (recomputed without a cache)."""
        if self.keys_pending is not None and self.keys_pending[0] == index:
            k = _layer_keys(layer, kwargs, index, self.keys_pending[1])  # [B, kv_heads, T, head_dim]
            self.layer_keys, self.keys_pending = k.transpose(1, 2).flatten(2), None
        if self.pending is None:
            return
        t0 = time.perf_counter()
        (_, hidden, rows), q, self.pending, self.pending_q = self.pending, self.pending_q, None, None
        attn = layer.self_attn
        cos, sin = kwargs["position_embeddings"]
        q = _heads(attn, q, "q_norm", self.row_rotary(cos, sin, rows))
        k = _layer_keys(layer, kwargs, index, hidden)
        _record(self.state, layer, index, q, k, hidden, rows, window=self.shape.window(index))
        self.state.scoring_seconds += time.perf_counter() - t0

    def decoder_done(self, module, args, kwargs, output) -> None:
        """After the decoder: the prefill's wall time (a stock prefill's too: method="none")."""
        if self.prefill_started:
            self.prefill_seconds = time.perf_counter() - self.prefill_started


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, decode_positions: Positions = None, lead: int = 0,
                token_masks: TokenMasks = None, kinds: LayerKinds | None = None, view_grids: ViewGrids = None) -> Patch:
    """Patch `model` in place so that its forward and `generate` prune as `config` says. `priority`
    [batch, visual], `tail` (needed by rows="question") and `lead`: see `PruneState.start`. `decode_positions` (the
    multimodal model, long [1, new] text positions) -> the `position_ids` its decoder takes, for decode steps
    given none (default: as they are). `token_masks`: which tokens are visual and where the image ends
    (`TokenMasks`; default: the image token's ids). `kinds`: the layers' attention kinds where they differ
    (`LayerKinds`; default: one). `view_grids`: each view's grid of visual tokens (`ViewGrids`; default: none)."""
    check_decoder(model, kinds)
    if tail is None and pruner_for(config).rows == "question":
        raise ValueError("rows='question' needs the chat template's tail after the question: "
                         "hap.patched(model, config, tail=hap.runs.run.template_tail(processor))")
    attention = getattr(decoder_of(model).config, "_attn_implementation", None) or ""
    if pruner_for(config).merge == "proportional" and "flash" in attention:
        raise ValueError(f"merge='proportional' adds a bias to the attention mask, which {attention} does not take: "
                         "load the model with attn_implementation='sdpa' or 'eager', or use merge='none'")
    if hasattr(model, "_hap"):
        remove_patch(model)
    patch = Patch(model, config, trace, decode_positions, priority, tail or 0, lead, token_masks, kinds, view_grids)
    patch.attach(model)
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


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-sample positions along dim 1: `x [batch|1, T, ...]`, `index` long [batch, n] -> `[batch, n, ...]`."""
    B = index.shape[0]
    x = x.expand(B, *x.shape[1:])
    index = index.to(x.device).view(B, -1, *([1] * (x.dim() - 2)))
    return x.gather(1, index.expand(-1, -1, *x.shape[2:]))


def _heads(attn, projected: torch.Tensor, norm: str, rotary: tuple | None) -> torch.Tensor:
    """A q or k projection `[batch, n, heads * head_dim]` -> `[batch, heads, n, head_dim]`, with the module's
    per-head norm (`norm`: "q_norm" / "k_norm", where it has one) and the rotary embedding `rotary` = (cos, sin)
    of the n positions (None: pre-RoPE)."""
    B, n, _ = projected.shape
    x = projected.view(B, n, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, norm):
        x = getattr(attn, norm)(x)
    return x if rotary is None else _rope(attn)(x, x, *rotary)[0]


@torch.no_grad()
def _lookahead(st: PruneState, layer, index: int, hidden: torch.Tensor, kwargs: dict, rope: bool,
               window: int | None = None) -> None:
    """Capture layer `index` before it runs (to score the cut entering it): its norm once, the q projection of the
    prompt rows, the k projection of every token, post-RoPE unless `rope` is False (`window`: its sliding window)."""
    attn = layer.self_attn
    rows = st.row_positions(hidden.shape[1]).to(hidden.device)
    x = layer.input_layernorm(hidden)
    cos, sin = kwargs["position_embeddings"]
    q = _heads(attn, attn.q_proj(_take(x, rows)), "q_norm", (_take(cos, rows), _take(sin, rows)) if rope else None)
    k = _heads(attn, attn.k_proj(x), "k_norm", (cos, sin) if rope else None)
    _record(st, layer, index, q, k, hidden, rows, lookahead=True, window=window)


def _layer_keys(layer, kwargs: dict, index: int, hidden: torch.Tensor) -> torch.Tensor:
    """Layer `index`'s keys [B, kv_heads, T, head_dim] (after k_proj, key norm and RoPE) over its input `hidden`
    [B, T, D]: those it cached, recomputed where it has no cache or a sliding-window cache kept only the last ones."""
    k = _cached_keys(kwargs.get("cache"), index)
    if k is None or k.shape[2] != hidden.shape[1]:
        attn = layer.self_attn
        k = _heads(attn, attn.k_proj(layer.input_layernorm(hidden)), "k_norm", kwargs["position_embeddings"])
    return k


def _cached_keys(cache, index: int, what: str = "keys") -> torch.Tensor | None:
    """The keys (`what="values"`: the values) layer `index` just wrote to a dynamic cache, else None."""
    layers = getattr(cache, "layers", None)
    return getattr(layers[index], what, None) if layers is not None and index < len(layers) else None


@torch.no_grad()
def _record(st: PruneState, layer, index: int, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor,
            rows: torch.Tensor, lookahead: bool = False, window: int | None = None) -> None:
    """The prompt rows' attention (queries `q` of the rows at positions `rows` [B, P], keys `k`; `window`: the
    layer's sliding window) to the pruner, and their logits where it reads them (`Pruner.logits`)."""
    key_valid = st.key_valid()
    key_valid = None if key_valid is None else key_valid.to(q.device)
    bias = st.bias_at(index)
    bias = None if bias is None else bias.to(q.device)
    logits = prompt_logits(q, k, rows.to(q.device), key_valid, layer.self_attn.scaling, bias, window)
    attn = captured_rows(layer, prompt_attention(logits), st.visual_pos, st.kept_orig)  # as a plug-in changed them
    st.record(index, attn, hidden, lookahead, logits if st.pruner.logits else None)  # (the head lab)


def _origin(origin: torch.Tensor | None, keep: torch.Tensor, length: int) -> torch.Tensor:
    """The prompt positions long [B, T'] of the tokens a cut kept: `keep` [B, T'] indexes the `length` tokens before
    it, whose positions are `origin` [B, length] (None: 0..length-1), then its recycled tokens (position -1)."""
    B = keep.shape[0]
    if origin is None:
        origin = torch.arange(length, device=keep.device).expand(B, length)
    recycled = max(int(keep.max()) + 1 - length, 0)
    origin = torch.cat([origin.to(keep.device), origin.new_full((B, recycled), -1, device=keep.device)], 1)
    return origin.gather(1, keep)


@torch.no_grad()
def _cut(st: PruneState, index: int, hidden: torch.Tensor, kwargs: dict,
         states: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the cut entering layer `index` to the hidden states and the layer's positions and (cos, sin) in
    `kwargs` (in place; the masks are the caller's); `states`: the previous layer's keys and final-normed output, for a
    pruner that reads them (`PruneState.cut`). Returns the hidden states and `keep` long [B, T']: the kept tokens as
    indices into the ones before the cut, then its recycled ones."""
    needs = st.sizes is not None or st.recycled is not None or st.pruner.embeds
    whole = None if st.whole_pos is None else _take(hidden, st.whole_pos)  # LLaVA-NeXT's newlines, for DivPrune
    keep = st.cut(index, _take(hidden, st.visual_pos) if needs else None, *(states or (None, None)), whole)  # [B, T']
    if st.appended is not None:  # SparseVLM's / AutoPrune's recycled tokens: indices T.. in `keep`
        hidden, st.appended = torch.cat([hidden, st.appended.to(hidden)], 1), None
    hidden = _take(hidden, keep)
    if st.merged is not None:  # VisionZip's block, or the kept tokens a merge folded the dropped ones into
        positions, merged = st.merged
        where = positions.to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1])
        hidden = hidden.scatter(1, where, merged.to(hidden))
        st.merged = None
    at = keep
    if st.pruner.renumber:  # the official PyramidDrop / VisionZip: positions 0..T'-1 (the first T' of 0..T-1)
        at = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    cos, sin = kwargs["position_embeddings"]
    kwargs["position_embeddings"] = (_take(cos, at), _take(sin, at))
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = _take(kwargs["position_ids"], at)
    return hidden, keep


def _mask(text_config, hidden: torch.Tensor, mask_2d: torch.Tensor | None, cache, index: int,
          causal_skip: bool) -> torch.Tensor | None:
    """The stock causal mask of layer `index` (sliding-window where every layer slides one, as Mistral builds it) over
    the padding mask `mask_2d` [batch, kv], sized to its `cache`; `causal_skip`: may be None where plain causal."""
    build = create_causal_mask if sliding_window(text_config) is None else create_sliding_window_causal_mask
    return build(config=text_config, inputs_embeds=hidden, attention_mask=mask_2d, cache=cache, position_ids=None,
                 layer_idx=index, allow_is_causal_skip=causal_skip)
