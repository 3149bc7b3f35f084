"""Tiny random LLaVA models built offline from configs, for the tests (no download)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import LlavaForConditionalGeneration

from analysis.tiny_vlm import build_config, build_processor


def tiny_llava(attn: str = "sdpa", layers: int = 4, kv_heads: int | None = 2, seed: int = 0):
    """(model, processor): CLIP 32x1 + Llama 64 x `layers` x 4 heads (GQA with `kv_heads`), 144 visual tokens."""
    processor = build_processor()
    config = build_config(
        processor, text_layers=layers, text_hidden=64, text_heads=4, text_kv_heads=kv_heads, text_mlp=128,
        vision_hidden=32, vision_layers=1, vision_heads=2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.set_attn_implementation(attn)
    return model, processor


def noise_image(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (168, 168, 3), dtype=np.uint8))


def chat(processor, question: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def inputs_for(processor, questions: list[str], seeds: list[int] | None = None) -> dict:
    """Processor inputs for a batch (left padding) of questions, one noise image each."""
    seeds = seeds or list(range(len(questions)))
    processor.tokenizer.padding_side = "left"
    return processor(
        images=[noise_image(s) for s in seeds], text=[chat(processor, q) for q in questions],
        return_tensors="pt", padding=True,
    )
