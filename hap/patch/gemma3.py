"""Adapter for `Gemma3ForConditionalGeneration` (docs/method.md, "Gemma 3").

Tokens: the processor writes `<start_of_image>` + 256 soft tokens + `<end_of_image>` per image. The visual tokens are
`config.image_token_id`, the soft token (the processor's `image_token_id` is `<start_of_image>`). The image is
squashed to 896 x 896 px and its 64 x 64 SigLIP patches are average-pooled 4 x 4: token k is cell (k // 16, k % 16),
one view uniform over the image. With pan-and-scan (`do_pan_and_scan=True`, for images far from square) the processor
also cuts the image along its longer side into k crops of equal length (the last one shorter) and writes one more
block of 256 tokens for each, after the whole image's: `layout` draws the whole image as one view and each crop as its
own view over its strip of the image, and the pruner ranks the tokens of every block together.

Decoder: 5 sliding-window layers to 1 full-attention layer, each kind with its own rotary table (local theta 1e4,
global 1e6) and its own mask, and image tokens attending bidirectionally within their image (`token_type_ids` ->
block ids). The shared machinery (`decoder.LayerKinds`) hands every layer after a cut the (cos, sin) and mask of its
own kind; the masks are rebuilt here as `create_masks_for_vision_model` builds them, over the kept tokens' block ids
(full: causal OR same block; sliding: window AND (causal OR same block)), each sized to the first layer of its kind
from the cut on. Decode steps carry no block ids (as in `generate`). The window counts cache slots, so after a drop
it reaches further back in the original prompt (only prompts longer than the window, 1024 on the real models, see
the difference).

Refused: the [CLS] cues (visionzip, autoprune, first_cut="vision"): the SigLIP tower has no [CLS] token.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
from transformers.masking_utils import (
    blockwise_overlay,
    create_causal_mask,
    create_sliding_window_causal_mask,
    sliding_window_overlay,
)
from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

from ..config import HAPConfig
from ..layout import WHOLE, Layout, seen_share
from ..pruners import cls_user, pruner_for
from . import decoder
from .decoder import attention_outputs, decoder_of, remove_patch

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "layout", "remove_patch", "token_masks"]


def layout(model, inputs, image_size: tuple[int, int] | None = None, processor=None) -> Layout:
    """The visual tokens of the first prompt on its image of `image_size` = (width, height): a square of
    `mm_tokens_per_image` tokens over the whole image, then one over each pan-and-scan crop (`crop_boxes`), each
    token's cell the patches it pools (the tower's input seen as far as whole pooled cells reach)."""
    per = model.config.mm_tokens_per_image
    side = math.isqrt(per)
    count = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    crops = crop_boxes(count // per - 1, image_size)
    vision = model.config.vision_config
    seen = seen_share(vision.image_size, vision.image_size // vision.patch_size // side * vision.patch_size)
    views = [Layout.grid(side, side, box=box, name=name, seen=seen).views[0]
             for name, box in [("image" if not crops else "whole image", WHOLE),
                               *((f"crop {i + 1}", box) for i, box in enumerate(crops))]]
    return Layout(count, tuple(replace(v, tokens=tuple(range(per * i, per * (i + 1)))) for i, v in enumerate(views)),
                  image_size)


def crop_boxes(crops: int, image_size: tuple[int, int] | None) -> list[tuple[float, float, float, float]]:
    """The (x0, y0, x1, y1) boxes, fractions of the image, of the processor's `crops` pan-and-scan crops of an image of
    `image_size` = (width, height): the longer side (width where equal) cut into `crops` pieces of ceil(side /
    crops) pixels, the last one what remains."""
    if crops < 1:
        return []
    if image_size is None:
        raise ValueError("the pan-and-scan crops' boxes need the image's size")
    width, height = image_size
    length = width if width >= height else height
    step = math.ceil(length / crops)
    spans = [(i * step / length, min((i + 1) * step, length) / length) for i in range(crops)]
    return [(a, 0.0, b, 1.0) if width >= height else (0.0, a, 1.0, b) for a, b in spans]


def token_masks(model, input_ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(visual, image) bool [batch, T]: the soft image tokens, both. ValueError unless every prompt holds whole blocks
    of `mm_tokens_per_image` tokens (an image, and its pan-and-scan crops)."""
    image = input_ids == model.config.image_token_id
    per = model.config.mm_tokens_per_image
    counts = image.sum(1)
    if ((counts == 0) | (counts % per != 0)).any():
        raise ValueError(f"{type(model).__name__}: {counts.tolist()} image tokens per prompt, not whole images of "
                         f"{per} tokens each")
    return image, image


