"""Tiny random models of InternVL and SmolVLM / Idefics3 (issue 37), built offline from configs, with their processors.

Each builder returns `(model, processor)` on the small word-level tokenizer of `analysis.training.tiny_vlm`, with the
family's special tokens added; the processors are the stock 5.24 classes or the image-only ones of
`hap.patch.processors`. InternVL: 112-px tiles of 14-px patches, 0.5 pixel shuffle (4 x 4 tokens per tile), at most
4 tiles plus the thumbnail. Idefics3 / SmolVLM: 64-px crops of 8-px patches, shuffle 2 (4 x 4 tokens per crop), the
image's longest edge resized to 128 (upscaled when smaller): at most 2 x 2 crops plus the global view.
"""

from __future__ import annotations

import torch
from tokenizers import AddedToken
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3Processor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLVisionConfig,
    LlamaConfig,
    Qwen2Config,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from analysis.training.tiny_vlm import CHAT_TEMPLATE, build_tokenizer
from hap.patch.processors import INTERNVL_TOKENS, SMOLVLM_TOKENS, InternVLImageProcessor, SmolVLMImageProcessor
from tiny_zoo import VISION, _text

INTERNVL_TILE, INTERNVL_PATCH, INTERNVL_MAX = 112, 14, 4
INTERNVL_VISION = {**VISION, "image_size": INTERNVL_TILE, "patch_size": INTERNVL_PATCH}


def _tokenizer(tokens: list[str]):
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.model_max_length = 4096
    return tok


def internvl(attn: str = "sdpa", layers: int = 4, decoder: str = "qwen2", tile: int = INTERNVL_TILE,
             max_patches: int = INTERNVL_MAX, image: dict | None = None):
    """InternVL3 in small: InternViT tiles of `tile` px (112: 8 x 8 patches, [CLS] dropped, shuffled to 4 x 4 tokens),
    at most `max_patches` tiles plus a thumbnail (`image`: more image-processor settings), a Qwen2 (InternVL3-1B/2B/8B)
    or Llama (InternVL2.5-8B, InternVL3-9B) decoder."""
    tok = _tokenizer(list(INTERNVL_TOKENS.values()))
    tokens = (tile // INTERNVL_PATCH // 2) ** 2
    image_processor = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True,
                                               max_patches=max_patches, **(image or {}))
    template = CHAT_TEMPLATE.replace("<image>", INTERNVL_TOKENS["context_image_token"])
    processor = InternVLImageProcessor(image_processor, tok, image_seq_length=tokens, chat_template=template)
    text = _text(Qwen2Config if decoder == "qwen2" else LlamaConfig, tok, layers)
    config = InternVLConfig(vision_config=InternVLVisionConfig(**{**INTERNVL_VISION, "image_size": tile}),
                            text_config=text, image_token_id=processor.image_token_id, image_seq_length=tokens)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config)
    model.set_attn_implementation(attn)
    return model.eval(), processor


SMOL_CROP, SMOL_PATCH, SMOL_LONGEST = 64, 8, 128
SMOL_VISION = {**VISION, "image_size": SMOL_CROP, "patch_size": SMOL_PATCH}
ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def idefics3(attn: str = "sdpa", layers: int = 4, smolvlm: bool = False, crop: int = SMOL_CROP,
             patch: int = SMOL_PATCH, scale: int = 2, longest: int = SMOL_LONGEST, image: dict | None = None):
    """SmolVLM-256M in small (`Idefics3ForConditionalGeneration`, `Idefics3Processor`), or SmolVLM2 in small
    (`smolvlm`: `SmolVLMForConditionalGeneration`, the image-only `SmolVLMImageProcessor`): SigLIP crops of `crop` px
    (64: 8 x 8 patches of `patch` px, shuffled `scale` x `scale` into 4 x 4 tokens), the longest edge resized to
    `longest` px (`image`: more image-processor settings), a Llama decoder. The tokenizer writes a token for "\\n"
    (the row ends between crops), as the hub tokenizers do."""
    tok = _tokenizer([*SMOLVLM_TOKENS.values(), *ROW_COL])
    tok.add_tokens([AddedToken("\n", normalized=False)])
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": longest},
                                                max_image_size={"longest_edge": crop}, **(image or {}))
    tokens = (crop // patch // scale) ** 2
    processor_class = SmolVLMImageProcessor if smolvlm else Idefics3Processor
    processor = processor_class(image_processor, tok, image_seq_len=tokens, chat_template=CHAT_TEMPLATE)
    config_class, model_class = ((SmolVLMConfig, SmolVLMForConditionalGeneration) if smolvlm
                                 else (Idefics3Config, Idefics3ForConditionalGeneration))
    config = config_class(vision_config={**SMOL_VISION, "image_size": crop, "patch_size": patch},
                          text_config=_text(LlamaConfig, tok, layers), scale_factor=scale,
                          image_token_id=processor.image_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = model_class(config)
    model.set_attn_implementation(attn)
    return model.eval(), processor


ZOO = {  # family -> builder(attn, layers) -> (model, processor)
    "internvl": internvl,
    "internvl-llama": lambda attn="sdpa", layers=4: internvl(attn, layers, "llama"),
    "idefics3": idefics3,
    "smolvlm": lambda attn="sdpa", layers=4: idefics3(attn, layers, smolvlm=True),
}
