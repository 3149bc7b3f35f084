"""Tiny random models of the tiled families (issue 37), built offline from configs, with their processors.

Each builder returns `(model, processor)` on the small word-level tokenizer of `analysis.training.tiny_vlm`; the
processors are the stock 5.24 classes (LLaVA-NeXT) or the image-only ones of `hap.patch.processors`. Tiles are
56 px with 14-px patches (4 x 4 tokens per tile), the real pinpoint lists scaled to them.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    MistralConfig,
    Qwen2Config,
    SiglipVisionConfig,
)
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

from analysis.training.tiny_vlm import CHAT_TEMPLATE, build_tokenizer
from hap.patch.processors import OnevisionImageProcessor
from hap.runs.run import chat_prompt

TILE, PATCH = 56, 14
NEXT_PINPOINTS = [[TILE * a, TILE * b] for a, b in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]  # llava-v1.6's, scaled
TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=TILE,
              patch_size=PATCH)


def picture(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A noise image of `size` = (height, width)."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def inputs(processor, questions: list[str], sizes: list[tuple[int, int]], seeds: list[int] | None = None) -> dict:
    """A left-padded batch: one question and one noise image of (height, width) per sample."""
    seeds = seeds or list(range(len(questions)))
    processor.tokenizer.padding_side = "left"
    return processor(images=[picture(s, seed) for s, seed in zip(sizes, seeds)],
                     text=[chat_prompt(processor, q) for q in questions], return_tensors="pt", padding=True)


def _text(cls, tok, layers: int, **extra):
    return cls(vocab_size=len(tok), num_hidden_layers=layers, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **TEXT, **extra)


def _ready(model, attn: str, seed: int = 0):
    model.set_attn_implementation(attn)
    return model.eval()


def llava_next(attn: str = "sdpa", layers: int = 4, decoder: str = "llama", window: int = 24, tile: int = TILE,
               pinpoints: list | None = None, image: dict | None = None, vision_layers: int = 1):
    """LLaVA-v1.6 in small: CLIP tiles of `tile` px (56: 4 x 4 tokens, CLS dropped; `pinpoints`: the canvases, default
    the real ones scaled to 56 px; `image`: more image-processor settings; `vision_layers`: 2 for a feature layer
    -2 that is a layer's output, as the [CLS] cues need), Llama or Mistral (sliding `window`)."""
    tok = build_tokenizer()
    pinpoints = pinpoints or NEXT_PINPOINTS
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": tile},
                                                 crop_size={"height": tile, "width": tile},
                                                 image_grid_pinpoints=pinpoints, **(image or {}))
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=CHAT_TEMPLATE)
    text = _text(LlamaConfig, tok, layers) if decoder == "llama" else _text(MistralConfig, tok, layers,
                                                                           sliding_window=window, head_dim=16)
    config = LlavaNextConfig(vision_config=CLIPVisionConfig(**{**VISION, "image_size": tile,
                                                               "num_hidden_layers": vision_layers}), text_config=text,
                             image_token_index=tok.image_token_id, image_grid_pinpoints=pinpoints,
                             vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return _ready(LlavaNextForConditionalGeneration(config), attn), processor


def llava_onevision(attn: str = "sdpa", layers: int = 4, tile: int = TILE, image: dict | None = None):
    """LLaVA-OneVision in small: SigLIP tiles of `tile` px (no CLS, strategy "full"; `image`: more image-processor
    settings), canvases of 1..6 x 1..6 tiles, anyres_max_9, Qwen2 with GQA."""
    tok = build_tokenizer()
    pinpoints = [[tile * a, tile * b] for a in range(1, 7) for b in range(1, 7)]
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile},
                                                      image_grid_pinpoints=pinpoints, **(image or {}))
    processor = OnevisionImageProcessor(image_processor, tok, num_image_tokens=(tile // PATCH) ** 2,
                                        vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE)
    config = LlavaOnevisionConfig(vision_config=SiglipVisionConfig(vision_use_head=False,
                                                                   **{**VISION, "image_size": tile}),
                                  text_config=_text(Qwen2Config, tok, layers), image_token_index=tok.image_token_id,
                                  image_grid_pinpoints=pinpoints, vision_feature_layer=-1,
                                  vision_feature_select_strategy="full")
    torch.manual_seed(0)
    return _ready(LlavaOnevisionForConditionalGeneration(config), attn), processor


ZOO = {  # family -> builder(attn, layers) -> (model, processor)
    "llava-next": llava_next,
    "llava-next-mistral": lambda attn="sdpa", layers=4: llava_next(attn, layers, "mistral"),
    "llava-onevision": llava_onevision,
}
SIZES = {  # family -> (height, width) of a test image, and a different size giving the same visual-token count
    "llava-next": ((112, 112), (140, 140)),
    "llava-next-mistral": ((112, 112), (140, 140)),
    "llava-onevision": ((336, 280), (252, 210)),
}