def block_ids(patch: decoder.Patch) -> torch.Tensor | None:
    """long [B', T'] the image block of each token of the running prefill (-1: text, or a recycled token), from the
    prompt's `token_type_ids` gathered at the kept positions (`Patch.origin`; B' = B, or the variants of a batch-1
    prompt, `hap.patch.apply`'s priority rows); None without them."""
    types = patch.prompt.get("token_type_ids")
    if types is None:
        return None
    ids = get_block_sequence_ids_for_mask(types)
    if patch.origin is None:
        return ids
    origin = patch.origin.to(ids.device)
    return torch.where(origin >= 0, ids.expand(origin.shape[0], -1).gather(1, origin.clamp(min=0)), -1)


def kind_mask(model, kind: str, hidden: torch.Tensor, mask_2d: torch.Tensor | None, cache, layer_idx: int,
              causal_skip: bool):
    """The mask of the layers of `kind` ("full_attention" / "sliding_attention") sized to layer `layer_idx`'s cache:
    in a prefill with image blocks as `create_masks_for_vision_model` composes it, over the kept tokens' blocks
    (a prefill is fresh, so the block ids need no padding to a cached prefix); in a decode step the plain causal /
    sliding-window mask, as `generate` builds it."""
    patch, config = model._hap, decoder_of(model).config
    common = dict(config=config, inputs_embeds=hidden, attention_mask=mask_2d, cache=cache, position_ids=None,
                  layer_idx=layer_idx, allow_is_causal_skip=causal_skip)
    blocks = block_ids(patch) if patch.mode == "prefill" else None
    if blocks is None:
        build = create_causal_mask if kind == "full_attention" else create_sliding_window_causal_mask
        return build(**common)
    blocks = blocks.to(hidden.device)
    if kind == "full_attention":
        return create_causal_mask(**common, block_sequence_ids=blocks)
    return create_causal_mask(**common, or_mask_function=blockwise_overlay(blocks),
                              and_mask_function=sliding_window_overlay(config.sliding_window))


def layer_kinds(model) -> decoder.LayerKinds:
    """Gemma 3's two layer kinds: each its own rotary table (`rotary_emb(x, positions, kind)`) and `kind_mask`."""
    lm = decoder_of(model)
    return decoder.LayerKinds(tuple(lm.config.layer_types), lambda hidden, positions, kind: lm.rotary_emb(
        hidden, positions, kind), partial(kind_mask, model))


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`decoder.apply_patch` with Gemma 3's layer kinds and image tokens, each block (the image, each pan-and-scan crop)
    a view of its own (`decoder.square_blocks`); the [CLS] cues are refused."""
    if pruner_for(config).needs_cls:
        raise ValueError(f"{cls_user(config)} needs a [CLS] token: the "
                         f"{type(model).__name__} vision tower (SigLIP) has no [CLS] token")
    if getattr(model.config.text_config, "use_bidirectional_attention", False):
        raise ValueError(f"{type(model).__name__} with use_bidirectional_attention (every token sees every other) is "
                         "not a causal decoder; HAP supports the causal Gemma 3 only")
    return decoder.apply_patch(model, config, trace, priority, tail, lead=lead,
                               token_masks=lambda ids, kwargs: token_masks(model, ids, kwargs),
                               kinds=layer_kinds(model),
                               view_grids=decoder.square_blocks(model, math.isqrt(model.config.mm_tokens_per_image)))
