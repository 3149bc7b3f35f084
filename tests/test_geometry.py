"""Token boxes at the real checkpoints' image settings (issue 45, docs/method.md §15).

`REAL` holds each allow-listed checkpoint's image settings; `BUILD` builds, per distinct setting, a processor with
those settings and a model with a tiny decoder and a tiny-width tower of the real tile and patch sizes (the builders
of tests/tiny_zoo*.py). The dot test draws small coloured marks (one colour each, on grey) at corners, the image's
centre and tile / crop edges of images of three aspect ratios, and finds the token that sees each mark WITHOUT the
layout under test: the mark's colour in the processor's own `pixel_values`, then its tile and patch, then the token by
the family's token order (for LLaVA-NeXT / OneVision the model's own `pack_image_features` run on a one-hot feature).
That token's box, in the layout a `Result` carries (`to_dict` / `from_dict`) and on the panel the views draw, must
hold the mark within half a token cell; a mark a tile's patches never see (the last 6 px of a 384-px SigLIP tile)
lies in no cell of that view, and a mark in no tile at all (cut away by LLaVA-1.5's centre crop) in no cell of any
view. Real-size images make processors slow: the largest grids run as `slow`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config, SiglipVisionConfig)
from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
from transformers.image_utils import ChannelDimension, PILImageResampling
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

import hap
from analysis.training.tiny_vlm import CHAT_TEMPLATE, build_qwen_processor, build_tokenizer
from hap.layout import WHOLE, Layout, seen_share
from hap.patch import layout
from hap.patch.llava import input_box
from hap.patch.llava_next import tiling
from hap.runs.run import chat_prompt
from hap.views import VIEW_PIXELS, ViewData, model_view, single_view, view_image
from tiny_models import qwen_vl_model
from tiny_zoo import VISION, _text, llava_next, llava_onevision
from tiny_zoo_more import idefics3, internvl
from tiny_zoo_recent import gemma3, qwen3_vl

CLIP = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])  # OPENAI_CLIP_MEAN / STD
HALF = ([0.5] * 3, [0.5] * 3)
IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


@dataclass(frozen=True)
class Real:
    """One checkpoint's image settings (pixels; `merge`: tokens pool or pixel-shuffle merge x merge patches)."""

    build: str  # the `BUILD` entry with these settings
    tile: int | None  # tile / crop / whole-image side the tower sees (None: dynamic, Qwen's smart resize)
    patch: int
    merge: int
    grid: str  # pinpoints, max tiles or crops
    longest: int | None  # longest edge the image is resized to first (SmolVLM / Idefics3)
    tokens: int | None  # visual tokens per tile, crop or image (None: dynamic)
    resample: PILImageResampling
    norm: tuple[list[float], list[float]]  # mean, std


