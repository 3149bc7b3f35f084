"""Tiny random VLMs built offline from configs, for the tests (no download).

Every builder returns `(model, make_inputs)`, where `make_inputs(questions, seeds)` gives a
left-padded batch, one noise image per question.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    LlavaForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    SiglipVisionConfig,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hap.runs.run import chat_prompt
from hap.scoring import importance
from analysis.training.tiny_vlm import build_config, build_processor, build_qwen_processor

Inputs = Callable[[list[str], list[int] | None], dict]


def noise_image(seed: int = 0, size: tuple[int, int] = (168, 168)) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def _processor_inputs(processor) -> Inputs:
    def make(questions: list[str], seeds: list[int] | None = None) -> dict:
        seeds = seeds or list(range(len(questions)))
        processor.tokenizer.padding_side = "left"
        return processor(
            images=[noise_image(s) for s in seeds], text=[chat_prompt(processor, q) for q in questions],
            return_tensors="pt", padding=True,
        )

    return make


def uniform_importance(model) -> str:
    """A static head importance file weighting every head of `model`'s decoder alike (a temporary file), for `hawk`
    and head_weight="static" on models built here (they carry no `head_importance.json`)."""
    tc = model.config.text_config
    path = Path(tempfile.mkdtemp()) / importance.FILE
    importance.write(path, importance.row_normalised(torch.ones(tc.num_hidden_layers, tc.num_attention_heads)))
    return str(path)


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


def inputs_for(processor, questions: list[str], seeds: list[int] | None = None) -> dict:
    return _processor_inputs(processor)(questions, seeds)


def llava_case(attn: str = "sdpa", layers: int = 4) -> tuple[torch.nn.Module, Inputs]:
    model, processor = tiny_llava(attn, layers)
    return model, _processor_inputs(processor)


def llava_qwen2_case(attn: str = "sdpa", layers: int = 4) -> tuple[torch.nn.Module, Inputs]:
    """LLaVA-interleave's shape in small: SigLIP tower ("full" strategy, no CLS) + Qwen2 decoder with GQA."""
    processor = build_processor()
    processor.num_additional_image_tokens = 0
    processor.vision_feature_select_strategy = "full"
    base = build_config(processor, text_layers=layers)
    tok = processor.tokenizer
    config = type(base)(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=168, patch_size=14),
        text_config=Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id),
        image_token_index=tok.image_token_id, vision_feature_layer=-1, vision_feature_select_strategy="full",
        image_seq_length=144,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.set_attn_implementation(attn)
    return model, _processor_inputs(processor)


QWEN_IDS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


TEXT_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def qwen_vl_model(layers: int = 4, version: str = "2", ids: dict[str, int] = QWEN_IDS, vocab: int = 128,
                  text_ids: dict[str, int] = TEXT_IDS):
    """A random Qwen2-VL / Qwen2.5-VL in small (M-RoPE decoder 64 wide, 4 query heads on 2 KV heads; `ids`: its
    vision tokens, `vocab`: its vocabulary, `text_ids`: its pad / bos / eos tokens), on SDPA."""
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **text_ids,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4})
    vision = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_heads=2)
    if version == "2":
        config = Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2,
                                                                     **vision), **ids)
        cls = Qwen2VLForConditionalGeneration
    else:
        config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=56,
            fullatt_block_indexes=[1], **vision), **ids)
        cls = Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    return cls(config).eval()


def qwen_vl_folder(folder: Path, layers: int = 4, side: int = 168) -> Path:
    """A random Qwen2-VL saved to `folder` with its offline processor (`build_qwen_processor`: `side` x `side`
    pixels, (side / 28)^2 visual tokens), as `hap.load_model` and the app load a model folder."""
    processor, ids = build_qwen_processor(side, "Qwen2VLForConditionalGeneration")
    tok = processor.tokenizer
    model = qwen_vl_model(layers, "2", ids, len(tok), dict(pad_token_id=tok.pad_token_id,
                                                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def qwen_vl_case(attn: str = "sdpa", layers: int = 4, version: str = "2") -> tuple[torch.nn.Module, Inputs]:
    """Qwen2-VL / Qwen2.5-VL in small (`qwen_vl_model`): 168 x 140 images -> 6 x 5 = 30 visual tokens."""
    model = qwen_vl_model(layers, version)
    model.set_attn_implementation(attn)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224, patch_size=14, merge_size=2)

    def make(questions: list[str], seeds: list[int] | None = None) -> dict:
        seeds = seeds or list(range(len(questions)))
        pixels = image_processor(images=[noise_image(s, (168, 140)) for s in seeds], return_tensors="pt")
        n = int(pixels["image_grid_thw"][0].prod()) // 4
        rows = [[5, 6, 122] + [120] * n + [123] + [10 + sum(map(ord, w)) % 100 for w in q.split()] for q in questions]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == 120).int(), **pixels)

    return model, make


CASES = {
    "llava": llava_case,
    "llava-qwen2": llava_qwen2_case,
    "qwen2-vl": lambda attn="sdpa", layers=4: qwen_vl_case(attn, layers, "2"),
    "qwen2.5-vl": lambda attn="sdpa", layers=4: qwen_vl_case(attn, layers, "2.5"),
}
