"""Image-only processors for the families whose 5.24 processor insists on a video processor (docs/method.md §15).

`LlavaOnevisionProcessor` (and Qwen3-VL's, InternVL's) build a video processor, which needs torchvision; without it
they fail before any image is seen. The subclasses here take only (image_processor, tokenizer, chat_template) and
their processor's own settings, set the token attributes the stock `__init__` would, and leave video out (a video
input raises). `hap.load.load_model` falls back on them where `AutoProcessor` cannot build the stock one; the tests
build their tiny models' processors with them.
"""

from __future__ import annotations

from transformers import LlavaOnevisionProcessor
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


IMAGE_ONLY = {"LlavaOnevisionForConditionalGeneration": OnevisionImageProcessor}  # architecture -> processor class
