"""Adapter for `LlavaForConditionalGeneration` (LLaVA-1.5 with a Llama decoder, LLaVA-interleave
with a Qwen2 decoder and grouped-query attention).

The visual tokens are the `image_token_id` placeholders the processor expands (576 for CLIP-L/336
with CLS dropped, 729 for SigLIP-384 with strategy "full"), a square grid in row-major order.
For `visionzip`, `autoprune`, `vispruner`, `cdpruner` (and HAP's first_cut="vision") the adapter also captures the [CLS]
row of the vision tower's feature layer's attention, that layer's keys and its output features, which VisionZip
merges and projects itself (a CLIP tower; SigLIP has no [CLS] token); for `cdpruner`, CLIP's projection of those
patches (the `clip_model` knob's checkpoint). A pruner that reads other tower layers (`Pruner.tower`: their [CLS] row
or full attention map, their output) gets them with those cues (`capture_tower`): each recomputed once per image from
the layer's own q and k while the tower runs SDPA, no eager attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache, partial

import numpy as np
import torch
from transformers.image_transforms import get_resize_output_image_size
from transformers.image_utils import ChannelDimension

from ..config import HAPConfig
from ..hub import ModelLoadError, load_clip as clip_loader
from ..knobs import knob
from ..layout import WHOLE, Box, Layout, seen_share
from ..pruners import cls_user, pruner_for
from ..pruners.cues import TowerLayer, TowerRead, VisionCues
from . import decoder
from .decoder import attention_outputs, decoder_of, remove_patch

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "input_box", "layout", "remove_patch", "visual_grid"]


def visual_grid(model, inputs, num_visual: int) -> tuple[int, int]:
    """(rows, cols) of the visual tokens over the image: the square patch grid."""
    side = math.isqrt(num_visual)
    return (side, side) if side * side == num_visual else (1, num_visual)


def layout(model, inputs, image_size: tuple[int, int] | None = None, processor=None) -> Layout:
    """The first sample's tokens on its image of `image_size` = (width, height): the square patch grid over the part
    of the image the tower's input shows (`input_box`: a CLIP processor's centre crop leaves a non-square image's two
    end strips unseen), each cell the pixels its patch sees: where the patch does not divide the input (SigLIP-384
    with 14-px patches: 27 patches see 378 px) the last pixels lie in no cell. Without the `processor` the input is
    taken for the whole image squashed."""
    rows, cols = visual_grid(model, inputs, int((inputs["input_ids"][0] == model.config.image_token_id).sum()))
    vision = model.config.vision_config
    square = rows == cols == vision.image_size // vision.patch_size
    box = WHOLE if processor is None or image_size is None else input_box(processor.image_processor, image_size)
    return Layout.grid(rows, cols, image_size, box, "image" if box == WHOLE else "centre crop",
                       seen_share(vision.image_size, vision.patch_size) if square else 1.0)


def input_box(image_processor, image_size: tuple[int, int]) -> Box:
    """The rectangle (x0, y0, x1, y1), fractions of an image of `image_size` = (width, height) pixels, that the tower's
    input shows after `image_processor` (the settings it runs with): resized (`size`: the shortest edge by
    transformers' `get_resize_output_image_size`, as the processors' `resize`, or height x width), then, with
    `do_center_crop`, cut to `crop_size` at the offset floor((resized - crop) / 2) on each axis, as the processors'
    `center_crop`. A resize scales the image, so the box is the crop's share of the resized image."""
    if getattr(image_processor, "do_pad", False):
        raise ValueError(f"{type(image_processor).__name__} with do_pad=True (a pad to a square first) is not a "
                         "geometry the layout knows: set do_pad=False")
    width, height = image_size
    new_h, new_w = height, width
    if image_processor.do_resize:
        size = dict(image_processor.size)
        if set(size) == {"shortest_edge"}:
            new_h, new_w = get_resize_output_image_size(np.broadcast_to(np.uint8(0), (1, height, width)),
                                                        size["shortest_edge"], default_to_square=False,
                                                        input_data_format=ChannelDimension.FIRST)
        elif set(size) == {"height", "width"}:
            new_h, new_w = size["height"], size["width"]
        else:
            raise ValueError(f"{type(image_processor).__name__}'s size {size} is not one the layout knows: give "
                             "shortest_edge alone, or height and width")
    if not image_processor.do_center_crop:
        return WHOLE
    crop = dict(image_processor.crop_size)
    crop_h, crop_w = crop["height"], crop["width"]
    top, left = (new_h - crop_h) // 2, (new_w - crop_w) // 2
    return left / new_w, top / new_h, (left + crop_w) / new_w, (top + crop_h) / new_h


