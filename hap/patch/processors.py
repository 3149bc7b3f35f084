"""Image-only processors for the families whose 5.24 processor insists on a video processor (docs/method.md §15).

`LlavaOnevisionProcessor`, InternVL's, SmolVLM's and Qwen2-VL's / Qwen2.5-VL's (and Qwen3-VL's) build a video
processor, which needs torchvision; without it they fail before any image is seen. The subclasses here take only
(image_processor, tokenizer, chat_template) and their processor's own settings, set the token attributes the stock
`__init__` would, and leave video out (a video input raises). `hap.load.load_model` falls back on them where
`AutoProcessor` cannot build the stock one; the tests build their tiny models' processors with them.

`RULES` maps each processor option (`hap.options`) to what it sets in each family that takes it, and
`processor_options(model, processor, options)` sets it for a block.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from transformers import (InternVLProcessor, LlavaOnevisionProcessor, Qwen2_5_VLProcessor, Qwen2VLProcessor,
                          Qwen3VLProcessor, SmolVLMProcessor)
from transformers.processing_utils import ProcessorMixin

from ..options import NO_OPTIONS, ProcessorOptions


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


# --- processor options (hap.options) ---------------------------------------------------------------------------------
Mirror = tuple[object, str, object]  # (object, attribute, value) set for the block beside the processor call kwargs


def current(processor, key: str) -> object:
    """The value the processor's image processor is called with for `key` when the call gives none: the processor's
    own `images_kwargs` default, else the image processor's attribute (a size as a plain dict)."""
    value = getattr(processor, "images_kwargs", {}).get(key, getattr(processor.image_processor, key, None))
    if key == "size" and value is not None and not isinstance(value, dict):
        value = {k: v for k, v in vars(value).items() if v is not None}
    return value


@dataclass(frozen=True)
class Rule:
    """How one option reaches one family: `default(model, processor)` its value in the loaded checkpoint, and
    `apply(value, model, processor)` the processor call kwargs and the `Mirror`s it takes."""

    default: Callable[[object, object], object]
    apply: Callable[[object, object, object], tuple[dict, list[Mirror]]]


def passed(key: str) -> Rule:
    """An option that is the image processor's call kwarg `key` itself."""
    return Rule(lambda model, processor: current(processor, key), lambda value, model, processor: ({key: value}, []))


def sized(key: str) -> Rule:
    """An option that is the entry `key` of the image processor's `size`."""
    return Rule(lambda model, processor: current(processor, "size").get(key),
                lambda value, model, processor: ({"size": {key: value}}, []))


