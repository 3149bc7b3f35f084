"""Picking the head lab's plan by clicking: the head picker (a layer x head grid drawn as an image, one cell per
query head) and the sink-token picker (the image as the model's visual grid covers it). A click on either toggles
one entry of the plan JSON, which stays the one value a run reads (`app.lab`, `hap.lab.plan.Plan`).

Both pictures are plain rasters (`gr.Image`: its `.select` event reports the clicked pixel in the picture's own
pixels), so a click maps to a cell by arithmetic alone: `head_at` and `token_at` are the inverses of `head_picker`
and `token_picker`.
"""

from __future__ import annotations

import json

import numpy as np
from PIL import Image, ImageDraw

from hap import views
from hap.lab.plan import Plan

PICKER_PX = 384  # the head picker's longest side of cells, about
MARGIN = 22  # head picker: pixels left of and above the cells, for the layer and head numbers
MISSED = "#e377c2"  # a planted head the classifier did not put in its planted class
PLANTED_MARK = "#000000"  # a planted head (found, or before a run)
TOKEN_TINT = np.array([215, 0, 0])  # the sink tokens' patches, tinted half-way to this
GRID_LINE = 0.6  # brightness kept on the token grid's lines


def cell_px(shape: tuple[int, int]) -> int:
    """Side in pixels of one cell of the head picker of `shape` = (layers, heads)."""
    return max(8, PICKER_PX // max(shape))


def head_at(x: int, y: int, shape: tuple[int, int]) -> tuple[int, int] | None:
    """The (layer, head) of the head picker's cell under pixel (x, y), None on the margins or outside."""
    cell = cell_px(shape)
    layer, head = (y - MARGIN) // cell, (x - MARGIN) // cell
    if x < MARGIN or y < MARGIN or not (0 <= layer < shape[0] and 0 <= head < shape[1]):
        return None
    return int(layer), int(head)


def token_at(x: int, y: int, size: tuple[int, int], grid: tuple[int, int], visual: int) -> int:
    """The visual-token index (row-major over `grid` = (rows, cols)) under pixel (x, y) of a picture of `size` =
    (width, height) that the grid covers; ValueError where the model's `visual` tokens do not form that grid."""
    rows, cols = grid
    if rows * cols != visual:
        raise ValueError(f"this model's {visual} visual tokens do not map to a {rows} x {cols} grid over the image: "
                         "type the sink tokens' indices in the plan instead")
    width, height = size
    row, col = min(rows - 1, max(0, y * rows // height)), min(cols - 1, max(0, x * cols // width))
    return int(row * cols + col)


def toggle_head(plan: Plan, head: tuple[int, int], kind: str) -> Plan:
    """`plan` with `head` planted as `kind` ("sink" or "dispersed"), or unplanted if it already was one."""
    sink, dispersed = [h for h in plan.sink if h != head], [h for h in plan.dispersed if h != head]
    if head not in getattr(plan, kind):
        (sink if kind == "sink" else dispersed).append(head)
    return Plan.of(sink, dispersed, plan.sink_tokens, plan.strength, plan.massive)


def toggle_token(plan: Plan, token: int) -> Plan:
    """`plan` with `token` added to its sink tokens, or removed (none left: the default, None); a count of tokens per
    image is replaced by the token clicked."""
    tokens = set(chosen_tokens(plan) or ()) ^ {token}
    return Plan.of(plan.sink, plan.dispersed, sorted(tokens) or None, plan.strength, plan.massive)


def chosen_tokens(plan: Plan) -> tuple[int, ...] | None:
    """The plan's sink tokens where it names them, None where each image's are chosen (the default or a count)."""
    return None if isinstance(plan.sink_tokens, int) else plan.sink_tokens


def plan_text(plan: Plan) -> str:
    """The plan as the JSON box shows it."""
    return json.dumps(plan.to_json())


def head_picker(shape: tuple[int, int], plan: Plan, head_class: list[list[str]] | None = None,
                report: dict | None = None) -> np.ndarray:
    """The head picker `[height, width, 3]` uint8: a cell per (layer, head), layer 0 on top, coloured by the run's
    class (`views.CLASS_COLORS`; grey without a run); planted sinks crossed (x), planted dispersed heads ringed (o),
    black where the classifier found them (`report`: `classifier_report`) or before a run, pink where it missed."""
    layers, heads = shape
    cell = cell_px(shape)
    picture = Image.new("RGB", (MARGIN + heads * cell + 1, MARGIN + layers * cell + 1), "white")
    draw = ImageDraw.Draw(picture)
    step = 1 if max(shape) <= 16 else 4
    for layer in range(layers):
        for head in range(heads):
            kind = head_class[layer][head] if head_class else ""
            box = (MARGIN + head * cell, MARGIN + layer * cell, MARGIN + (head + 1) * cell, MARGIN + (layer + 1) * cell)
            draw.rectangle(box, fill=views.CLASS_COLORS[views.CLASSES.index(kind)], outline="white")
    for i in range(0, max(shape), step):
        if i < heads:
            draw.text((MARGIN + i * cell + 2, 4), str(i), fill="black")
        if i < layers:
            draw.text((2, MARGIN + i * cell + 2), str(i), fill="black")
    missed = {tuple(h) for kind in ("sink", "dispersed") for h in (report or {}).get(kind, {}).get("missed", ())}
    pad = max(2, cell // 5)
    for kind, heads_of in (("sink", plan.sink), ("dispersed", plan.dispersed)):
        for layer, head in heads_of:
            color = MISSED if (layer, head) in missed else PLANTED_MARK
            x0, y0 = MARGIN + head * cell + pad, MARGIN + layer * cell + pad
            x1, y1 = x0 + cell - 2 * pad, y0 + cell - 2 * pad
            if kind == "sink":
                draw.line((x0, y0, x1, y1), fill=color, width=max(2, cell // 8))
                draw.line((x0, y1, x1, y0), fill=color, width=max(2, cell // 8))
            else:
                draw.ellipse((x0, y0, x1, y1), outline=color, width=max(2, cell // 8))
    return np.asarray(picture)


def token_picker(view: np.ndarray, grid: tuple[int, int], tokens: tuple[int, ...] | None) -> np.ndarray:
    """The sink-token picker `[height, width, 3]` uint8: `view` (the image as the visual grid covers it) with the
    grid's lines and the patches of `tokens` (visual-token indices) tinted red."""
    rows, cols = grid
    h, w = view.shape[:2]
    row_of, col_of = np.arange(h) * rows // h, np.arange(w) * cols // w  # [h], [w]
    chosen = np.zeros(rows * cols, dtype=bool)
    chosen[list(tokens or ())] = True
    mask = chosen.reshape(grid)[row_of][:, col_of]  # [h, w]
    out = np.where(mask[..., None], (view + TOKEN_TINT) / 2, view).astype(float)
    lines = np.zeros((h, w), dtype=bool)
    lines[np.flatnonzero(np.diff(row_of)) + 1, :] = True
    lines[:, np.flatnonzero(np.diff(col_of)) + 1] = True
    out[lines] *= GRID_LINE
    return out.astype(np.uint8)