BICUBIC, BILINEAR, LANCZOS = PILImageResampling.BICUBIC, PILImageResampling.BILINEAR, PILImageResampling.LANCZOS
# Sources: N = /work/shared/notes/real-processor-settings.md (values from the checkpoints' public
# preprocessor_config.json / processor_config.json copies and model cards); C = a public copy of the checkpoint's
# preprocessor_config.json seen with the search tool for this table; D = transformers 5.24's processor class defaults
# (the PIL image processors); Z = /work/shared/notes/model-zoo.md §8 (config copies). Where the checkpoint's value is
# null (Gemma 3's pan-and-scan), the processor's default is what runs.
REAL = {
    # N; C (a public copy, mohitsha/llava-1.5-7b-hf: shortest edge 336, centre crop 336 x 336, resample 3 =
    # bicubic, CLIP mean / std; config: CLIP-L/14 of 336 px, feature layer -2, strategy default: [CLS] dropped)
    "llava-hf/llava-1.5-7b-hf": Real("llava-clip", 336, 14, 1, "one view (centre crop)", None, 576, BICUBIC, CLIP),
    # N (SigLIP-so400m/14-384, 729 tokens, strategy full); 0.5 / 0.5 and bicubic: N, as OneVision's tower
    "llava-hf/llava-interleave-qwen-0.5b-hf": Real("llava-siglip", 384, 14, 1, "one view", None, 729, BICUBIC, HALF),
    # N, Z (pinpoints); D (LlavaNextImageProcessor: bicubic, CLIP mean / std)
    "llava-hf/llava-v1.6-vicuna-7b-hf": Real("llava-next", 336, 14, 1, "5 pinpoints", None, 576, BICUBIC, CLIP),
    "llava-hf/llava-v1.6-mistral-7b-hf": Real("llava-next", 336, 14, 1, "5 pinpoints", None, 576, BICUBIC, CLIP),
    # N (384 tiles, 27 x 27 = 729, pinpoints a x b of 384, a, b in 1..6, anyres_max_9, bicubic, 0.5 / 0.5)
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": Real("onevision", 384, 14, 1, "6 x 6 pinpoints", None, 729, BICUBIC,
                                                      HALF),
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": Real("onevision", 384, 14, 1, "6 x 6 pinpoints", None, 729, BICUBIC,
                                                    HALF),
    # N, C (patch 14, merge 2, min / max pixels 3136 / 12845056, CLIP mean / std); bicubic: D (Qwen2VLImageProcessor)
    "Qwen/Qwen2-VL-2B-Instruct": Real("qwen2-vl", None, 14, 2, "min / max pixels", None, None, BICUBIC, CLIP),
    # N, C (patch 16, merge 2, 65,536..16,777,216 px, 0.5 / 0.5); bicubic: N, D
    "Qwen/Qwen3-VL-2B-Instruct": Real("qwen3-vl", None, 16, 2, "min / max pixels", None, None, BICUBIC, HALF),
    "Qwen/Qwen3-VL-8B-Instruct": Real("qwen3-vl", None, 16, 2, "min / max pixels", None, None, BICUBIC, HALF),
    # N (896 px, 14-px patches, pooled 4 x 4 -> 256); C (896, resample 2 = bilinear, 0.5 / 0.5, pan-and-scan null)
    "google/gemma-3-4b-it": Real("gemma3", 896, 14, 4, "pan-and-scan off", None, 256, BILINEAR, HALF),
    "google/gemma-3-12b-it": Real("gemma3", 896, 14, 4, "pan-and-scan off", None, 256, BILINEAR, HALF),
    # N (448 tiles, pixel shuffle 0.5, 256 per tile, 1..12 tiles + thumbnail, bicubic, ImageNet mean / std)
    "OpenGVLab/InternVL3-1B-hf": Real("internvl", 448, 14, 2, "1..12 tiles + thumbnail", None, 256, BICUBIC,
                                      IMAGENET),
    "OpenGVLab/InternVL3-8B-hf": Real("internvl", 448, 14, 2, "1..12 tiles + thumbnail", None, 256, BICUBIC,
                                      IMAGENET),
    # N, Z (512 crops, SigLIP-B/16-512, shuffle 4, 64 per crop); C (longest edge 2048, max_image_size 512,
    # resample 1 = Lanczos, 0.5 / 0.5)
    "HuggingFaceTB/SmolVLM-256M-Instruct": Real("smolvlm", 512, 16, 4, "up to 4 x 4 crops + global", 2048, 64,
                                                LANCZOS, HALF),
    # Z (384 crops, SigLIP-so400m/14, shuffle 3 -> 81 per crop, longest edge 1536); Lanczos, 0.5 / 0.5: N (Idefics3)
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": Real("smolvlm2", 384, 14, 3, "up to 4 x 4 crops + global", 1536, 81,
                                                 LANCZOS, HALF),
}
PAN_AND_SCAN = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                    pan_and_scan_min_ratio_to_activate=1.2)  # Gemma3Processor's defaults (N), switched on
VARIANTS = {  # a case -> (its `BUILD` entry, processor-call settings): options off their defaults (Gemma3Processor's
    # own defaults win over the image processor's attributes, so pan-and-scan is asked for per call)
    "gemma3-pan-and-scan": ("gemma3", PAN_AND_SCAN),
    "internvl-max-4-tiles": ("internvl", dict(max_patches=4)),
    "smolvlm-longest-1024": ("smolvlm", dict(size={"longest_edge": 1024})),
    "qwen3-vl-max-262144-px": ("qwen3-vl", dict(size={"shortest_edge": 65536, "longest_edge": 262144})),
}


def settings(name: str) -> Real:
    """The `REAL` row of a `BUILD` entry (the same for every checkpoint sharing it)."""
    return next(r for r in REAL.values() if r.build == name)