def cls_layer(model, config: HAPConfig) -> torch.nn.Module:
    """The vision-tower layer whose output is the feature layer LLaVA projects, for the [CLS] cues of `config`'s
    method; ValueError when the tower has no [CLS] token (SigLIP), the features keep it ("full" strategy) or are not
    one layer's output."""
    tower = model.model.vision_tower
    if not hasattr(getattr(tower, "embeddings", None), "class_embedding"):
        raise ValueError(f"{cls_user(config)} needs a [CLS] token: the vision tower of {type(model).__name__}, "
                         f"{type(tower).__name__}, has no [CLS] token")
    feature = model.config.vision_feature_layer
    if model.config.vision_feature_select_strategy != "default" or not isinstance(feature, int):
        strategy = model.config.vision_feature_select_strategy
        raise ValueError(f"{cls_user(config)}: the [CLS] cues need LLaVA's 'default' feature strategy ([CLS] dropped) "
                         f"and one feature layer; {type(model).__name__} has {strategy!r} and {feature!r}")
    layers = tower.encoder.layers
    index = feature % (len(layers) + 1) - 1  # hidden_states[j] is the output of layer j - 1
    if index < 0:
        raise ValueError(f"{cls_user(config)}: the [CLS] cues need the features of a vision-tower layer; "
                         f"{type(model).__name__}'s feature layer {feature} is the tower's embeddings")
    return layers[index]


def clip_projection(model, config: HAPConfig, device) -> tuple:
    """((CLIPModel, tokenizer) of `config.clip_model`, the map of the tower's feature-layer patches [B, N, Dv] to
    CLIP image embeddings [B, N, E]: the tower's own post-layernorm, then CLIP's visual projection),
    for a pruner that reads CLIP (`Pruner.clip`: CDPruner);
    ValueError naming clip_model when the default does not pair with the tower (checked before loading), when it
    cannot be loaded or when its vision width is not the tower's."""
    own = model.config.vision_config
    if config.clip_model == knob("clip_model").default and (own.hidden_size, own.image_size, own.patch_size) != (
            1024, 336, 14):
        raise ValueError(f"method={config.method!r}: the default clip_model={config.clip_model!r} pairs with CLIP-L/336 "
                         f"towers; {type(model).__name__}'s tower is {own.hidden_size} wide at {own.image_size} px in "
                         f"{own.patch_size} px patches: give clip_model the CLIP checkpoint the tower came from")
    try:
        clip = load_clip(config.clip_model, device)
    except ModelLoadError as err:
        raise ValueError(f"method={config.method!r} cannot load its CLIP: {err}") from err
    tower = model.model.vision_tower
    width, own = clip[0].config.vision_config.hidden_size, own.hidden_size
    if width != own:
        raise ValueError(f"clip_model={config.clip_model!r} has a vision width of {width}, the vision tower {own}: "
                         "give the CLIP checkpoint the tower came from")
    return clip, lambda patches: clip[0].visual_projection(tower.post_layernorm(patches).to(clip[0].dtype))


@lru_cache(maxsize=2)
def load_clip(name: str, device: str):
    """`hap.hub.load_clip`, once per checkpoint and device."""
    return clip_loader(name, device)


FEATURE = object()  # the key of the feature layer's cues among a tower forward's pending captures


def read_layers(model, config: HAPConfig) -> list[tuple[TowerRead, torch.nn.Module]]:
    """Each `Pruner.tower` read of `config`'s pruner with the vision-tower layer it reads; ValueError naming the
    method and the model class where the tower has no such layer (checked before any work)."""
    reads = pruner_for(config).tower
    if not reads:
        return []
    layers = model.model.vision_tower.encoder.layers
    feature = list(layers).index(cls_layer(model, config))
    try:
        return [(read, layers[read.index(len(layers), feature)]) for read in reads]
    except ValueError as err:
        raise ValueError(f"method={config.method!r} on {type(model).__name__}: {err}") from err


