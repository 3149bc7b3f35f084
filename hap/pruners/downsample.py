"""Downsampling, the VTC-Bench baseline (docs/method.md §7): fewer visual tokens by resolution alone, no scoring.

- Fixed-grid towers: the projected token grid of each view [h, w, D] is average-pooled to an h' x w' grid; the
  pooling windows are those of `torch.nn.functional.adaptive_avg_pool2d` (output row i covers input rows
  floor(i h / h') .. ceil((i + 1) h / h') - 1, likewise for columns), so windows may overlap by one patch when h' does
  not divide h. Each pooled token stands for the first patch of its window (its top-left one).
- Dynamic-resolution models (Qwen2-VL family): the image is resized so that the processor emits the budget's count.

The grid rule (`grid`), shared by both: h' x w' <= budget tokens, short of it by less than one row (w'), with h' <= h,
w' <= w and the aspect ratio h'/w' closest (in log ratio) to h/w; ties go to the larger count, then to more rows.
A budget of at least h * w keeps the grid as it is.

Several views (LLaVA-NeXT's base view and tile grid, InternVL's tiles and thumbnail, SmolVLM's crops and global view,
Gemma 3's blocks; their grids from the adapter, `PruneState.grids`): the budget is split across the views in
proportion to their token counts (`shares`, largest remainder) and each view is pooled to its share by the grid rule
(`pool_views`); a view whose share is 0 keeps no token. Each view's pooled tokens take its own first slots, pooled
cell (i, j) the slot of the view's patch (i, j) (the top-left h' x w' corner of its grid, `corner`), so a view's pooled
tokens stay between its own markers, and each pooled row of LLaVA-NeXT's tile grid is followed by a newline token.

The pruner (`Downsample`) runs the fixed-grid rule on the shared executor; on the Qwen2-VL family it resizes the image
before the processor (`resizes_image`, done once by `hap.run`) and the decoder runs every token of the smaller image,
each reported at the original token under its top-left corner (`window_starts`).
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


def shares(budget: int, sizes: list[int]) -> list[int]:
    """The `budget` split across views of `sizes` tokens in proportion to them, at most each view's size: view v gets
    floor(b n_v / N) (b = min(budget, N), N = the sum of sizes), and the b - sum of those tokens left over go one each
    to the views with the largest remainders (b n_v mod N), ties to the earlier view."""
    total = sum(sizes)
    budget = min(budget, total)
    out = [budget * n // total for n in sizes]
    by_remainder = sorted(range(len(sizes)), key=lambda v: (-(budget * sizes[v] % total), v))
    for v in by_remainder[:budget - sum(out)]:
        out[v] += 1
    return out


def views_of(grids: tuple[tuple[int, int], ...], num_visual: int) -> tuple[tuple[int, int], ...]:
    """The (rows, cols) of each view of `num_visual` visual tokens in token order: the adapter's `grids`, else one
    square grid (LLaVA-1.5). ValueError where neither fits."""
    if grids:
        if sum(h * w for h, w in grids) != num_visual:
            raise ValueError(f"the view grids {list(grids)} do not hold the {num_visual} visual tokens")
        return grids
    side = math.isqrt(num_visual)
    if side * side != num_visual:
        raise ValueError(f"method='downsample' pools one square grid of tokens where the model gives no view grids; "
                         f"this image gives {num_visual}")
    return ((side, side),)


def counts(grids: tuple[tuple[int, int], ...], budget: int) -> list[int]:
    """Tokens each view of `grids` keeps for `budget`: its share (`shares`) pooled by `grid` (0 for a share of 0)."""
    return [math.prod(grid(h, w, k)) if k else 0 for (h, w), k in zip(grids, shares(budget, [h * w for h, w in grids]))]


def corner(height: int, width: int, rows: int, cols: int) -> torch.Tensor:
    """long [rows * cols]: the flat index into an `height` x `width` grid of cell (i, j), for each cell of the
    `rows` x `cols` grid in raster order: i * width + j, its top-left corner."""
    return (torch.arange(rows)[:, None] * width + torch.arange(cols)[None, :]).flatten()


def pool_views(tokens: torch.Tensor, grids: tuple[tuple[int, int], ...],
               budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Average-pool each view of `tokens [N, D]` (views of `grids` in token order) to its share of `budget`.

    -> (pooled [k', D], first long [k'], slots long [k']), view after view, each in raster order: the pooled tokens,
    the index into N of the first patch of each one's window, and the slot each takes (`corner` of its view);
    k' = sum of `counts(grids, budget)`."""
    parts, start = [], 0
    for (h, w), k in zip(grids, shares(budget, [h * w for h, w in grids])):
        if k:
            pooled, first = pool(tokens[start:start + h * w].view(h, w, -1), k)
            slots = corner(h, w, *grid(h, w, k)).to(first.device)
            parts.append((pooled, first + start, slots + start))
        start += h * w
    return tuple(torch.cat(part) for part in zip(*parts))


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
    """No scoring. Before the first decoder layer, each view's grid of projected tokens (the adapter's `grids`; one
    square grid on LLaVA-1.5) is average-pooled to its share of the budget (`pool_views`); the pooled tokens take
    their view's first slots, each reported at the first patch of its window. Dynamic resolution (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL): the image is resized before the processor (`resizes_image`; `resized_size`) and no cut is
    made."""

    name = "downsample"
    embeds = True
    views = True
    writes_tokens = True

    def resizes_image(self, family):
        return family in DYNAMIC

    def image_size(self, height, width, budget, settings):
        return resized_size(height, width, budget, *settings)  # settings: (patch, merge, min_pixels, max_pixels)

    def resized_kept(self, before, after):
        """Each token of the resized image's grid at the original token under its top-left corner (`window_starts`)."""
        return window_starts(*before, *after).tolist()

    def rewrites(self, k, num_visual):
        return k < num_visual  # a budget of every token pools windows of one patch: the tokens as they are

    def realised(self, k, num_visual, grids=()):
        if not grids and math.isqrt(num_visual) ** 2 != num_visual:
            return k  # a planner not given the adapter's view grids: the budget's count
        return sum(counts(views_of(grids, num_visual), k))

    def select(self, state, cut):
        grids = views_of(state.grids, cut.embeds.shape[1])
        pooled = [pool_views(tokens, grids, cut.budget) for tokens in cut.embeds]
        tokens, first, slots = (torch.stack(part) for part in zip(*pooled))
        return Selection(slots.to(state.visual_pos.device), tokens=tokens, patches=first)


PRUNER = Downsample