def image_kwargs(name: str) -> dict:
    """The resampling and normalisation of a `BUILD` entry, as image-processor settings."""
    real = settings(name)
    return dict(resample=real.resample, image_mean=real.norm[0], image_std=real.norm[1])


def llava_siglip():
    """LLaVA-interleave's image path in small: a 384-px SigLIP of 14-px patches (27 x 27 = 729 tokens, strategy
    "full"), the image squashed to 384 x 384, a one-layer Qwen2 decoder."""
    image_processor = SiglipImageProcessorPil(size={"height": 384, "width": 384}, **image_kwargs("llava-siglip"))
    return llava(image_processor, SiglipVisionConfig(**{**VISION, "image_size": 384}), Qwen2Config, "full", -1, 729)


def llava_clip():
    """LLaVA-1.5's image path in small: the shortest edge resized to 336 px and the centre 336 x 336 cropped, a CLIP
    of 14-px patches (24 x 24 = 576 tokens, [CLS] dropped, feature layer -2), a one-layer Llama decoder."""
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                            **image_kwargs("llava-clip"))
    return llava(image_processor, CLIPVisionConfig(**{**VISION, "image_size": 336}),
                 LlamaConfig, "default", -2, 576)


def llava(image_processor, vision, text, strategy: str, feature_layer: int, tokens: int):
    """(model, processor): a `LlavaForConditionalGeneration` of the `vision` tower config, a one-layer `text` decoder
    and feature `strategy` / layer, its `tokens` image tokens expanded by a `LlavaProcessor` over `image_processor`."""
    tok = build_tokenizer()
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=vision.patch_size,
                               vision_feature_select_strategy=strategy,
                               num_additional_image_tokens=int(strategy == "default"), chat_template=CHAT_TEMPLATE)
    config = LlavaConfig(vision_config=vision, text_config=_text(text, tok, 1), image_token_index=tok.image_token_id,
                         vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                         image_seq_length=tokens)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval(), processor


def qwen2_vl():
    """Qwen2-VL-2B's image path (14-px patches merged 2 x 2, 3136..12845056 px) with a tiny Qwen2-VL."""
    processor, ids = build_qwen_processor(28, "Qwen2VLForConditionalGeneration",
                                          dict(min_pixels=3136, max_pixels=12845056, **image_kwargs("qwen2-vl")))
    tok = processor.tokenizer
    return qwen_vl_model(1, "2", ids, len(tok), dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                                      eos_token_id=tok.eos_token_id)), processor


BUILD = {  # name -> () -> (model, processor) at the real image settings, tiny decoder and tiny-width tower
    "llava-clip": llava_clip,
    "llava-siglip": llava_siglip,
    "llava-next": lambda: llava_next(layers=1, tile=336, pinpoints=NEXT_PINPOINTS, image=image_kwargs("llava-next")),
    "onevision": lambda: llava_onevision(layers=1, tile=384, image=image_kwargs("onevision")),
    "qwen2-vl": qwen2_vl,
    "qwen3-vl": lambda: qwen3_vl(layers=1, min_pixels=65536, max_pixels=16777216, image=image_kwargs("qwen3-vl")),
    "gemma3": lambda: gemma3(layers=1, tokens=256, image_size=896, image=image_kwargs("gemma3")),
    "internvl": lambda: internvl(layers=1, tile=448, max_patches=12, image=image_kwargs("internvl")),
    "smolvlm": lambda: idefics3(layers=1, crop=512, patch=16, scale=4, longest=2048, image=image_kwargs("smolvlm")),
    "smolvlm2": lambda: idefics3(layers=1, smolvlm=True, crop=384, patch=14, scale=3, longest=1536,
                                 image=image_kwargs("smolvlm2")),
}
_BUILT: dict = {}


def built(name: str):
    """`BUILD[name]()`, once per test session."""
    if name not in _BUILT:
        _BUILT[name] = BUILD[name]()
    return _BUILT[name]


# --- the marks ------------------------------------------------------------------------------------------------------
GREY, MARK = 128, 8  # background level; a mark's side in pixels
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (255, 255, 0), (255, 0, 255),
           (0, 255, 255)]  # one per mark, told apart by which channels sit above or below the grey (no black: padding)
