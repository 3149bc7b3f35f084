"""Where each visual token of one run lies on the uploaded image (docs/method.md §15): the per-run `Layout`.

A model may see the image more than once and in pieces: LLaVA-NeXT and LLaVA-OneVision encode a base view (the whole
image squashed to one tile) and a canvas of tiles, InternVL tiles plus a thumbnail, SmolVLM crops plus a global view.
Within each such *view* the visual tokens form a regular grid of cells laid uniformly over one rectangle of the
image, so a view is (its grid, which visual token sits in each cell, the rectangle). The rectangle is given in
fractions of the original image's width and height and may reach beyond [0, 1] where the model's grid also covers
padding (a tile canvas larger than the resized image). The adapter of the model computes the layout once per run
(`adapter.layout(model, inputs, image_size)`); every view of `hap.views` draws from it. Tokens that carry no pixels
(LLaVA-NeXT's row-end newline tokens) are not visual tokens of the pruner and have no cell.

Plain Python and numpy: no model, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1), fractions of the original image's width and height
WHOLE: Box = (0.0, 0.0, 1.0, 1.0)


@dataclass(frozen=True)
class TokenView:
    """One view of the image: a `grid` (rows, cols) of cells over the rectangle `box`, cell (r, c) holding the
    visual token `tokens[r * cols + c]` (an index into the run's visual tokens 0..N-1; -1: no token)."""

    name: str  # what the panel says: "image", "base view", "tiles", "thumbnail", "global view", ...
    grid: tuple[int, int]
    tokens: tuple[int, ...]
    box: Box = WHOLE

    def cell_boxes(self) -> np.ndarray:
        """float [rows * cols, 4] (x0, y0, x1, y1) of each cell on the original image, row-major."""
        rows, cols = self.grid
        x0, y0, x1, y1 = self.box
        r, c = np.divmod(np.arange(rows * cols), cols)
        w, h = (x1 - x0) / cols, (y1 - y0) / rows
        return np.stack([x0 + c * w, y0 + r * h, x0 + (c + 1) * w, y0 + (r + 1) * h], -1)

    def values(self, values: np.ndarray) -> np.ndarray:
        """Per-token `values [N]` (or `[N, ...]`) -> the view's `[rows, cols(, ...)]`, NaN (False for bool) where
        a cell holds no token."""
        values = np.asarray(values)
        index = np.asarray(self.tokens)
        fill = False if values.dtype == bool else np.nan
        out = np.full((index.size, *values.shape[1:]), fill, dtype=bool if values.dtype == bool else float)
        out[index >= 0] = values[index[index >= 0]]
        return out.reshape(*self.grid, *values.shape[1:])


@dataclass(frozen=True)
class Layout:
    """Every visual token of one run on the uploaded image (`image_size` = (width, height) pixels)."""

    num_visual: int
    views: tuple[TokenView, ...]
    image_size: tuple[int, int] | None = None

    @classmethod
    def grid(cls, rows: int, cols: int, image_size: tuple[int, int] | None = None, box: Box = WHOLE,
             name: str = "image") -> Layout:
        """One view: `rows` x `cols` tokens in row-major order over `box` (LLaVA-1.5, Qwen-VL, Gemma 3)."""
        return cls(rows * cols, (TokenView(name, (rows, cols), tuple(range(rows * cols)), box),), image_size)

    @classmethod
    def tiled(cls, rows: int, cols: int, side: int, image_size: tuple[int, int] | None = None, tiles: str = "tiles",
              whole: str = "thumbnail") -> Layout:
        """Two views over the whole image (InternVL's tiles and thumbnail, SmolVLM's crops and global view): the image
        squashed onto `rows` x `cols` tiles of `side` x `side` tokens, numbered tile by tile (row-major) and row-major
        inside a tile, then one more tile, the whole image squashed onto it."""
        per_tile = side * side
        r, c = np.divmod(np.arange(rows * cols * per_tile), cols * side)  # the cells of the tile grid, row-major
        token = ((r // side) * cols + c // side) * per_tile + (r % side) * side + c % side
        count = rows * cols * per_tile
        return cls(count + per_tile, (TokenView(tiles, (rows * side, cols * side), tuple(token.tolist())),
                                      TokenView(whole, (side, side), tuple(range(count, count + per_tile)))),
                   image_size)

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """The inverse of `to_dict` (a `Result` read back from JSON)."""
        views = tuple(TokenView(v["name"], tuple(v["grid"]), tuple(v["tokens"]), tuple(v["box"])) for v in data["views"])
        size = data.get("image_size")
        return cls(data["num_visual"], views, None if size is None else tuple(size))

    def to_dict(self) -> dict:
        """Plain JSON types."""
        return {"num_visual": self.num_visual, "image_size": None if self.image_size is None else list(self.image_size),
                "views": [{"name": v.name, "grid": list(v.grid), "tokens": list(v.tokens), "box": list(v.box)}
                          for v in self.views]}

    def view_of(self) -> np.ndarray:
        """long [N] the view each visual token belongs to (-1 for a token in no view)."""
        out = np.full(self.num_visual, -1)
        for i, view in enumerate(self.views):
            index = np.asarray(view.tokens)
            out[index[index >= 0]] = i
        return out

    def boxes(self) -> np.ndarray:
        """float [N, 4] (x0, y0, x1, y1) of each visual token on the original image (NaN for a token in no view)."""
        out = np.full((self.num_visual, 4), np.nan)
        for view in self.views:
            index = np.asarray(view.tokens)
            out[index[index >= 0]] = view.cell_boxes()[index >= 0]
        return out

    def check(self) -> None:
        """ValueError unless every visual token 0..N-1 sits in exactly one cell."""
        seen = np.concatenate([np.asarray(v.tokens) for v in self.views])
        seen = np.sort(seen[seen >= 0])
        if not np.array_equal(seen, np.arange(self.num_visual)):
            raise ValueError(f"the layout's views hold {seen.size} token cells, not each of the {self.num_visual} "
                             "visual tokens once")
