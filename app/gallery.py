"""The examples beside the image editor: a compact gallery of thumbnails, each card saying what it shows.

Each card is a small thumbnail of the example's image (a data URI in the page's config: no file to serve) over its
question ("what color is the square ?"), a photograph's card also naming the photograph. Clicking a card fills the
image editor, the prompt and the model, as gradio's `gr.Examples` does (the image from gradio's cache, where the
build put it). The cards are the buttons of a `gr.Dataset` in its gallery layout (`button.gallery-item`), a few per
page.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import gradio as gr
from PIL import Image

THUMB_PX = 56  # the thumbnail's longer side, in CSS pixels (drawn from an image twice that size, for sharp screens)
CARD_PX = 72  # a card's width: three cards a row in the request column at 1280 px
PER_PAGE = 6  # cards per page: two rows
CARD = ('<div style="width:{width}px;display:flex;flex-direction:column;align-items:center;gap:2px">'
        '<img src="{src}" alt="{alt}" style="width:{thumb}px;height:{thumb}px;object-fit:cover;border-radius:4px">'
        '<span style="font-size:11px;line-height:1.2;text-align:center;white-space:normal">{caption}</span></div>')


def thumbnail(path: str | Path) -> str:
    """A JPEG data URI of the image at `path`, its longer side 2 x THUMB_PX."""
    with Image.open(path) as image:
        image = image.convert("RGB")
        image.thumbnail((2 * THUMB_PX, 2 * THUMB_PX))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def caption(row: list, photo: bool) -> str:
    """What the example `row` ([image, prompt, model]) shows: its question, a photograph's name before it."""
    return f"{Path(row[0]).stem} · {row[1]}" if photo else row[1]


def card(row: list, photo: bool = False) -> str:
    """The HTML of one card: the thumbnail over the caption."""
    text = html.escape(caption(row, photo))
    return CARD.format(width=CARD_PX, thumb=THUMB_PX, src=thumbnail(row[0]), alt=text, caption=text)


def gallery(rows: list[list], label: str, elem_id: str, photo: bool = False) -> gr.Dataset:
    """The gallery of the examples `rows` ([image, prompt, model] each), PER_PAGE cards a page; `attach` its click."""
    return gr.Dataset(components=["html"], samples=[[card(row, photo)] for row in rows], type="index",
                      layout="gallery", label=label, samples_per_page=PER_PAGE, elem_id=elem_id)


def attach(dataset: gr.Dataset, rows: list[list], request: list[gr.components.Component]) -> None:
    """A click on a card of `dataset` fills `request` (the editor, the prompt and the model) with its row, the image
    as a file of gradio's cache (put there now, and kept)."""
    editor = request[0]
    cached = [editor.move_resource_to_block_cache(str(row[0])) for row in rows]
    editor.keep_in_cache.update(cached)  # never among the day-old files the page's cache drops (DELETE_CACHE)

    def fill(index: int) -> tuple:
        row = rows[index]
        return cached[index], row[1], row[2]

    dataset.click(fill, dataset, request, queue=False, show_progress="hidden", api_visibility="private")
