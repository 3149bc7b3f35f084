"""Image-only processors for the families whose 5.24 processor insists on a video processor (docs/method.md §15).

`LlavaOnevisionProcessor`, InternVL's, SmolVLM's and Qwen2-VL's / Qwen2.5-VL's (and Qwen3-VL's) build a video
processor, which needs torchvision; without it they fail before any image is seen. The subclasses here take only
(image_processor, tokenizer, chat_template) and their processor's own settings, set the token attributes the stock
`__init__` would, and leave video out (a video input raises). `hap.load.load_model` falls back on them where
`AutoProcessor` cannot build the stock one; the tests build their tiny models' processors with them.
"""

from __future__ import annotations

import re

from transformers import (InternVLProcessor, LlavaOnevisionProcessor, Qwen2_5_VLProcessor, Qwen2VLProcessor,
                          Qwen3VLProcessor, SmolVLMProcessor)
from transformers.processing_utils import ProcessorMixin


class OnevisionImageProcessor(LlavaOnevisionProcessor):
    """`LlavaOnevisionProcessor` without its video processor."""

    def __init__(self, image_processor=None, tokenizer=None, num_image_tokens: int | None = None,
                 vision_feature_select_strategy: str | None = None, chat_template: str | None = None,
                 image_token: str = "<image>", vision_aspect_ratio: str = "anyres_max_9", **kwargs) -> None:
        self.num_image_tokens = num_image_tokens
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.image_token = getattr(tokenizer, "image_token", None) or image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token, self.video_token_id = None, None
        self.vision_aspect_ratio = vision_aspect_ratio
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


INTERNVL_TOKENS = {  # the tokenizer attributes InternVLProcessor reads, with InternVL3's tokens
    "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>"}


class InternVLImageProcessor(InternVLProcessor):
    """`InternVLProcessor` without its video processor: the tokens come from the tokenizer's attributes where it has
    them (the hub tokenizers), else `INTERNVL_TOKENS` (a tokenizer that merely holds those tokens)."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_length: int = 256,
                 chat_template: str | None = None, **kwargs) -> None:
        self.image_seq_length = image_seq_length
        tokens = {name: getattr(tokenizer, name, None) or token for name, token in INTERNVL_TOKENS.items()}
        self.start_image_token, self.end_image_token = tokens["start_image_token"], tokens["end_image_token"]
        self.image_token, self.video_token = tokens["context_image_token"], tokens["video_token"]
        self.start_image_token_id = tokenizer.convert_tokens_to_ids(self.start_image_token)
        self.end_image_token_id = tokenizer.convert_tokens_to_ids(self.end_image_token)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.multimodal_pattern = re.compile(
            f"(?P<image>{re.escape(self.image_token)})|(?P<video>{re.escape(self.video_token)})")
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


SMOLVLM_TOKENS = {  # the tokenizer attributes SmolVLMProcessor reads, with SmolVLM's tokens
    "fake_image_token": "<fake_token_around_image>", "image_token": "<image>", "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>", "video_token": "<video>"}


class SmolVLMImageProcessor(SmolVLMProcessor):
    """`SmolVLMProcessor` without its video processor (nor `num2words`, which only its video prompts use); its chat
    template is applied without the video settings the stock one reads from the video processor."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_len: int = 169,
                 chat_template: str | None = None, **kwargs) -> None:
        for name, token in SMOLVLM_TOKENS.items():
            setattr(self, name, getattr(tokenizer, name, None) or token)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.image_seq_len = image_seq_len
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def apply_chat_template(self, conversation, chat_template: str | None = None, **kwargs) -> str:
        """`ProcessorMixin.apply_chat_template`: images and text only."""
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)


QWEN_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def qwen_image_only(stock: type) -> type:
    """Qwen2-VL's / Qwen2.5-VL's / Qwen3-VL's processor class `stock` for images and text only: built from an image
    processor and a tokenizer carrying Qwen's vision tokens, no video processor. It keeps the stock class's name, so a
    processor it saves is the stock one's folder (loaded by the stock class where torchvision is installed)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.vision_start_token, self.image_token, self.vision_end_token, self.video_token = QWEN_VISION_TOKENS
        for name in ("vision_start_token", "image_token", "vision_end_token", "video_token"):
            setattr(self, f"{name}_id", tokenizer.convert_tokens_to_ids(getattr(self, name)))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(stock.__name__, (stock,), {"__init__": __init__, "__doc__": qwen_image_only.__doc__})


IMAGE_ONLY = {  # architecture -> processor class
    "InternVLForConditionalGeneration": InternVLImageProcessor,
    "LlavaOnevisionForConditionalGeneration": OnevisionImageProcessor,
    "Qwen2VLForConditionalGeneration": qwen_image_only(Qwen2VLProcessor),
    "SmolVLMForConditionalGeneration": SmolVLMImageProcessor,
    "Qwen2_5_VLForConditionalGeneration": qwen_image_only(Qwen2_5_VLProcessor),
    "Qwen3VLForConditionalGeneration": qwen_image_only(Qwen3VLProcessor),
}
