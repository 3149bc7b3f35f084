"""Where each visual token of one run lies on the uploaded image (docs/method.md §15): the per-run `Layout`.

A model may see the image more than once and in pieces: LLaVA-NeXT and LLaVA-OneVision encode a base view (the whole
image squashed to one tile) and a canvas of tiles, InternVL tiles plus a thumbnail, SmolVLM crops plus a global view.
Within each such *view* the visual tokens form a grid of cells, so a view is (its grid, which visual token sits in
each cell, where each column and each row of cells lies on the image). A cell is the pixels its token's patches see:
column c spans [x0_c, x1_c) and row r spans [y0_r, y1_r), in fractions of the original image's width and height,
reaching beyond [0, 1] where the model's grid also covers padding (a tile canvas larger than the resized image).
The cells need not tile the view: a patch convolution over a tile that its patch size does not divide sees only the
first floor(tile / patch) patches, so a strip at the end of each tile lies in no cell (`tile_spans`); a token mixed
from several patches (a bilinear shrink) covers their union, and such cells may overlap. A view whose cells are equal
parts of one rectangle `box` stores only the box. The adapter of the model computes the layout once per run
(`adapter.layout(model, inputs, image_size, processor)`); every view of `hap.views` draws from it. Tokens that carry
no pixels (LLaVA-NeXT's row-end newline tokens) are not visual tokens of the pruner and have no cell.

Plain Python and numpy: no model, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1), fractions of the original image's width and height
Span = tuple[float, float]  # (start, end) along one axis, a fraction of the image's width or height
WHOLE: Box = (0.0, 0.0, 1.0, 1.0)


def tile_spans(first: int, count: int, per_tile: int, tile: float, cell: float, offset: float = 0.0,
               length: float = 1.0) -> tuple[Span, ...]:
    """The spans of cells `first .. first + count - 1` of a grid laid tile by tile along one axis of a canvas: cell j
    is cell j % `per_tile` of tile j // `per_tile` and covers [t * tile + i * cell, t * tile + (i + 1) * cell) of the
    canvas (per_tile * cell may fall short of tile: the rest of each tile is unseen); mapped to the image, whose first
    pixel lies at `offset` on the canvas and which fills `length` of it: (x - offset) / length."""
    j = np.arange(first, first + count)
    start = j // per_tile * tile + j % per_tile * cell
    return tuple(zip(((start - offset) / length).tolist(), ((start + cell - offset) / length).tolist()))


def seen_share(size: int, cell: int) -> float:
    """The share of a `size`-px tile (or side) that whole `cell`-px cells cover: floor(size / cell) * cell / size."""
    return size // cell * cell / size


@dataclass(frozen=True)
class TokenView:
    """One view of the image: a `grid` (rows, cols) of cells within the rectangle `box`, cell (r, c) holding the
    visual token `tokens[r * cols + c]` (an index into the run's visual tokens 0..N-1; -1: no token) and covering
    column span `columns[c]` x row span `rows[r]` (empty: the box cut into equal columns / rows)."""

    name: str  # what the panel says: "image", "base view", "tiles", "thumbnail", "global view", ...
    grid: tuple[int, int]
    tokens: tuple[int, ...]
    box: Box = WHOLE
    columns: tuple[Span, ...] = ()
    rows: tuple[Span, ...] = ()

    @classmethod
    def spanning(cls, name: str, tokens, columns, rows) -> TokenView:
        """A view of cells `columns` x `rows` (spans, fractions of the image); its box is their hull."""
        columns, rows = tuple(map(tuple, columns)), tuple(map(tuple, rows))
        box = (min(a for a, _ in columns), min(a for a, _ in rows), max(b for _, b in columns), max(b for _, b in rows))
        return cls(name, (len(rows), len(columns)), tuple(tokens), box, columns, rows)

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(float [cols, 2], float [rows, 2]): the (start, end) of each column and each row of cells on the image."""
        if self.columns:
            return np.asarray(self.columns, float), np.asarray(self.rows, float)
        rows, cols = self.grid
        x0, y0, x1, y1 = self.box
        return (np.asarray(tile_spans(0, cols, cols, 0, (x1 - x0) / cols, -x0)),
                np.asarray(tile_spans(0, rows, rows, 0, (y1 - y0) / rows, -y0)))

    def cell_boxes(self) -> np.ndarray:
        """float [rows * cols, 4] (x0, y0, x1, y1) of each cell on the original image, row-major."""
        xs, ys = self.spans()
        r, c = np.divmod(np.arange(self.grid[0] * self.grid[1]), self.grid[1])
        return np.stack([xs[c, 0], ys[r, 0], xs[c, 1], ys[r, 1]], -1)

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
             name: str = "image", seen: float = 1.0) -> Layout:
        """One view: `rows` x `cols` tokens in row-major order over `box` (LLaVA-1.5, Qwen-VL, Gemma 3), their cells
        covering the first `seen` share of the box along each axis (`seen_share`; the rest no patch sees)."""
        tokens = tuple(range(rows * cols))
        if seen == 1.0:
            return cls(rows * cols, (TokenView(name, (rows, cols), tokens, box),), image_size)
        x0, y0, x1, y1 = box
        view = TokenView.spanning(name, tokens, tile_spans(0, cols, cols, x1 - x0, seen * (x1 - x0) / cols, -x0),
                                  tile_spans(0, rows, rows, y1 - y0, seen * (y1 - y0) / rows, -y0))
        return cls(rows * cols, (view,), image_size)

    @classmethod
    def tiled(cls, rows: int, cols: int, side: int, image_size: tuple[int, int] | None = None, tiles: str = "tiles",
              whole: str = "thumbnail", seen: float = 1.0) -> Layout:
        """Two views over the whole image (InternVL's tiles and thumbnail, SmolVLM's crops and global view): the image
        squashed onto `rows` x `cols` tiles of `side` x `side` tokens, numbered tile by tile (row-major) and row-major
        inside a tile, then one more tile, the whole image squashed onto it; in every tile the cells cover its first
        `seen` share along each axis (`seen_share`)."""
        per_tile = side * side
        r, c = np.divmod(np.arange(rows * cols * per_tile), cols * side)  # the cells of the tile grid, row-major
        token = tuple((((r // side) * cols + c // side) * per_tile + (r % side) * side + c % side).tolist())
        count = rows * cols * per_tile
        whole_view = replace(cls.grid(side, side, name=whole, seen=seen).views[0],
                             tokens=tuple(range(count, count + per_tile)))
        if seen == 1.0:
            tile_view = TokenView(tiles, (rows * side, cols * side), token)
        else:
            tile_view = TokenView.spanning(tiles, token,
                                           tile_spans(0, cols * side, side, 1 / cols, seen / (cols * side)),
                                           tile_spans(0, rows * side, side, 1 / rows, seen / (rows * side)))
        return cls(count + per_tile, (tile_view, whole_view), image_size)

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """The inverse of `to_dict` (a `Result` read back from JSON)."""
        views = tuple(TokenView(v["name"], tuple(v["grid"]), tuple(v["tokens"]), tuple(v["box"]),
                                tuple(map(tuple, v.get("columns", ()))), tuple(map(tuple, v.get("rows", ()))))
                      for v in data["views"])
        size = data.get("image_size")
        return cls(data["num_visual"], views, None if size is None else tuple(size))

    def to_dict(self) -> dict:
        """Plain JSON types."""
        return {"num_visual": self.num_visual, "image_size": None if self.image_size is None else list(self.image_size),
                "views": [{"name": v.name, "grid": list(v.grid), "tokens": list(v.tokens), "box": list(v.box),
                           **({"columns": [list(s) for s in v.columns], "rows": [list(s) for s in v.rows]}
                              if v.columns else {})} for v in self.views]}

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
