"""Adapter for `LlavaForConditionalGeneration` (LLaVA-1.5 with a Llama decoder, LLaVA-interleave
with a Qwen2 decoder and grouped-query attention).

The visual tokens are the `image_token_id` placeholders the processor expands (576 for CLIP-L/336
with CLS dropped, 729 for SigLIP-384 with strategy "full"), a square grid in row-major order.
"""

from __future__ import annotations

import math

from .decoder import apply_patch, remove_patch

__all__ = ["apply_patch", "remove_patch", "visual_grid"]


def visual_grid(model, inputs, num_visual: int) -> tuple[int, int]:
    """(rows, cols) of the visual tokens over the image: the square patch grid."""
    side = math.isqrt(num_visual)
    return (side, side) if side * side == num_visual else (1, num_visual)
