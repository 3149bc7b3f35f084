"""Adapter for `InternVLForConditionalGeneration` (the InternVL3 / InternVL2.5 `-hf` ports: InternViT + a Qwen2 or
Llama decoder).

The processor (`GotOcr2ImageProcessor`, `crop_to_patches=True`) picks a cols x rows grid of square tiles,
`min_patches <= cols * rows <= max_patches`, closest to the image's aspect ratio, squashes the image onto it and crops
the tiles row-major; when there is more than one tile it appends a thumbnail (the whole image squashed to one tile),
last. Each tile is encoded on its own, its [CLS] dropped, and its s x s patches pixel-shuffled 2 x 2 into
(s/2) x (s/2) tokens, row-major (16 x 16 = 256 per 448-px tile). The prompt holds `<img>` + the tokens of every
tile, then the thumbnail's, + `</img>`: one `<IMG_CONTEXT>` id each, no separators between tiles (docs/method.md §15).

Every `<IMG_CONTEXT>` token is a visual token of the pruner; the budget is stated over all of them (tiles and
thumbnail share pixels, both compete). The layout has two views: the tile grid over the whole image (the tiles are
a squash of the image, so they cover it exactly) and the thumbnail over the whole image; a one-tile image has one view.
Visual-token counts depend on the image: a batch of unequal counts is refused before any work.

The decoder is the stock Qwen2 / Llama stack (`hap.patch.decoder`), 1-D RoPE. Refused: the [CLS] cues (visionzip,
autoprune, first_cut="vision").
"""

from __future__ import annotations

import torch
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

from ..config import HAPConfig
from ..layout import Layout, seen_share
from ..pruners import cls_user, pruner_for
from . import decoder
from .decoder import attention_outputs, decoder_of, remove_patch

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "layout", "remove_patch"]


def tile_size(model) -> tuple[int, int]:
    """(height, width) pixels of a tile: the vision tower's input size (the config keeps it as a pair)."""
    size = model.config.vision_config.image_size
    return tuple(size) if isinstance(size, (list, tuple)) else (size, size)


def patch_size(model) -> int:
    """Pixels along one side of a (square) patch (the config may keep it as a pair)."""
    patch = model.config.vision_config.patch_size
    return patch[0] if isinstance(patch, (list, tuple)) else patch


def tile_side(model) -> int:
    """Tokens along one side of a (square) tile: its patches per side, shrunk by the pixel shuffle."""
    return round(tile_size(model)[0] // patch_size(model) * model.config.downsample_ratio)


def tile_grid(model, tiles: int, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of the `tiles` tiles an image of `height` x `width` pixels was cut into: the processor's
    `get_optimal_tiled_canvas` over the grids of exactly that many tiles. Its choice over `min_patches..max_patches`
    has `tiles` tiles and is the closest in aspect ratio among them, so this finds it without the processor's settings
    (the tie-break between equal aspect ratios prefers more tiles in both searches)."""
    cols, rows = get_optimal_tiled_canvas((height, width), tile_size(model), tiles, tiles)
    return rows, cols


def layout(model, inputs, image_size: tuple[int, int] | None = None, processor=None) -> Layout:
    """The first sample's tokens on its image of `image_size` = (width, height) pixels (required: the processor's
    output does not carry it): the tile grid and the thumbnail, each over the whole image; one tile: one view."""
    if image_size is None:
        raise ValueError(f"{type(model).__name__}'s layout needs the image's (width, height): its processor does not "
                         "pass the size on")
    side = tile_side(model)
    per_tile = side * side
    seen = seen_share(tile_size(model)[0], round(patch_size(model) / model.config.downsample_ratio))  # 2 x 2 patches
    count = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    if count % per_tile:
        raise ValueError(f"{count} image tokens are not whole tiles of {per_tile} tokens")
    if count == per_tile:
        return Layout.grid(side, side, image_size, name="image (one tile)", seen=seen)
    width, height = image_size
    rows, cols = tile_grid(model, count // per_tile - 1, height, width)  # the last tile is the thumbnail
    return Layout.tiled(rows, cols, side, image_size, f"tiles ({rows} x {cols})",
                        "thumbnail (the whole image squashed to one tile)", seen=seen)


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`decoder.apply_patch`, each tile (and the thumbnail) a view of its own (`decoder.square_blocks`); the [CLS] cues
    are refused."""
    if pruner_for(config).needs_cls:
        raise ValueError(f"{cls_user(config)} needs one [CLS] attention "
                         f"over the visual tokens: {type(model).__name__} encodes each tile and the thumbnail on its "
                         "own, drops their [CLS] and pixel-shuffles 2 x 2 patches into one token, so no single [CLS] "
                         "row ranks them")
    return decoder.apply_patch(model, config, trace, priority, tail, lead=lead,
                               view_grids=decoder.square_blocks(model, tile_side(model)))
