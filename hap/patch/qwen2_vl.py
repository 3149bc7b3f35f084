"""Adapter for `Qwen2VLForConditionalGeneration` and `Qwen2_5_VLForConditionalGeneration`.

Dynamic resolution: an image of H x W pixels gives (H/28) x (W/28) visual tokens after the 2x2
patch merge, so N varies with the image (a batch needs equal N per sample: equal budgets).
Positions are M-RoPE: 3-D (temporal, height, width) position ids, folded by the decoder's rotary
embedding into one (cos, sin) per token before the layers run. The shared machinery gathers that
(cos, sin) for the kept tokens, so every kept token keeps its original 3-D rotation; decoding
takes its positions from `generate` (text positions + `rope_deltas`, computed once from the full
prompt), which pruning does not change; a decode step given no positions gets the same.
"""

from __future__ import annotations

import torch

from ..config import HAPConfig
from ..pruners import cls_user, pruner_for
from . import decoder
from .decoder import attention_outputs, decoder_of, remove_patch
from .processors import current

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "image_settings", "remove_patch", "visual_grid"]


def visual_grid(model, inputs, num_visual: int) -> tuple[int, int]:
    """(rows, cols) of the merged visual tokens from the first image's `image_grid_thw`."""
    merge = model.config.vision_config.spatial_merge_size
    t, h, w = (int(v) for v in inputs["image_grid_thw"][0])
    rows, cols = h // merge, w // merge
    return (rows, cols) if t * rows * cols == num_visual else (1, num_visual)


def image_settings(processor) -> tuple[int, int, int, int]:
    """(patch, merge, min_pixels, max_pixels) the processor resizes an image with now (the processor options in
    effect included, `hap.patch.processors.processor_options`): what `hap.pruners.downsample.resized_size` reads."""
    size = current(processor, "size")
    return (current(processor, "patch_size"), current(processor, "merge_size"), size["shortest_edge"],
            size["longest_edge"])


def mrope_positions(model, positions: torch.Tensor) -> torch.Tensor:
    """M-RoPE `position_ids` of decode-step text positions (long [1, new]) as `generate` builds them: the text
    positions plus the prompt's `rope_deltas` [batch, 1] -> [1, batch, new]."""
    return positions[None] + model.rope_deltas.to(positions.device)


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`decoder.apply_patch` with M-RoPE positions for decode steps given none, after `refuse`."""
    refuse(model, config)
    return decoder.apply_patch(model, config, trace, priority, tail, decode_positions=mrope_positions, lead=lead)


def refuse(model, config: HAPConfig) -> None:
    """ValueError, naming the model class, for what M-RoPE models without a [CLS] token do not take: the [CLS] cues
    (visionzip, autoprune, first_cut="vision") and the methods that renumber positions."""
    if pruner_for(config).needs_cls:
        raise ValueError(f"{cls_user(config)} needs a [CLS] token: the {type(model).__name__} vision "
                         "tower has no [CLS] token")
    if pruner_for(config).renumber:
        raise ValueError(f"method={config.method!r} renumbers positions 0..T-1 after each drop, as its official LLaVA "
                         f"code does; {type(model).__name__}'s M-RoPE positions cannot be renumbered that way: "
                         "use it on a LLaVA model")
