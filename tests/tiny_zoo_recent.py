"""Tiny random Qwen3-VL and Gemma 3 (issue 37), built offline from configs, with their processors.

Each builder returns `(model, processor)` on the small word-level tokenizer of `analysis.training.tiny_vlm` with the
family's special tokens; the processors are the image-only one of `hap.patch.processors` (Qwen3-VL) and the stock
`Gemma3Processor`. Qwen3-VL: 16-px patches merged 2 x 2 (one token per 32 px), DeepStack after decoder layers 0 and
1; Gemma 3: 112-px SigLIP (8 x 8 patches) pooled to 4 x 4 = 16 tokens per image, sliding window 8 on 3 of 4
layers.
"""

from __future__ import annotations

import torch
from tokenizers import AddedToken
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    PreTrainedTokenizerFast,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import hap
from analysis.training.tiny_vlm import CHAT_TEMPLATE, build_tokenizer
from hap.patch.processors import IMAGE_ONLY, QWEN_VISION_TOKENS

QWEN3_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=2048,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]})
QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                    deepstack_visual_indexes=[0, 1])


def qwen3_vl(attn: str = "sdpa", layers: int = 4, text: dict | None = None, max_pixels: int = 256 * 256,
             min_pixels: int = 64 * 64, image: dict | None = None):
    """Qwen3-VL in small: QK-norm GQA decoder (4 / 2 heads, head_dim 16, interleaved M-RoPE), a 2-block vision
    tower whose blocks 0 and 1 feed DeepStack after decoder layers 0 and 1; images of `min_pixels`..`max_pixels`
    (`image`: more image-processor settings)."""
    text = text or QWEN3_TEXT
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_VISION_TOKENS)})
    tok.model_max_length = 8192
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                               patch_size=16, merge_size=2, temporal_patch_size=2, **(image or {}))
    processor = IMAGE_ONLY["Qwen3VLForConditionalGeneration"](
        image_processor, tok, CHAT_TEMPLATE.replace("<image>\n", "".join(QWEN_VISION_TOKENS[:3])))
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))))
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tok), num_hidden_layers=layers, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **text),
        vision_config={**QWEN3_VISION, "out_hidden_size": text["hidden_size"]}, **ids)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config)
    model.set_attn_implementation(attn)
    return model.eval(), processor


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=16, max_position_embeddings=2048, sliding_window=8,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}})
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                     vision_use_head=False)


def gemma3(attn: str = "sdpa", layers: int = 4, text: dict | None = None, tokens: int = 16, image_size: int = 112,
           every: int = 4, image: dict | None = None):
    """Gemma 3 in small: a SigLIP of `image_size` px (112: 8 x 8 patches) average-pooled to `tokens` (16: 4 x 4) per
    image (`image`: more image-processor settings, e.g. pan-and-scan), a QK-norm GQA decoder (4 / 2 heads, head_dim 16) whose layers slide a window of 8 except every `every`-th
    (full attention, its own rotary table: theta 1e6, linear scaling 8), image tokens attending bidirectionally within
    their image. The projector's weight, zero at init, is drawn at random so that the image reaches the decoder."""
    base = build_tokenizer()
    base.backend_tokenizer.add_special_tokens([AddedToken(t, special=True) for t in GEMMA3_TOKENS.values()])
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>", padding_side="left", model_max_length=8192,
                                  extra_special_tokens=GEMMA3_TOKENS)
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, **(image or {}))
    processor = Gemma3Processor(image_processor, tok, CHAT_TEMPLATE.replace("<image>\n", GEMMA3_TOKENS["boi_token"]),
                                image_seq_length=tokens)
    text = text or GEMMA3_TEXT
    types = (["sliding_attention"] * (every - 1) + ["full_attention"]) * (layers // every + 1)
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tok), num_hidden_layers=layers, layer_types=types[:layers],
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         **text),
        vision_config={**GEMMA3_VISION, "image_size": image_size}, mm_tokens_per_image=tokens,
        image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.05)
    model.set_attn_implementation(attn)
    return model.eval(), processor


def recomputed_rows_error(monkeypatch, model, batch) -> float:
    """Max difference between the prompt rows HAP recomputes at every layer (trace, nothing pruned) and the eager
    attention probabilities of the same rows; `model` runs eager attention."""
    from hap.patch.state import PruneState

    captured, original = {}, PruneState.record

    def spy(self, layer, rows, hidden, lookahead=False, logits=None):
        captured[layer] = rows.clone()
        return original(self, layer, rows, hidden, lookahead, logits)

    monkeypatch.setattr(PruneState, "record", spy)
    with torch.no_grad():
        eager = model(**batch, output_attentions=True).attentions
        with hap.patched(model, hap.HAPConfig(method="none"), trace=True):
            model(**batch)
    assert sorted(captured) == list(range(len(eager)))
    return max((rows - eager[layer][:, :, -rows.shape[2]:, :].float()).abs().max().item()
               for layer, rows in captured.items())


def fanned_out_error(model, batch, layer: int, keep: int = 5, rows: int = 3) -> float:
    """Max difference between the last-token logits of a batch-1 prompt fanned out into `rows` priority variants
    (`hap.patch.apply`'s priority, one cut entering `layer` keeping `keep` visual tokens) and each variant run alone."""
    from hap.patch import decoder_of
    from hap.utility import one_cut

    N = int((batch["input_ids"][0] == model.config.image_token_id).sum())
    order = torch.rand(rows, N, generator=torch.Generator().manual_seed(0)).argsort(1)[:, :keep]
    priority = torch.zeros(rows, N).scatter_(1, order, 1.0)
    cut = one_cut(layer, keep, N, len(decoder_of(model).layers))
    with torch.no_grad():
        with hap.patched(model, cut, priority=priority):
            fanned = model(**batch, logits_to_keep=1, use_cache=False).logits[:, -1]
        errors = []
        for row, logits in zip(priority, fanned):
            with hap.patched(model, cut, priority=row[None]):
                errors.append((model(**batch, logits_to_keep=1, use_cache=False).logits[0, -1] - logits).abs().max())
    return max(errors).item()


@torch.no_grad()
def decode_loop_error(model, batch, config) -> float:
    """Max difference between the logits of a hand-written decode loop on the pruned cache (input_ids, attention_mask
    and the cache per step, no positions: the patch supplies those of an unpruned cache) and a fresh pruned forward of
    the same ids (the seeded random policy keeps the same tokens whatever the text)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    types = [k for k in ("mm_token_type_ids", "token_type_ids") if k in batch]
    images = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", *types)}
    errors = []
    with hap.patched(model, config):
        out = model(**batch, use_cache=True)
        steps = []
        for _ in range(3):
            step = out.logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, step], 1), torch.cat([mask, torch.ones_like(step)], 1)
            out = model(input_ids=step, attention_mask=mask, cache=out.cache, use_cache=True)
            steps.append((ids, mask, out.logits[:, -1]))
        for ids, mask, logits in steps:  # after the loop: a fresh prefill starts a new pruning state
            extra = {k: (ids == model.config.image_token_id).int() for k in types}
            fresh = model(input_ids=ids, attention_mask=mask, use_cache=False, **images, **extra)
            errors.append((logits - fresh.logits[:, -1]).abs().max().item())
    return max(errors)