def tiles(model, pinpoint) -> int:
    """Tiles of a LLaVA-NeXT / OneVision grid pinpoint (height, width), of the vision tower's tile size."""
    tile = model.config.vision_config.image_size
    return (pinpoint[0] // tile) * (pinpoint[1] // tile)


def pinpoints_up_to(value: int, model, processor) -> tuple[dict, list[Mirror]]:
    """max_tiles on LLaVA-NeXT / OneVision: the checkpoint's pinpoints of at most `value` tiles, for the processor's
    tiling and token count and for the model's packing alike; ValueError where none is left."""
    pinpoints = current(processor, "image_grid_pinpoints")
    kept = [list(p) for p in pinpoints if tiles(model, p) <= value]
    if not kept:
        raise ValueError(f"max_tiles={value}: every grid pinpoint of this {type(model).__name__} has more tiles (the "
                         f"fewest: {min(tiles(model, p) for p in pinpoints)}); give max_tiles >= that")
    return {"image_grid_pinpoints": kept}, [(processor.image_processor, "image_grid_pinpoints", kept),
                                            (model.config, "image_grid_pinpoints", kept)]


def anyres(value: int, model, processor) -> tuple[dict, list[Mirror]]:
    """anyres_max on OneVision: `vision_aspect_ratio` "anyres_max_N", read by the processor (token count) and the
    model (its shrink of the tile grid)."""
    ratio = f"anyres_max_{value}"
    return {}, [(processor, "vision_aspect_ratio", ratio), (model.config, "vision_aspect_ratio", ratio)]


PINPOINTS = Rule(lambda model, processor: max(tiles(model, p) for p in current(processor, "image_grid_pinpoints")),
                 pinpoints_up_to)
ANYRES = Rule(lambda model, processor: int(processor.vision_aspect_ratio.removeprefix("anyres_max_")), anyres)
GEMMA3, INTERNVL, ONEVISION = "Gemma3ForConditionalGeneration", "InternVLForConditionalGeneration", \
    "LlavaOnevisionForConditionalGeneration"
IDEFICS3 = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
QWEN = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
RULES: dict[str, dict[str, Rule]] = {  # option -> {architecture: how it reaches that family}
    "pan_and_scan": {GEMMA3: passed("do_pan_and_scan")},
    "pan_and_scan_max_crops": {GEMMA3: passed("pan_and_scan_max_num_crops")},
    "pan_and_scan_min_crop": {GEMMA3: passed("pan_and_scan_min_crop_size")},
    "pan_and_scan_min_ratio": {GEMMA3: passed("pan_and_scan_min_ratio_to_activate")},
    "max_tiles": {INTERNVL: passed("max_patches"), "LlavaNextForConditionalGeneration": PINPOINTS,
                  ONEVISION: PINPOINTS},
    "anyres_max": {ONEVISION: ANYRES},
    "image_splitting": {arch: passed("do_image_splitting") for arch in IDEFICS3},
    "longest_edge": {arch: sized("longest_edge") for arch in IDEFICS3},
    "min_pixels": {arch: sized("shortest_edge") for arch in QWEN},
    "max_pixels": {arch: sized("longest_edge") for arch in QWEN},
}


def family(architecture: str) -> str:
    """A short family name: the architecture without "ForConditionalGeneration"."""
    return architecture.removesuffix("ForConditionalGeneration")


def options_of(architecture: str) -> tuple[str, ...]:
    """The processor options the model class `architecture` takes, in `RULES` order."""
    return tuple(name for name, by_family in RULES.items() if architecture in by_family)


def option_defaults(model, processor) -> dict[str, object]:
    """Each option `model`'s family takes, at the loaded checkpoint's own value (its processor's configuration)."""
    arch = type(model).__name__
    return {name: RULES[name][arch].default(model, processor) for name in options_of(arch)}


def option_settings(model, processor, options: ProcessorOptions) -> tuple[dict, list[Mirror]]:
    """(the processor call kwargs, the `Mirror`s) of `options` on `model`'s family; ValueError naming an option the
    family does not take (and the families that do), or a combination its processor cannot take."""
    arch, kwargs, mirrors = type(model).__name__, {}, []
    for name, value in options.given().items():
        if arch not in RULES[name]:
            raise ValueError(f"{name} is not a processor option of {family(arch)}; it is one of "
                             f"{', '.join(family(a) for a in RULES[name])}")
        more, also = RULES[name][arch].apply(value, model, processor)
        for key, given in more.items():
            kwargs[key] = {**kwargs.get(key, current(processor, key)), **given} if isinstance(given, dict) else given
        mirrors += also
    size = kwargs.get("size", {})
    if arch in QWEN and size and size["shortest_edge"] > size["longest_edge"]:
        raise ValueError(f"min_pixels={size['shortest_edge']} exceeds max_pixels={size['longest_edge']} (unset ones "
                         "are the checkpoint's)")
    low = current(processor, "min_patches") if arch == INTERNVL else None
    if low is not None and kwargs.get("max_patches", low) < low:
        raise ValueError(f"max_tiles={kwargs['max_patches']} is under this InternVL processor's min_patches={low}")
    return kwargs, mirrors


MISSING = object()


@contextmanager
def processor_options(model, processor, options: ProcessorOptions | dict | None = None) -> Iterator[dict]:
    """Inside the block, every call of `processor` takes `options` (`option_settings`'s kwargs, as its own
    `images_kwargs` defaults) and the processor and model hold the settings they read themselves (LLaVA-NeXT's
    pinpoints, OneVision's `vision_aspect_ratio`); `model._hap_options` records every option in effect (an outer
    block's too) for the feature cache (`hap.runs.features`). Yields the kwargs. No options: nothing changes (an outer
    block's stay in effect). Everything is restored after, even on error. `options` may be a dict by name
    (`ProcessorOptions.of`)."""
    options = options if isinstance(options, ProcessorOptions) else ProcessorOptions.of(options)
    kwargs, mirrors = option_settings(model, processor, options)
    saved = [(processor, "images_kwargs", vars(processor).get("images_kwargs", MISSING)),
             (model, "_hap_options", vars(model).get("_hap_options", MISSING)),
             *((obj, attr, getattr(obj, attr)) for obj, attr, _ in mirrors)]
    try:
        if kwargs:
            processor.images_kwargs = {**getattr(processor, "images_kwargs", {}), **kwargs}
        for obj, attr, value in mirrors:
            setattr(obj, attr, value)
        if options.given():
            model._hap_options = replace(getattr(model, "_hap_options", NO_OPTIONS), **options.given())
        yield kwargs
    finally:
        for obj, attr, value in reversed(saved):
            if value is MISSING:
                vars(obj).pop(attr, None)
            else:
                setattr(obj, attr, value)
