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
appear in both, and both compete). The prompt rows start after the image's last token, the last newline. DivPrune
alone selects over them too, as its official LLaVA-1.6 code does (`hap.pruners.divprune`; carried over to OneVision).
`downsample` pools each of the two views (`view_grids`) into its own first slots: pooled row i of the tile grid takes
the first slots of the grid's row i, so the newline after that row follows it, and the newlines of the rows below the
pooled grid stay, one after another, after its last row (the executor drops visual tokens only).
The layout (`hap.layout`) has two views, the base view over the whole image and the tile grid over the unpadded
canvas, each token's cell the pixels of the upload its patch sees (`tiling`), so the maps draw each on the uploaded
image. Visual-token counts depend on the image: a batch needs equal
counts (images of one aspect class), a batch of unequal counts is refused before any work.

The decoder is the stock Llama / Mistral / Qwen2 stack (`hap.patch.decoder`); Mistral's sliding window is kept by
the rebuilt masks. VisPruner and CDPruner select per crop, as their official LLaVA-NeXT code does: the tower runs each
crop (the base view, each tile) as its own image, and its [CLS] cues per crop (`capture_tower`, CLIP towers only) are
mapped to the visual tokens by `crop_places`: each crop's selection runs over all its patches before the unpadding,
and the picks the unpadding cuts are not in the sequence. Refused: the other [CLS] cues (visionzip, autoprune,
first_cut="vision"): they rank every visual token by one [CLS] row, and here the tokens come from several views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
from transformers.image_utils import ChannelDimension
from transformers.models.llava_next.modeling_llava_next import unpad_image

from ..config import HAPConfig
from ..layout import Layout, Span, TokenView, tile_spans
from ..pruners import cls_user, pruner_for
from ..pruners.cues import VisionCues
from . import decoder
from .decoder import attention_outputs, decoder_of, remove_patch
from .llava import capture_tower, clip_projection, cls_layer, read_layers

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "layout", "remove_patch", "token_masks", "view_grids"]


