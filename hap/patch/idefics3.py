"""Adapter for `Idefics3ForConditionalGeneration` (SmolVLM-256M / 500M-Instruct, Idefics3) and
`SmolVLMForConditionalGeneration` (SmolVLM2): SigLIP crops plus a global view, a Llama decoder at `text_model`.

The image processor resizes the image so that its longest edge is `size.longest_edge` (2048 px for SmolVLM-256M,
1536 for SmolVLM2-2.2B; smaller images are upscaled), rounds both sides up to multiples of the crop size M (512 / 384)
and cuts that rows x cols crops, row-major; then it appends the whole image squashed to M x M, the global view. Both
the crops (a squash of the image onto a whole number of crops) and the global view cover the whole image. Each crop
gives s x s patches, pixel-shuffled by the connector into (s / scale)^2 tokens, row-major (64 per 512-px crop of
SmolVLM-256M). The prompt writes each crop as `<fake_token_around_image><row_r_col_c>` + k `<image>` ids, a "\\n"
after each row of crops, then "\\n<fake_token_around_image><global-img>" + k `<image>` + `<fake_token_around_image>`
(docs/method.md §15): the visual ids are not contiguous, the markers between them are text tokens, always kept.

Every `<image>` id is a visual token of the pruner; the budget is stated over all of them (the crops and the global
view share pixels, both compete). The layout has two views, the crop grid and the global view, each over the whole
image; an image of one crop (no split) has one. The crop grid is read from the prompt itself: k-token runs of
`<image>` ids, two marker tokens between crops of one row, more (the "\\n") between rows. Visual-token counts
depend on the image: a batch of unequal counts is refused before any work.

The decoder is the stock Llama stack (`hap.patch.decoder`), 1-D RoPE. Refused: the [CLS] cues (visionzip,
autoprune, first_cut="vision"): SigLIP has no [CLS] token.
"""

from __future__ import annotations

import torch

from ..config import HAPConfig
from ..layout import Layout, seen_share
from ..pruners import cls_user, pruner_for
from . import decoder
from .decoder import attention_outputs, decoder_of, remove_patch

__all__ = ["apply_patch", "attention_outputs", "decoder_of", "layout", "remove_patch"]

MARKERS = 2  # text tokens between two crops of one row: <fake_token_around_image><row_r_col_c>


def crop_side(model) -> int:
    """Tokens along one side of a crop: its patches per side, divided by the connector's pixel-shuffle factor."""
    vision = model.config.vision_config
    return vision.image_size // vision.patch_size // model.config.scale_factor


def runs(image: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)) of each run of consecutive True in `image` bool [T]."""
    where = image.nonzero()[:, 0].tolist()
    starts = [p for i, p in enumerate(where) if i == 0 or where[i - 1] != p - 1]
    ends = [p + 1 for i, p in enumerate(where) if i == len(where) - 1 or where[i + 1] != p + 1]
    return list(zip(starts, ends))


def crop_grid(model, ids: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of crops of the one image in `ids` long [T] ((0, 0): the global view alone), from the runs of its
    `<image>` ids: one per crop, then the global view's, each of the crop's token count, `MARKERS` tokens between two
    crops of a row and more between rows; a split image has at least 2 crops. ValueError where the prompt does not
    read that way (several images, a tokenizer writing no token for the "\\n" after a row)."""
    side = crop_side(model)
    spans = runs(ids == model.config.image_token_id)
    if not spans or any(end - start != side * side for start, end in spans):
        raise ValueError(f"{type(model).__name__}: the prompt's <image> ids are not runs of {side * side} tokens, one "
                         "per crop and one for the global view; HAP prunes prompts with exactly one image each")
    crops = len(spans) - 1
    if crops == 0:
        return 0, 0
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]  # after crop 0 .. after the last crop
    cols = next((i + 1 for i, gap in enumerate(gaps) if gap > MARKERS), len(gaps) + 1)  # the first row's end
    rows = crops // cols
    row_ends = [(i + 1) % cols == 0 for i in range(crops)]
    if crops == 1 or rows * cols != crops or any((gap > MARKERS) != end for gap, end in zip(gaps, row_ends)):
        raise ValueError(f"{type(model).__name__}: cannot read the crop grid from the prompt (gaps {gaps} between the "
                         f"<image> runs): its tokenizer must write a token for the newline after each row of crops")
    return rows, cols


def layout(model, inputs, image_size: tuple[int, int] | None = None, processor=None) -> Layout:
    """The first sample's tokens on its image: the crop grid and the global view, each over the whole image (an image
    not split, the global view alone), each token's cell its `scale_factor` x `scale_factor` patches: where the patch
    does not divide the crop (SmolVLM2-2.2B: 27 patches of 14 px see 378 of 384 px) the end of every crop lies in
    no cell."""
    side, vision = crop_side(model), model.config.vision_config
    seen = seen_share(vision.image_size, vision.patch_size * model.config.scale_factor)
    rows, cols = crop_grid(model, inputs["input_ids"][0])
    if rows == 0:
        return Layout.grid(side, side, image_size, name="global view (the whole image)", seen=seen)
    return Layout.tiled(rows, cols, side, image_size, f"crops ({rows} x {cols})",
                        "global view (the whole image squashed to one crop)", seen=seen)


def apply_patch(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
                tail: int | None = None, lead: int = 0) -> decoder.Patch:
    """`decoder.apply_patch`, each crop (and the global view) a view of its own (`decoder.square_blocks`); the [CLS]
    cues are refused."""
    if pruner_for(config).needs_cls:
        raise ValueError(f"{cls_user(config)} needs a [CLS] token: the "
                         f"{type(model).__name__} vision tower (SigLIP) has none, and each crop and the global view "
                         "is encoded on its own")
    return decoder.apply_patch(model, config, trace, priority, tail, lead=lead,
                               view_grids=decoder.square_blocks(model, crop_side(model)))