SEEN = 40  # a colour's signature (its channels' least departure from grey, 0..127) that counts as the mark


def signature(pixels: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """[..., 3] RGB 0..255 -> [...]: how far every channel departs from the grey in the direction of `colour`, the
    least of the three (positive only where the pixel leans towards the colour in every channel)."""
    signs = np.where(np.asarray(colour) > GREY, 1.0, -1.0)
    return ((np.asarray(pixels, float) - GREY) * signs).min(-1)


def marked(size: tuple[int, int], centres: list[tuple[float, float]]) -> Image.Image:
    """A grey image of `size` = (width, height) with a MARK-px square of `COLOURS[i]` centred on `centres[i]`."""
    image = Image.new("RGB", size, (GREY,) * 3)
    draw = ImageDraw.Draw(image)
    for (x, y), colour in zip(centres, COLOURS):
        draw.rectangle([round(x - MARK / 2), round(y - MARK / 2), round(x + MARK / 2) - 1, round(y + MARK / 2) - 1],
                       fill=colour)
    return image


def find(pixels: np.ndarray, colour) -> tuple[float, float, float] | None:
    """(x, y) centre of `colour`'s mark in `pixels` [h, w, 3] (the signature-weighted centroid of its pixels above
    half its peak) and the peak; None where it does not show."""
    sig = signature(pixels, colour)
    peak = sig.max()
    if peak < SEEN:
        return None
    ys, xs = np.nonzero(sig >= peak / 2)
    weight = sig[ys, xs]
    return float((xs + 0.5) @ weight / weight.sum()), float((ys + 0.5) @ weight / weight.sum()), float(peak)


def centres(name: str, size: tuple[int, int], call: dict) -> list[tuple[float, float]]:
    """Where the marks go on an image of `size` = (width, height): near two corners, at the centre, then on both sides
    of the family's tile or crop edges (computed here only to place marks; the truth comes from `pixel_values`)."""
    width, height = size
    xs, ys = edges(name, size, call)
    spots = [(MARK, MARK), (width - MARK / 2 - 1, height - MARK / 2 - 1), (width / 2 + 17, height / 2 - 23)]
    for i, x in enumerate(xs[:3]):
        spots.append((x - 3, height * (0.2 + 0.25 * i)))
        spots.append((x + 4, height * (0.33 + 0.25 * i)))
    for i, y in enumerate(ys[:2]):
        spots.append((width * (0.15 + 0.3 * i), y - 3))
    return [(min(max(x, MARK), width - MARK), min(max(y, MARK), height - MARK)) for x, y in spots][:len(COLOURS)]


def edges(name: str, size: tuple[int, int], call: dict) -> tuple[list[float], list[float]]:
    """x and y (pixels of the image) of the family's tile or crop edges (processor-call settings `call`), inner ones
    first."""
    width, height = size
    real = settings(name)
    if name in ("llava-next", "onevision"):
        pinpoints = NEXT_PINPOINTS if name == "llava-next" else [[384 * a, 384 * b] for a in range(1, 7)
                                                                  for b in range(1, 7)]
        best_h, best_w = select_best_resolution((height, width), pinpoints)
        new_h, new_w = get_patch_output_size(np.zeros((1, height, width)), (best_h, best_w), ChannelDimension.FIRST)
        seen = real.tile // real.patch * real.patch  # the far end of each tile's seen pixels
        x = [((k * real.tile) - (best_w - new_w) // 2) * width / new_w for k in range(1, best_w // real.tile)]
        x += [((k * real.tile + seen) - (best_w - new_w) // 2) * width / new_w for k in range(best_w // real.tile)]
        y = [((k * real.tile) - (best_h - new_h) // 2) * height / new_h for k in range(1, best_h // real.tile)]
        return [v for v in x if 0 < v < width], [v for v in y if 0 < v < height]
    if name == "llava-clip":  # the centre crop's two edges per axis (the shortest edge resized to the tile)
        scale = real.tile / min(size)
        x, y = ([(side * scale - real.tile) // 2 / scale + k * real.tile / scale for k in (0, 1)] for side in size)
        return [v for v in x if 0 < v < width], [v for v in y if 0 < v < height]
    if name == "internvl":
        cols, rows = get_optimal_tiled_canvas((height, width), (448, 448), 1, call.get("max_patches", 12))
    elif name in ("smolvlm", "smolvlm2"):
        scale = call.get("size", {}).get("longest_edge", real.longest) / max(size)
        cols, rows = math.ceil(width * scale / real.tile), math.ceil(height * scale / real.tile)
    elif call.get("do_pan_and_scan"):
        crops = len(built(name)[1].image_processor.pan_and_scan(np.zeros((3, height, width)), 256, 4, 1.2))
        cols, rows = (crops or 1, 1) if width >= height else (1, crops or 1)
    else:
        return [], []
    whole = bool(call.get("do_pan_and_scan"))  # crops of ceil(side / crops) px; the others squash onto whole tiles
    step_x, step_y = (math.ceil(width / cols), math.ceil(height / rows)) if whole else (width / cols, height / rows)
    return [k * step_x for k in range(1, cols)], [k * step_y for k in range(1, rows)]


# --- the truth, from the processor's output -------------------------------------------------------------------------
@dataclass(frozen=True)
class Sighting:
    """Mark `mark` shows in a tile of view `view` (an index into the layout's views); the patch under its centre there
    feeds visual token `token` (None: no patch sees those pixels); `edge`: that centre lies within a patch of the
    tile's edge; `mixed`: the token takes only part of that patch (OneVision's bilinear shrink)."""

    mark: int
    view: int
    token: int | None
    edge: bool
    mixed: bool = False


def unnormalised(pixels: torch.Tensor, processor) -> np.ndarray:
    """[..., 3, h, w] normalised -> [..., h, w, 3] 0..255."""
    ip = processor.image_processor
    mean, std = np.asarray(ip.image_mean), np.asarray(ip.image_std)
    return (np.moveaxis(pixels.float().numpy(), -3, -1) * std + mean) * 255


def sightings(name: str, model, processor, batch, marks: int) -> list[Sighting]:
    """Every tile of `batch["pixel_values"]` in which each of the first `marks` marks shows, with the token whose
    patch holds the mark's centre there, by the family's token order (never by the layout)."""
    if name in ("qwen2-vl", "qwen3-vl"):
        return qwen_sightings(model, processor, batch, marks)
    real = settings(name)
    pv = batch["pixel_values"]
    tiles = unnormalised(pv.reshape(-1, *pv.shape[-3:]), processor)  # [tiles, h, w, 3]
    side = real.tile // real.patch  # patches per tile side
    out = []
    for k, tile in enumerate(tiles):
        for m in range(marks):
            found = find(tile, COLOURS[m])
            if found is None:
                continue
            x, y, _ = found
            pr, pc = int(y // real.patch), int(x // real.patch)
            edge = min(x, y, real.tile - x, real.tile - y) < real.patch
            view, token, mixed = tile_token(name, model, batch, k, len(tiles), pr, pc) if max(pr, pc) < side else (
                tile_view(name, k, len(tiles)), None, False)
            out.append(Sighting(m, view, token, edge, mixed))
    return out


def tile_view(name: str, k: int, tiles: int) -> int:
    """The view tile `k` of `tiles` belongs to: LLaVA-NeXT / OneVision base view first, then the tiles; InternVL /
    SmolVLM tiles first, then the thumbnail / global view; Gemma 3 the whole image, then one view per crop."""
    if name in ("llava-next", "onevision"):
        return min(k, 1)
    if name in ("internvl", "smolvlm", "smolvlm2"):
        return int(k == tiles - 1 and tiles > 1)
    return k  # LLaVA (one view), Gemma 3


def tile_token(name: str, model, batch, k: int, tiles: int, pr: int, pc: int) -> tuple[int, int | None, bool]:
    """(view, visual token, whether it takes only part of the patch) fed by patch (pr, pc) of tile `k` (None: none,
    a row or column the unpadding cuts although it holds some of the image): LLaVA-NeXT / OneVision by the model's own
    `pack_image_features` on a one-hot feature (unpadding and OneVision's bilinear shrink included: the token taking
    the most of it); else tiles in order, each `side` x `side` tokens row-major, a token pooling / shuffling `merge`
    x `merge` patches (Gemma 3's pooling, InternVL's and SmolVLM's pixel shuffle)."""
    real = settings(name)
    side = real.tile // real.patch
    if name in ("llava-next", "onevision"):
        features = torch.zeros(tiles, side * side, 1)
        features[k, pr * side + pc] = 1
        extra = dict(vision_feature_select_strategy="default") if name == "llava-next" else dict(
            vision_aspect_ratio=model.config.vision_aspect_ratio)
        packed = model.model.pack_image_features([features], batch["image_sizes"], image_newline=None, **extra)[0][0]
        token = int(packed[:, 0].argmax()) if packed.max() > 0 else None  # None: unpadded
        return tile_view(name, k, tiles), token, bool(packed.max() < 1)
    per = side // real.merge
    return tile_view(name, k, tiles), k * per * per + pr // real.merge * per + pc // real.merge, False


def qwen_sightings(model, processor, batch, marks: int) -> list[Sighting]:
    """Qwen-VL: `pixel_values` [patches, 3 * 2 * p * p] holds the patches merge block by merge block (each block's
    merge x merge patches row-major), one token per block, blocks row-major: the patch showing the mark most feeds
    token patch // merge^2."""
    vision = model.config.vision_config
    p, t, merge = vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
    patches = batch["pixel_values"].reshape(-1, 3, t, p, p)[:, :, 0]  # [patches, 3, p, p], the first frame
    pixels = unnormalised(patches, processor)
    out = []
    for m in range(marks):
        peak = signature(pixels, COLOURS[m]).reshape(len(pixels), -1).max(1)
        if peak.max() >= SEEN:
            out.append(Sighting(m, 0, int(peak.argmax()) // merge ** 2, False))
    return out


# --- the checks -----------------------------------------------------------------------------------------------------
SIZES = [(1000, 600), (600, 1400), (2000, 2000)]  # (width, height)
WIDE = (2400, 600)  # Gemma 3 pan-and-scan's 4 crops
FOUR_BY_THREE = (1600, 1200)  # InternVL's 12 tiles (4 x 3, the closest grid of at most 12 to 4:3)
CASES = [(name, size) for name in BUILD for size in SIZES] + [("internvl", FOUR_BY_THREE)]
CASES += [("gemma3-pan-and-scan", size) for size in [*SIZES[:2], WIDE]] + [("internvl-max-4-tiles", SIZES[0]),
                                                                          ("smolvlm-longest-1024", SIZES[1]),
                                                                          ("qwen3-vl-max-262144-px", SIZES[2])]
LARGEST = {  # the largest grids (and the variants' smaller ones), and the views they must give
    ("smolvlm", (2000, 2000)): ("crops (4 x 4)", "global view (the whole image squashed to one crop)"),
    ("internvl", FOUR_BY_THREE): ("tiles (3 x 4)", "thumbnail (the whole image squashed to one tile)"),
    ("onevision", (2000, 2000)): ("base view (the whole image squashed to one tile)", "tiles (6 x 6, unpadded)"),
    ("gemma3-pan-and-scan", WIDE): ("whole image", "crop 1", "crop 2", "crop 3", "crop 4"),
    ("internvl-max-4-tiles", SIZES[0]): ("tiles (1 x 2)", "thumbnail (the whole image squashed to one tile)"),
    ("smolvlm-longest-1024", SIZES[1]): ("crops (2 x 1)", "global view (the whole image squashed to one crop)"),
}
HEAVY = {("onevision", (2000, 2000)), ("internvl", (600, 1400)), ("internvl", FOUR_BY_THREE), ("smolvlm", (2000, 2000)),
         ("smolvlm2", (2000, 2000)), ("smolvlm", (1000, 600)), ("smolvlm", (600, 1400))}


def panel(where: Layout, image: Image.Image, view: int, size: int = 1024) -> np.ndarray:
    """The panel the views draw for `view` (`hap.views.ViewData.from_result`), `size` px on its longer side (larger
    than the page's, so that an 8-px mark of a 2000-px image stays visible): the view's cells laid out equally; one
    view over the whole image: the image squashed (`model_view`)."""
    v = where.views[view]
    if single_view(where):
        return model_view(image, size=size)
    return view_image(image, v.box, v.grid, size, spans=v.spans())


@pytest.mark.parametrize("name,size", [pytest.param(*case, marks=[pytest.mark.slow] * (case in HEAVY),
                                                    id=f"{case[0]}-{case[1][0]}x{case[1][1]}") for case in CASES])
def test_every_mark_lies_in_the_box_of_the_token_that_sees_it(name, size):
    case, (name, call) = name, VARIANTS.get(name, (name, {}))
    model, processor = built(name)
    spots = centres(name, size, call)
    image = marked(size, spots)
    batch = processor(images=image, text=chat_prompt(processor, "what"), return_tensors="pt", **call)
    where = Layout.from_dict(layout(model, batch, image.size, processor).to_dict())  # as a `Result` carries it
    where.check()
    assert [v.name for v in where.views][:len(LARGEST.get((case, size), ()))] == list(LARGEST.get((case, size), ()))
    boxes, width, height = where.boxes(), *size
    seen = sightings(name, model, processor, batch, len(spots))
    assert {s.view for s in seen} == set(range(len(where.views)))  # every view's panel is checked
    if name not in ("llava-siglip", "qwen2-vl", "qwen3-vl", "gemma3"):
        assert any(s.edge for s in seen)  # marks at tile / crop edges
    panels, shrunk = {}, {s.view for s in seen if s.mixed}
    for s in seen:
        mx, my = spots[s.mark]
        v = where.views[s.view]
        cells = v.cell_boxes() * [width, height, width, height]
        if s.token is None:  # no patch there sees it: no cell holds it deeper than the mark's own half side (but in a
            inside = depth(cells, mx, my)
            assert s.view in shrunk or (inside <= MARK / 2 + 1).all(), (name, size, s, inside.max())  # shrunk grid,
            continue  # whose tokens mixing two tiles' patches span the unseen strip between them)
        x0, y0, x1, y1 = boxes[s.token] * [width, height, width, height]
        half_x, half_y = (x1 - x0) / 2, (y1 - y0) / 2
        assert x0 - half_x <= mx <= x1 + half_x and y0 - half_y <= my <= y1 + half_y, (name, size, s, (mx, my),
                                                                                        (x0, y0, x1, y1))
        if s.view not in panels:
            panels[s.view] = panel(where, image, s.view)
        drawn = find(panels[s.view], COLOURS[s.mark])
        assert drawn is not None, (name, size, s)
        rows, cols = v.grid
        r, c = divmod(v.tokens.index(s.token), cols)
        u, w = drawn[0] * cols / panels[s.view].shape[1], drawn[1] * rows / panels[s.view].shape[0]
        assert c - 0.5 <= u <= c + 1.5 and r - 0.5 <= w <= r + 1.5, (name, size, s, (u, w), (r, c))
    unseen = sorted(set(range(len(spots))) - {s.mark for s in seen})  # in no tile: cropped away (LLaVA-1.5)
    for m in unseen:  # lies in no cell of any view
        inside = depth(boxes * [width, height, width, height], *spots[m])
        assert (inside <= MARK / 2 + 1).all(), (name, size, m, spots[m], inside.max())
    assert bool(unseen) == (name == "llava-clip" and width != height), (name, size, unseen)


def depth(cells: np.ndarray, x: float, y: float) -> np.ndarray:
    """float [cells]: how deep the point (x, y) lies inside each of `cells` [cells, 4] (x0, y0, x1, y1), negative
    outside."""
    return np.minimum.reduce([x - cells[:, 0], cells[:, 2] - x, y - cells[:, 1], cells[:, 3] - y])


@pytest.mark.parametrize("name", ["llava-next", "onevision"])
def test_the_unpadded_grid_counts_what_the_processor_counts(name):
    """LLaVA-NeXT / OneVision: the tokens `tiling` packs equal the processor's count on a sweep of aspect ratios
    (the unpadded size by the model's own `unpad_image`; 600 x 1400 once differed by a row: 784 against 785 px)."""
    model, processor = built(name)
    sizes = [(h, w) for h in range(300, 2401, 137) for w in range(300, 2401, 211)] + [(1400, 600), (600, 1400)]
    counts = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [tiling(model, h, w).tokens for h, w in sizes] == counts


def test_the_table_is_what_the_tests_build():
    """Each `BUILD` entry's model and processor carry its `REAL` row: tile, patch, merge, tokens per tile, resampling
    and normalisation."""
    for name in BUILD:
        real, (model, processor) = settings(name), built(name)
        vision = model.config.vision_config
        assert np.all(np.asarray(vision.patch_size) == real.patch), name
        ip = processor.image_processor
        assert (ip.resample, list(ip.image_mean), list(ip.image_std)) == (real.resample, *real.norm), name
        if real.tile is not None:
            size = vision.image_size
            assert (size[0] if isinstance(size, (list, tuple)) else size) == real.tile, name
        if real.tokens is not None and name not in ("llava-next", "onevision", "llava-siglip"):
            per = getattr(model.config, "mm_tokens_per_image", None) or (real.tile // real.patch // real.merge) ** 2
            assert per == real.tokens, name


@pytest.mark.parametrize("name", ["llava-clip", "llava-siglip", "onevision", "smolvlm2"])
def test_a_run_carries_this_layout_and_draws_these_panels(name):
    """`hap.run`'s `Result.layout` is the layout checked above, and `ViewData.from_result` draws each view's panel as
    `panel` does (LLaVA-1.5's centre crop of a non-square image, the families whose tiles end in an unseen strip)."""
    model, processor = built(name)
    size = (420, 380)  # one OneVision tile: a prompt within the tiny decoder's 2048 positions
    image = marked(size, centres(name, size, {}))
    result = hap.run(model, processor, image, "what", hap.HAPConfig(retain=0.5, groups=1), max_new_tokens=1)
    batch = processor(images=image, text=result.prompt_text, return_tensors="pt")
    assert result.layout == layout(model, batch, image.size, processor).to_dict()
    where, data = Layout.from_dict(result.layout), ViewData.from_result(result, image)
    assert len(data.view_images) == len(where.views)
    for i, drawn in enumerate(data.view_images):
        assert np.array_equal(drawn, panel(where, image, i, VIEW_PIXELS))


def test_spans_survive_json_and_leave_each_tiles_unseen_end_out():
    """A 384-px tile of 14-px patches: 27 cells end at 378 / 384 of it; `to_dict` / `from_dict` keep the spans, and the
    tiled views lay the cells tile by tile (tile 2 starts at 1/2 of the image, not at 378/384 of it)."""
    one = Layout.grid(27, 27, (384, 384), seen=seen_share(384, 14))
    assert one.boxes()[-1] == pytest.approx([364 / 384, 364 / 384, 378 / 384, 378 / 384])
    tiled = Layout.tiled(1, 2, 27, (768, 384), seen=seen_share(384, 14))
    xs, ys = tiled.views[0].spans()
    assert xs[26] == pytest.approx([364 / 768, 378 / 768]) and xs[27] == pytest.approx([0.5, 0.5 + 14 / 768])
    assert ys[-1] == pytest.approx([364 / 384, 378 / 384])
    for where in (one, tiled):
        back = Layout.from_dict(where.to_dict())
        assert back == where and np.array_equal(back.boxes(), where.boxes())


def test_the_llava_input_box_is_the_processors_crop_and_refuses_what_it_does_not_know():
    """`input_box`: CLIP's shortest edge to 336 then the centre 336 x 336 (1000 x 600 -> 560 x 336, columns 112..448
    kept; 600 x 1400 -> 336 x 784, rows 224..560), SigLIP's squash to 384 x 384 keeps everything; a pad to a square
    first or a size it does not know is refused by name."""
    clip = built("llava-clip")[1].image_processor
    assert input_box(clip, (1000, 600)) == pytest.approx((112 / 560, 0, 448 / 560, 1))
    assert input_box(clip, (600, 1400)) == pytest.approx((0, 224 / 784, 1, 560 / 784))
    assert input_box(clip, (2000, 2000)) == WHOLE
    assert input_box(built("llava-siglip")[1].image_processor, (1000, 600)) == WHOLE
    with pytest.raises(ValueError, match="do_pad=True"):
        input_box(LlavaImageProcessorPil(do_pad=True), (1000, 600))
    with pytest.raises(ValueError, match="shortest_edge alone, or height and width"):
        input_box(CLIPImageProcessorPil(size={"shortest_edge": 336, "longest_edge": 672}), (1000, 600))
