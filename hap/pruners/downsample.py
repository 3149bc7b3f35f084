"""Downsampling, the VTC-Bench baseline (docs/method.md §7): fewer visual tokens by resolution alone, no scoring.

- Fixed-grid towers: the projected token grid of each view [h, w, D] is average-pooled to an h' x w' grid; the
  pooling windows are those of `torch.nn.functional.adaptive_avg_pool2d` (output row i covers input rows
  floor(i h / h') .. ceil((i + 1) h / h') - 1, likewise for columns), so windows may overlap by one patch when h' does
  not divide h. Each pooled token stands for the first patch of its window (its top-left one).
- Dynamic-resolution models (Qwen2-VL family): the image is resized so that the processor emits the budget's count.

The grid rule (`grid`), shared by both: h' x w' <= budget tokens, short of it by less than one row (w'), with h' <= h,
w' <= w and the aspect ratio h'/w' closest (in log ratio) to h/w; ties go to the larger count, then to more rows.
A budget of at least h * w keeps the grid as it is.

The pruner (`Downsample`) runs the fixed-grid rule on the shared executor (LLaVA-1.5's one square grid); on the
Qwen2-VL family it resizes the image before the processor (`resizes_image`, done once by `hap.run`) and the decoder
runs every token of the smaller image, each reported at the original token under its top-left corner (`window_starts`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import BeforeDecoder, Selection


def grid(height: int, width: int, budget: int) -> tuple[int, int]:
    """(rows, cols) of the pooled grid of an `height` x `width` grid for `budget` tokens (module docstring)."""
    if budget < 1 or height < 1 or width < 1:
        raise ValueError(f"budget={budget}, height={height} and width={width} must all be >= 1")
    if budget >= height * width:
        return height, width
    aspect = math.log(height / width)
    best, key = (height, width), None
    for cols in range(1, width + 1):
        rows = min(height, budget // cols)
        if rows < 1 or rows * cols <= budget - cols:  # more than one row short of the budget
            continue
        candidate = (abs(math.log(rows / cols) - aspect), -rows * cols, -rows)
        if key is None or candidate < key:
            best, key = (rows, cols), candidate
    return best


def pool(grid_tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Average-pool one view's projected token grid `grid_tokens [h, w, D]` to about `k` tokens.

    -> (pooled [k', D] in raster order, in the input dtype; first long [k']: per pooled token the flat index into
    h * w of the first patch of its pooling window). k' = rows * cols of `grid(h, w, k)`: at most k, short of it by
    less than one pooled row.
    """
    h, w, _ = grid_tokens.shape
    rows, cols = grid(h, w, k)
    pooled = F.adaptive_avg_pool2d(grid_tokens.permute(2, 0, 1).float(), (rows, cols))  # [D, rows, cols]
    return pooled.flatten(1).T.to(grid_tokens.dtype), window_starts(h, w, rows, cols).to(grid_tokens.device)


def window_starts(height: int, width: int, rows: int, cols: int) -> torch.Tensor:
    """long [rows * cols]: for each cell (i, j) of a `rows` x `cols` grid laid over the same picture as an `height` x
    `width` grid (raster order), the flat index into height * width of the cell of the finer grid under its top-left
    corner: floor(i height / rows) * width + floor(j width / cols), the first patch of its pooling window."""
    top = torch.arange(rows) * height // rows
    left = torch.arange(cols) * width // cols
    return (top[:, None] * width + left[None, :]).flatten()


def resized_size(height: int, width: int, budget: int, patch: int, merge: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The (height, width) in pixels to resize an `height` x `width` image to, so that a Qwen2-VL-family processor
    (patch `patch`, spatial merge `merge`, pixel bounds `min_pixels` / `max_pixels`) emits `grid(...)`'s count of
    visual tokens for `budget`: at most the budget, short of it by less than one token row.

    The token grid of the image as the processor would emit it (transformers' `smart_resize`) is pooled to the
    budget by `grid`, and the size returned is that grid times patch * merge; `smart_resize` then confirms it is
    left as it is. A budget of at least the image's own count returns the image's size (nothing to downsample).
    ValueError when the processor's pixel bounds do not allow that many tokens.
    """
    factor = patch * merge
    rows, cols = (side // factor for side in processor_size(height, width, factor, min_pixels, max_pixels))
    if budget >= rows * cols:
        return height, width
    rows, cols = grid(rows, cols, budget)
    size = (rows * factor, cols * factor)
    if processor_size(*size, factor, min_pixels, max_pixels) != size:
        raise ValueError(f"budget={budget}: a {size[0]}x{size[1]} image ({rows * cols} tokens) lies outside the "
                         f"processor's pixel bounds min_pixels={min_pixels}, max_pixels={max_pixels}")
    return size


def processor_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size a Qwen2-VL-family image processor resizes an image to: transformers' own `smart_resize`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    try:
        return tuple(smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels))
    except ValueError as err:
        raise ValueError(f"image of {height}x{width} px: {err}") from err


DYNAMIC = ("qwen2_vl", "qwen3_vl")  # the adapters of dynamic-resolution models: the image itself is resized


class Downsample(BeforeDecoder):
    """No scoring. LLaVA-1.5: before the first decoder layer, the image's square grid of projected tokens is
    average-pooled to the budget (`pool`); the pooled tokens take the first slots, each reported at the first patch
    of its window. Dynamic resolution (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the image is resized before the processor
    (`resizes_image`; `resized_size`) and no cut is made. Tiles, blocks and crops are refused."""

    name = "downsample"
    embeds = True
    writes_tokens = True

    def refuses(self, family: str) -> str | None:
        if family != "llava" and family not in DYNAMIC:
            return ("downsample pools one square grid of projected tokens (LLaVA-1.5) or resizes a dynamic-resolution "
                    "image (Qwen2-VL, Qwen2.5-VL, Qwen3-VL); this family's tiles, blocks or crops are not built here")
        return None

    def resizes_image(self, family):
        return family in DYNAMIC

    def image_size(self, height, width, budget, settings):
        return resized_size(height, width, budget, *settings)  # settings: (patch, merge, min_pixels, max_pixels)

    def rewrites(self, k, num_visual):
        return k < num_visual  # a budget of every token pools windows of one patch: the tokens as they are

    def realised(self, k, num_visual):
        side = math.isqrt(num_visual)
        return math.prod(grid(side, side, k)) if side * side == num_visual else k

    def select(self, state, cut):
        B, N, D = cut.embeds.shape
        side = math.isqrt(N)
        if side * side != N:
            raise ValueError(f"method='downsample' pools one square grid of tokens; this image gives {N}")
        pooled = [pool(tokens.view(side, side, D), cut.budget) for tokens in cut.embeds]
        tokens, first = torch.stack([p for p, _ in pooled]), torch.stack([f for _, f in pooled])
        chosen = torch.arange(tokens.shape[1], device=state.visual_pos.device).expand(B, -1)
        return Selection(chosen, tokens=tokens, patches=first)


PRUNER = Downsample