@dataclass(frozen=True)
class Tiling:
    """How one image's tokens are packed and where they lie on it: the base view's side `base` (tokens base x base,
    their cells `base_spans` along either axis: the whole image squashed to one tile), the tile grid after unpadding
    (and OneVision's shrink) as the spans of its `columns` and `rows` on the image, and the (rows, cols) of tiles the
    image was cut into. Spans are fractions of the image's width or height (`hap.layout.tile_spans`)."""

    base: int
    base_spans: tuple[Span, ...]
    columns: tuple[Span, ...]
    rows: tuple[Span, ...]
    tiles: tuple[int, int]

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of the tile grid's tokens."""
        return len(self.rows), len(self.columns)

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
    """The packing of an image of `height` x `width` pixels, with the processor's and the model's own functions:
    `select_best_resolution` (the canvas), `get_patch_output_size` (the image resized onto it, pasted centred),
    `unpad_image` run on a grid of indices (the stitched grid's rows and columns it keeps; OneVision's modeling module
    holds the same function) and, for OneVision's
    `anyres_max_N`, the same bilinear `interpolate` run on one-hot rows (which source cells each shrunk token mixes).
    A token's cell is the pixels its patch sees: patch i of tile t covers [t * tile + i * patch, + patch) of the
    canvas, so where the patch does not divide the tile (SigLIP: 27 patches of 14 px see 378 of 384 px) the end of
    every tile lies in no cell; a shrunk token covers the union of the cells it mixes."""
    config = model.config
    tile, patch = config.vision_config.image_size, config.vision_config.patch_size
    side = tile // patch
    best_h, best_w = select_best_resolution((height, width), config.image_grid_pinpoints)
    new_h, new_w = get_patch_output_size(np.broadcast_to(np.uint8(0), (1, height, width)), (best_h, best_w),
                                         ChannelDimension.FIRST)
    tiles = (best_h // tile, best_w // tile)
    grid = torch.stack(torch.meshgrid(torch.arange(tiles[0] * side), torch.arange(tiles[1] * side), indexing="ij"))
    kept = unpad_image(grid, (height, width))  # [2, rows, cols]: each kept cell's (row, col) on the stitched grid
    first_row, first_col = int(kept[0, 0, 0]), int(kept[1, 0, 0])
    rows = tile_spans(first_row, kept.shape[1], side, tile, patch, (best_h - new_h) // 2, new_h)
    columns = tile_spans(first_col, kept.shape[2], side, tile, patch, (best_w - new_w) // 2, new_w)
    aspect = getattr(config, "vision_aspect_ratio", None)  # OneVision: "anyres_max_9"
    if aspect is not None:
        ratio = math.sqrt(len(rows) * len(columns) / (int(aspect.strip("anyres_max_")) * side ** 2))
        if ratio > 1.1:
            rows, columns = shrunk(rows, int(len(rows) // ratio)), shrunk(columns, int(len(columns) // ratio))
    return Tiling(side, tile_spans(0, side, side, tile, patch, 0, tile), columns, rows, tiles)


def shrunk(spans: tuple[Span, ...], size: int) -> tuple[Span, ...]:
    """The spans of `size` cells bilinearly resampled from cells of `spans`, as OneVision's `interpolate` shrinks its
    grid (separable: one axis at a time): each covers the union of the source cells it takes a weight from."""
    weights = torch.nn.functional.interpolate(torch.eye(len(spans))[None, :, :, None], [size, 1], mode="bilinear")
    used = weights[0, :, :, 0] > 0  # [source, shrunk]
    return tuple((min(spans[j][0] for j in used[:, i].nonzero()[:, 0].tolist()),
                  max(spans[j][1] for j in used[:, i].nonzero()[:, 0].tolist())) for i in range(size))


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


def view_grids(model, input_ids: torch.Tensor, kwargs: dict) -> list[tuple[tuple[int, int], ...]]:
    """Per sample, the (rows, cols) of its two views' grids of patch tokens (`decoder.ViewGrids`): the base view's
    s x s, then the unpadded tile grid's, one row per newline token (`newlines`) and its patch tokens shared among
    them."""
    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    counts = (input_ids == model.config.image_token_id).sum(1).tolist()
    return [((side, side), (len(lines), (n - len(lines) - side * side) // len(lines)))
            for lines, n in zip(newlines(model, kwargs), counts)]


def layout(model, inputs, image_size: tuple[int, int] | None = None, processor=None) -> Layout:
    """The first sample's tokens on its image, each cell the pixels its patch sees (`tiling`): the base view over the
    whole image, the tile grid over the unpadded canvas (reaching past the image by the canvas cells that hold some
    padding)."""
    h, w = image_sizes(inputs)[0]
    pack = tiling(model, h, w)
    base = pack.base ** 2
    rows, cols = pack.grid
    views = (TokenView.spanning("base view (the whole image squashed to one tile)", range(base), pack.base_spans,
                                pack.base_spans),
             TokenView.spanning(f"tiles ({pack.tiles[0]} x {pack.tiles[1]}, unpadded)", range(base, base + rows * cols),
                                pack.columns, pack.rows))
    return Layout(pack.visual, views, image_size or (w, h))


def crop_places(side: int, tiles: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """long [1 + tiles[0] * tiles[1], side * side]: the visual index of each patch of each crop (the base view, then
    the tiles row by row), -1 where the unpadding cuts it. The tiles' patches are stitched into a (tiles[0] side) x
    (tiles[1] side) grid, cut symmetrically to `grid` = (rows, cols) as `unpad_image` cuts it, and numbered row by row
    after the base view's side * side tokens (the newlines are no visual tokens)."""
    (th, tw), (rows, cols) = tiles, grid
    top, left = (th * side - rows) // 2, (tw * side - cols) // 2
    y = torch.arange(th)[:, None, None, None] * side + torch.arange(side)[None, None, :, None] - top  # [th, 1, s, 1]
    x = torch.arange(tw)[None, :, None, None] * side + torch.arange(side)[None, None, None, :] - left  # [1, tw, 1, s]
    inside = (y >= 0) & (y < rows) & (x >= 0) & (x < cols)
    tile = torch.where(inside, side * side + y * cols + x, -1).flatten(2).flatten(0, 1)  # [th * tw, s * s]
    return torch.cat([torch.arange(side * side)[None], tile])


def tile_shapes(model, kwargs: dict, lines: list[torch.Tensor], cues: VisionCues) -> list[tuple[int, int]]:
    """(rows, cols) of tiles each sample's image was cut into: from the images' sizes (`tiling`), or inside
    `generate` (sizes dropped) the canvas among `image_grid_pinpoints` whose unpadding leaves the sample's tile grid
    (its `lines`, the newline indices) and whose first tile-grid token, projected from the captured crop `cues`,
    is the packed feature there (a 1 x 2 and a 2 x 1 canvas can leave the same grid)."""
    if kwargs.get("image_sizes") is not None:
        return [tiling(model, h, w).tiles for h, w in image_sizes(kwargs)]
    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    shapes, first = [], 0
    for packed, rows in zip(kwargs["mm_encoder_outputs"]["image"].pooler_output, lines):
        grid = (len(rows), int(rows[0]) - side * side)
        fits = [(h // vision.image_size, w // vision.image_size) for h, w in model.config.image_grid_pinpoints]
        fits = [t for t in dict.fromkeys(fits) if _unpads_to(t, side, grid)]
        if not fits:
            raise ValueError(f"{type(model).__name__}: no canvas of image_grid_pinpoints leaves a {grid[0]} x "
                             f"{grid[1]} tile grid")

        def gap(tiles: tuple[int, int]) -> float:  # the first tile-grid token: projected crop patch vs packed
            crop, patch = (crop_places(side, tiles, grid) == side * side).nonzero()[0].tolist()
            if first + crop >= len(cues.features):
                return float("inf")
            row = cues.project(cues.features[first + crop, 1 + patch][None, None])[0, 0]
            return float((row.float() - packed[side * side].float()).norm())

        shapes.append(min(fits, key=gap))
        first += 1 + shapes[-1][0] * shapes[-1][1]
    return shapes


def _unpads_to(tiles: tuple[int, int], side: int, grid: tuple[int, int]) -> bool:
    """Whether `unpad_image` can cut the stitched grid of `tiles` to `grid` = (rows, cols): one axis whole, the other
    cut by an even count."""
    h, w = tiles[0] * side, tiles[1] * side
    rows, cols = grid
    return ((h == rows and w >= cols and (w - cols) % 2 == 0)
            or (w == cols and h >= rows and (h - rows) % 2 == 0))


def with_places(model, cues: VisionCues, kwargs: dict) -> VisionCues:
    """`cues` of every crop the tower ran for the prompt of `kwargs` with their `places` (`crop_places`) per sample;
    ValueError when the crops are not the images' (base view and tiles)."""
    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    lines = newlines(model, kwargs)
    places = [crop_places(side, tiles, (len(rows), int(rows[0]) - side * side)).to(cues.features.device)
              for tiles, rows in zip(tile_shapes(model, kwargs, lines, cues), lines)]
    if sum(len(p) for p in places) != len(cues.features):
        raise ValueError(f"{type(model).__name__}: the tower ran {len(cues.features)} crops for images of "
                         f"{[len(p) for p in places]} crops")
    return replace(cues, places=places)


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`decoder.apply_patch` with the newline tokens kept out of the pruner (but DivPrune's) and the two views' grids
    (`view_grids`); the [CLS] cues per crop for the pruners that read them per crop (`Pruner.crops`), refused for the
    other methods that read [CLS] cues."""
    pruner = pruner_for(config)
    if pruner.needs_cls and not pruner.crops:
        raise ValueError(f"{cls_user(config)} needs one [CLS] attention "
                         f"over the visual tokens: {type(model).__name__} packs a base view and a tile canvas, each "
                         "tile encoded on its own, plus newline tokens, so no single [CLS] row ranks them")
    layer = cls_layer(model, config) if pruner.needs_cls else None
    read_layers(model, config)
    clip, clip_embed = (None, None)
    if pruner.clip:
        clip, clip_embed = clip_projection(model, config, str(next(model.parameters()).device))
    patch = None

    def masks(ids, kwargs):
        visual, image = token_masks(model, ids, kwargs)
        if layer is not None and patch.vision_cues is not None and kwargs.get("pixel_values") is None:
            # `generate` encoded the crops before the prefill (with pixels, the tower runs again in it: `deliver`)
            patch.vision_cues = with_places(model, patch.vision_cues, kwargs)
        return visual, image

    patch = decoder.apply_patch(model, config, trace, priority, tail, lead=lead, token_masks=masks,
                                view_grids=lambda ids, kwargs: view_grids(model, ids, kwargs))
    patch.clip = clip
    if layer is not None:
        def deliver(cues: VisionCues) -> None:
            """The `VisionCues` of every crop, to the running prefill's state with their places (`with_places`, from
            the prompt's sizes), or the next one's, placed when its prompt comes (`generate` encodes the crops before
            the prefill)."""
            if patch.mode == "prefill":
                patch.state.vision = with_places(model, cues, patch.prompt)
            else:
                patch.vision_cues = cues

        patch.handles.extend(capture_tower(model, config, clip_embed, deliver))
    return patch
