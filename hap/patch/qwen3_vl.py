"""Adapter for `Qwen3VLForConditionalGeneration` (docs/method.md, "Qwen3-VL").

Tokens: `<|vision_start|>` + (h/2) x (w/2) `<|image_pad|>` + `<|vision_end|>` per image, h x w its 16-px patches after
`smart_resize`, row-major over the merged 32-px grid: one view uniform over the image (`visual_grid`, as Qwen2-VL).

Positions: interleaved M-RoPE. The text model folds the (T, H, W) ids into one (cos, sin) per token, which the shared
machinery gathers for the kept tokens, so each keeps its own 3-D rotation. `generate` passes 4 rows of ids (the text
row, then T / H / W); a decode step given none gets the same 4 rows from `rope_deltas` (`mrope_positions`).

DeepStack: after decoder layers 0 .. d-1 the text model adds the vision tower's intermediate features to the hidden
states at the visual positions (`_deepstack_process`, on its own local `visual_pos_masks` [B, T]). After a cut the
hidden states are shorter; this adapter overrides that method on the instance so that the features follow the kept
tokens: the kept positions' mask (`Patch.origin`) and the embed rows of exactly those tokens. A dropped token's later
DeepStack features are dropped with it.

Refused (as on Qwen2-VL): the [CLS] cues (visionzip, autoprune, first_cut="vision": the tower has no [CLS] token) and
the methods that renumber positions 0..T'-1 (pdrop, sparsevlm): M-RoPE ids cannot be renumbered that way.
"""

from __future__ import annotations

from functools import partial

import torch

from ..config import HAPConfig
from . import decoder, qwen2_vl
from .decoder import attention_outputs, decoder_of
from .qwen2_vl import image_settings, visual_grid

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "image_settings", "remove_patch", "repeat_decoder_kwargs",
           "visual_grid"]


def mrope_positions(model, positions: torch.Tensor) -> torch.Tensor:
    """The 4 rows of `position_ids` `generate` builds for decode-step text positions (long [1, new]): the text row,
    then T / H / W = text + `rope_deltas` -> [4, batch, new]."""
    rows = qwen2_vl.mrope_positions(model, positions)  # [1, batch, new]
    return torch.cat([positions[None].expand_as(rows), rows.expand(3, -1, -1)])


def kept_deepstack(mask: torch.Tensor, embeds: torch.Tensor, origin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepStack's inputs for the kept tokens. `mask` bool [B, T] the prompt's visual positions, `embeds` [n, D] one
    row per True of `mask` (row-major over the batch), `origin` long [B', T'] each kept token's prompt position (-1:
    none, a recycled token; B' = B, or the variants of a batch-1 prompt, `hap.patch.apply`'s priority rows) ->
    (bool [B', T'] the kept visual positions, [n', D] their rows in the same order)."""
    mask = mask.to(origin.device)
    rank = mask.flatten().cumsum(0).view(mask.shape) - 1  # the embed row of each visual position
    mask, rank = (x.expand(origin.shape[0], -1) for x in (mask, rank))
    at = origin.clamp(min=0)
    kept = mask.gather(1, at) & (origin >= 0)
    return kept, embeds[rank.gather(1, at)[kept].to(embeds.device)]


def deepstack_process(model, hidden: torch.Tensor, mask: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """The text model's `_deepstack_process` (hidden [B, T', D], `mask` [B, T], `embeds` [n, D]) on the tokens a cut
    of the running prefill kept; stock where nothing was cut."""
    text_model = decoder_of(model)
    patch = getattr(model, "_hap", None)
    if patch is not None and patch.mode == "prefill" and patch.origin is not None:
        mask, embeds = kept_deepstack(mask, embeds, patch.origin)
    return type(text_model)._deepstack_process(text_model, hidden, mask, embeds)


def repeat_decoder_kwargs(kwargs: dict, batch: int) -> None:
    """DeepStack's inputs of a batch-1 decoder input repeated `batch` times (`hap.causal`), in place:
    `visual_pos_masks` [1, T] -> [batch, T], each layer's features [n, D] -> [batch * n, D]."""
    if kwargs.get("visual_pos_masks") is not None:
        kwargs["visual_pos_masks"] = kwargs["visual_pos_masks"].expand(batch, -1)
        kwargs["deepstack_visual_embeds"] = [e.repeat(batch, 1) for e in kwargs["deepstack_visual_embeds"]]


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`qwen2_vl.apply_patch`'s refusals and M-RoPE decode positions (4 rows), plus DeepStack on the kept tokens."""
    qwen2_vl.refuse(model, config)
    patch = decoder.apply_patch(model, config, trace, priority, tail, decode_positions=mrope_positions, lead=lead)
    decoder_of(model)._deepstack_process = partial(deepstack_process, model)
    return patch


def remove_patch(model) -> None:
    """`decoder.remove_patch` and the DeepStack override."""
    decoder.remove_patch(model)
    decoder_of(model).__dict__.pop("_deepstack_process", None)
