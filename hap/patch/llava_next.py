"""Adapter for `LlavaNextForConditionalGeneration` (LLaVA-v1.6: Vicuna / Llama, Mistral with its sliding window) and
`LlavaOnevisionForConditionalGeneration` (SigLIP + Qwen2): any-resolution tiling.

The processor expands one `<image>` into the tokens `pack_image_features` packs (docs/method.md §15):
1. the base view, the whole image squashed to one tile, s x s tokens (s = tile / patch; CLS dropped);
2. the tile canvas: the image resized to the best pinpoint (aspect kept), pasted centred on rows x cols tiles,
   encoded per tile and stitched into one (rows s) x (cols s) grid, whose padding rows (or columns) are cut
   (`unpad_image`); OneVision then shrinks a grid of more than `anyres_max_N` tiles' worth of cells bilinearly;
3. after every row of that grid one `image_newline` token: an `<image>` id carrying a learned vector, no pixels.

Pruning policy (ours): the newline tokens are not visual tokens of the pruner; they are always kept, never scored and
not counted in the budget, which is stated over the patch tokens of this image (base view and tiles; the same pixels
appear in both, and both compete). The prompt rows start after the image's last token, the last newline.
The layout (`hap.layout`) has two views, the base view over the whole image and the tile grid over the unpadded
canvas, so the maps draw each on the uploaded image. Visual-token counts depend on the image: a batch needs equal
counts (images of one aspect class), a batch of unequal counts is refused before any work.

The decoder is the stock Llama / Mistral / Qwen2 stack (`hap.patch.decoder`); Mistral's sliding window is kept by
the rebuilt masks. Refused: the [CLS] cues (visionzip, autoprune, first_cut="vision"): the cues are one view's
[CLS] attention, and here the tokens come from several views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.image_processing_utils import select_best_resolution

from ..config import HAPConfig
from ..layout import Box, Layout, TokenView
from ..pruners import cls_user, pruner_for
from . import decoder
from .decoder import attention_outputs, decoder_of, remove_patch

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "layout", "remove_patch", "token_masks"]


@dataclass(frozen=True)
class Tiling:
    """How one image's tokens are packed: the base view's side `base` (tokens base x base), the tile grid `grid`
    (rows, cols) after unpadding (and OneVision's shrink), the grid's rectangle `box` on the image, and the
    (rows, cols) of tiles the image was cut into."""

    base: int
    grid: tuple[int, int]
    box: Box
    tiles: tuple[int, int]

    @property
    def visual(self) -> int:
        """Patch tokens: the base view and the tile grid."""
        return self.base ** 2 + self.grid[0] * self.grid[1]

    @property
    def tokens(self) -> int:
        """`<image>` ids of the image: the patch tokens and one newline per tile-grid row."""
        return self.visual + self.grid[0]

    def newlines(self) -> torch.Tensor:
        """long [rows]: the index of each newline among the image's `<image>` ids."""
        rows, cols = self.grid
        return self.base ** 2 + torch.arange(rows) * (cols + 1) + cols


def tiling(model, height: int, width: int) -> Tiling:
    """The packing of an image of `height` x `width` pixels, with the processor's and the model's arithmetic
    (`select_best_resolution`, `get_patch_output_size`, `unpad_image`, OneVision's `anyres_max_N` shrink)."""
    config = model.config
    tile, patch = config.vision_config.image_size, config.vision_config.patch_size
    side = tile // patch
    best_h, best_w = select_best_resolution((height, width), config.image_grid_pinpoints)
    tiles = (best_h // tile, best_w // tile)
    rows, cols = tiles[0] * side, tiles[1] * side
    if best_w / width < best_h / height:  # the resized image fills the canvas width
        new_w, new_h = best_w, min(math.ceil(height * best_w / width), best_h)
    else:
        new_h, new_w = best_h, min(math.ceil(width * best_h / height), best_w)
    paste_x, paste_y = (best_w - new_w) // 2, (best_h - new_h) // 2
    r0, r1, c0, c1 = 0, rows, 0, cols
    if width / height > cols / rows:
        pad = (rows - int(round(height * cols / width, 7))) // 2
        r0, r1 = pad, rows - pad
    else:
        pad = (cols - int(round(width * rows / height, 7))) // 2
        c0, c1 = pad, cols - pad
    box = ((c0 * patch - paste_x) / new_w, (r0 * patch - paste_y) / new_h,
           (c1 * patch - paste_x) / new_w, (r1 * patch - paste_y) / new_h)
    h, w = r1 - r0, c1 - c0
    aspect = getattr(config, "vision_aspect_ratio", None)  # OneVision: "anyres_max_9"
    if aspect is not None:
        ratio = math.sqrt(h * w / (int(aspect.strip("anyres_max_")) * side ** 2))
        if ratio > 1.1:
            h, w = int(h // ratio), int(w // ratio)
    return Tiling(side, (h, w), box, tiles)


def image_sizes(inputs) -> list[tuple[int, int]]:
    """(height, width) of each sample's image, from the processor's `image_sizes`."""
    return [(int(h), int(w)) for h, w in inputs["image_sizes"]]


def newlines(model, kwargs: dict) -> list[torch.Tensor]:
    """long [rows] per sample: the index of each newline token among the image's `<image>` ids. From the images'
    sizes (the processor's output, a forward given pixels), or inside `generate`, which encodes the image before the
    prefill and drops the sizes, from the packed features themselves: the rows equal to the learned `image_newline`."""
    if kwargs.get("image_sizes") is not None:
        return [tiling(model, h, w).newlines() for h, w in image_sizes(kwargs)]
    newline = model.model.image_newline
    return [(packed == newline.to(packed)).all(-1).nonzero()[:, 0]
            for packed in kwargs["mm_encoder_outputs"]["image"].pooler_output]


def token_masks(model, input_ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(visual, image) bool [batch, T]: the patch tokens the pruner may drop, and every `<image>` id (newlines
    included, where the image ends). ValueError when the samples do not hold one image each."""
    image = input_ids == model.config.image_token_id
    visual = image.clone()
    rows = newlines(model, kwargs)
    if len(rows) != image.shape[0]:
        raise ValueError(f"{type(model).__name__}: {len(rows)} images for {image.shape[0]} prompts; HAP prunes "
                         "prompts with exactly one image each")
    for b, lines in enumerate(rows):
        where = image[b].nonzero()[:, 0]
        visual[b, where[lines.to(where.device)]] = False
    return visual, image


def layout(model, inputs, image_size: tuple[int, int] | None = None) -> Layout:
    """The first sample's tokens on its image: the base view over the whole image, the tile grid over the unpadded
    canvas (its rectangle reaches past the image by the canvas cells that hold some padding)."""
    h, w = image_sizes(inputs)[0]
    pack = tiling(model, h, w)
    base = pack.base ** 2
    rows, cols = pack.grid
    views = (TokenView("base view (the whole image squashed to one tile)", (pack.base, pack.base), tuple(range(base))),
             TokenView(f"tiles ({pack.tiles[0]} x {pack.tiles[1]}, unpadded)", pack.grid,
                       tuple(range(base, base + rows * cols)), pack.box))
    return Layout(pack.visual, views, image_size or (w, h))


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`decoder.apply_patch` with the newline tokens kept out of the pruner; the [CLS] cues are refused."""
    if pruner_for(config).needs_cls:
        raise ValueError(f"{cls_user(config)} needs one [CLS] attention "
                         f"over the visual tokens: {type(model).__name__} packs a base view and a tile canvas, each "
                         "tile encoded on its own, plus newline tokens, so no single [CLS] row ranks them")
    return decoder.apply_patch(model, config, trace, priority, tail, lead=lead,
                               token_masks=lambda ids, kwargs: token_masks(model, ids, kwargs))