def capture_tower(model, config: HAPConfig, clip_embed, deliver: Callable[[VisionCues], None]) -> list:
    """Register the hooks that capture what `config`'s pruner reads of the vision tower, once per tower forward: the
    feature layer's [CLS] cues (`cls_layer`, `cls_cues`) and each of its `Pruner.tower` reads (`tower_layer`), handed
    together to `deliver` once the tower has run (`VisionCues.layers`). Returns the hooks' handles."""
    tower, pending = model.model.vision_tower, {}
    project = model.model.multi_modal_projector
    reads = read_layers(model, config)

    @torch.no_grad()
    def on_feature(layer, args, kwargs, output):
        pending[FEATURE] = cls_cues(project, clip_embed, layer, args, kwargs, output)

    @torch.no_grad()
    def on_read(read: TowerRead, layer, args, kwargs, output):
        pending[read.layer] = tower_layer(read, layer, args, kwargs, output)

    def on_tower(module, args, kwargs, output):
        cues = pending.pop(FEATURE, None)
        if cues is not None:
            deliver(replace(cues, layers={read.layer: pending.pop(read.layer) for read, _ in reads}))
        pending.clear()

    handles = [cls_layer(model, config).register_forward_hook(on_feature, with_kwargs=True)]
    for read, layer in reads:
        handles.append(layer.register_forward_hook(partial(on_read, read), with_kwargs=True))
    handles.append(tower.register_forward_hook(on_tower, with_kwargs=True))
    return handles


def attention_probs(layer, hidden: torch.Tensor, rows: int | None) -> torch.Tensor:
    """A CLIP encoder layer's attention probabilities recomputed from its input `hidden` [B, T, Dv] (layer_norm1, the
    q and k projections, the layer's scale; the tower itself keeps SDPA): float32 [B, H, rows, T] for the first
    `rows` query rows (1: the [CLS] row), every row for None."""
    attn = layer.self_attn
    x = layer.layer_norm1(hidden)
    B, T, _ = x.shape
    q = attn.q_proj(x if rows is None else x[:, :rows])
    q = q.view(B, q.shape[1], -1, attn.head_dim).transpose(1, 2)  # [B, H, rows, hd]
    k = attn.k_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # [B, H, T, hd]
    return (q.float() @ k.float().transpose(-1, -2) * attn.scale).softmax(-1)


def tower_layer(read: TowerRead, layer, args, kwargs, output) -> TowerLayer:
    """What `read` asks of `layer`'s forward (its hook's arguments): the [CLS] row [B, H, T] or the full map
    [B, H, T, T] of its attention (`attention_probs`) and its output [B, T, Dv]."""
    hidden = args[0] if args else kwargs["hidden_states"]
    attention = None
    if read.attention:
        attention = attention_probs(layer, hidden, 1 if read.attention == "cls" else None)
        attention = attention[:, :, 0] if read.attention == "cls" else attention
    out = output[0] if isinstance(output, tuple) else output
    return TowerLayer(attention, out if read.hidden else None)


def cls_cues(project, clip_embed, layer, args, kwargs, output) -> VisionCues:
    """The `VisionCues` of `cls_layer`'s forward (its hook's arguments) over the B images the tower ran (LLaVA-NeXT:
    the crops): the layer's [CLS] attention row recomputed from its input (`attention_probs`) [B, N] summed over
    heads, keys [B, N, head_dim] averaged over heads, patches only; the layer's output features [B, 1 + N, Dv];
    `project`, the model's projector; the patches' CLIP image embeddings by `clip_embed` where it is given, for
    CDPruner."""
    hidden = args[0] if args else kwargs["hidden_states"]
    attn = layer.self_attn
    row = attention_probs(layer, hidden, 1)[:, :, 0]  # [B, H, T]
    B, T, _ = hidden.shape
    k = attn.k_proj(layer.layer_norm1(hidden)).view(B, T, -1, attn.head_dim).transpose(1, 2)  # [B, H, T, hd]
    features = output[0] if isinstance(output, tuple) else output
    return VisionCues(row[:, :, 1:].sum(1), k[:, :, 1:].float().mean(1), features, project, row.shape[1],
                      None if clip_embed is None else clip_embed(features[:, 1:]))


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`decoder.apply_patch`, plus the tower capture for the methods that read it (`visionzip`, `autoprune`,
    `vispruner`, `cdpruner` with CLIP's projection of the patches; any `Pruner.tower` reads, `capture_tower`)."""
    pruner = pruner_for(config)
    layer = cls_layer(model, config) if pruner.needs_cls else None
    read_layers(model, config)  # refused before any work where the tower lacks a layer the pruner reads
    clip, clip_embed = (None, None)
    if pruner.clip:
        clip, clip_embed = clip_projection(model, config, str(next(model.parameters()).device))
    patch = decoder.apply_patch(model, config, trace, priority, tail, lead=lead)
    patch.clip = clip
    if layer is not None:
        def deliver(cues: VisionCues) -> None:  # to the running prefill, or the next one (`generate` encodes first)
            if patch.mode == "prefill":
                patch.state.vision = cues
            else:
                patch.vision_cues = cues

        patch.handles.extend(capture_tower(model, config, clip_embed, deliver))
    return patch
