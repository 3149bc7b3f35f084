"""Tokenizer, processor and config of the tiny LLaVA trained on synthetic scenes.

Everything is built offline from code: a word-level tokenizer (``tokenizers``), a
``LlavaProcessor`` with a PIL CLIP image processor, and a ``LlavaConfig`` (CLIP vision tower,
MLP projector, Llama decoder).

Prompt format (the chat template)::

    USER: <image>\\n<question> ASSISTANT:

The tokenizer lowercases, splits on whitespace and punctuation, prepends ``<s>`` and maps
words outside the vocabulary to ``<unk>``. The ``<image>`` placeholder expands to 144 image
tokens in the processor. The model answers with one word followed by ``</s>``.
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaProcessor, PreTrainedTokenizerFast)

from analysis.scenes import (BACKGROUNDS, COLORS, IMAGE_SIZE, LETTERS, NUMBERS, PATCH, RELATIONS, SHAPES,
                             SIDES)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]
TEMPLATE_WORDS = ["user", "assistant", ":"]
TASK_WORDS = ["what", "color", "colour", "shape", "is", "the", "object", "there", "a", "an",
              "?", "yes", "no", "of", "which", "how", "many", "are", "in", "image", "this",
              ".", ",", "circles", "squares", "triangles", "objects", "any", "it", "or", "background",
              "letter", "dot", "on", "at"]
_RELATION_WORDS = sorted({w for rel in RELATIONS for w in rel.split()} - set(TASK_WORDS))
VOCAB: list[str] = (SPECIAL_TOKENS + TEMPLATE_WORDS + TASK_WORDS + list(COLORS) + list(SHAPES)
                    + _RELATION_WORDS + list(NUMBERS) + list(BACKGROUNDS) + list(LETTERS)
                    + sorted({w for pair in SIDES.values() for w in pair} - set(_RELATION_WORDS)))

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


# The image-first layouts: the image opens the sequence (no <s> before it), so its first patch, the
# scene's fixed marker, always sits at position 0, where a learned attention sink can form.
def image_first_template(user_tag: bool = True) -> str:
    """The chat template of an image-first layout; without ``user_tag`` the question follows the image
    directly (no constant ``USER :`` between them, so the only fixed tokens a question row can see are
    the image's, its marker patch first)."""
    user = "USER: " if user_tag else ""
    return (
        "{% for message in messages %}"
        "{% if message['content'] is not string %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}<image>\n{% endif %}{% endfor %}{% endif %}"
        f"{{% if message['role'] == 'user' %}}{user}{{% else %}}ASSISTANT: {{% endif %}}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{% if message['role'] == 'user' %} {% else %}</s>{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )


LAYOUTS = ("text-first", "image-first", "image-question")  # <s> USER: <image> q | <image> USER: q | <image> q

IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.25, 0.25, 0.25]


def build_tokenizer(bos: bool = True, size: int | None = None) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``VOCAB``; ``<s>`` is prepended to every encoding when ``bos``. With ``size``, the
    vocabulary is filled with made-up words (``w<id>``) up to ``size`` ids, so that every id of a model with that
    output layer decodes to a word, as every id of a real tokenizer decodes to text."""
    if size is not None and size < len(VOCAB):
        raise ValueError(f"size={size} must be at least the {len(VOCAB)} words of VOCAB")
    vocab = {w: i for i, w in enumerate(VOCAB + [f"w{i}" for i in range(len(VOCAB), size or 0)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Punctuation()])
    tok.add_special_tokens(SPECIAL_TOKENS)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", extra_special_tokens={"image_token": "<image>"},
        padding_side="left", model_max_length=512)


def build_processor(layout: str = "text-first", image_size: int = IMAGE_SIZE) -> LlavaProcessor:
    """LlavaProcessor: CLIP-style image processing at ``image_size`` px (168: 144 image tokens), chat template of
    ``layout`` (``LAYOUTS``: ``USER: <image>\\n...`` after ``<s>``, or the image at position 0 and ``USER:`` or the
    question itself after it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; choose one of {', '.join(LAYOUTS)}")
    image_first = layout != "text-first"
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        do_center_crop=True, image_mean=IMAGE_MEAN, image_std=IMAGE_STD)
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=build_tokenizer(bos=not image_first), patch_size=PATCH,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=image_first_template(layout == "image-first") if image_first else CHAT_TEMPLATE)


def build_qwen_processor(side: int, arch: str = "Qwen2_5_VLForConditionalGeneration", image: dict | None = None):
    """(an offline Qwen2-VL / Qwen2.5-VL processor for images and text, the special-token ids its model needs): this
    module's tokenizer with Qwen's vision tokens added, Qwen2-VL's image processing at `side` x `side` pixels (14-px
    patches merged 2 x 2: (side / 28)^2 visual tokens; `image`: other image-processor settings, e.g. the min / max
    pixels), the chat template with Qwen's image span
    (`hap.patch.processors.IMAGE_ONLY`: no video processor, which needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hap.patch.processors import IMAGE_ONLY, QWEN_VISION_TOKENS

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VISION_TOKENS)})
    tokenizer.model_max_length = 4096
    processor = IMAGE_ONLY[arch](
        Qwen2VLImageProcessorPil(**{"min_pixels": side * side, "max_pixels": side * side, "patch_size": 14,
                                    "merge_size": 2, **(image or {})}),
        tokenizer, CHAT_TEMPLATE.replace("<image>\n", "".join(QWEN_VISION_TOKENS[:3])))
    ids = tokenizer.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))
    return processor, dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                               ids))


DECODER_FIELDS = ("text_layers", "text_heads", "text_hidden", "text_mlp")


def decoder_shape(overrides: list[str]) -> dict[str, int]:
    """Parse ``FIELD=N`` decoder-shape overrides (``--decoder`` of the training CLIs) into a dict for
    `build_config`; ValueError naming the allowed fields on anything else."""
    shape = {}
    for item in overrides:
        field, _, n = item.partition("=")
        if field not in DECODER_FIELDS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--decoder {item!r}: give FIELD=N with N >= 1 and FIELD one of "
                             f"{', '.join(DECODER_FIELDS)}")
        shape[field] = int(n)
    return shape


def build_config(processor: LlavaProcessor, *, text_layers: int = 6, text_heads: int = 4,
                 text_kv_heads: int | None = None, text_hidden: int = 128, text_mlp: int = 384,
                 vision_hidden: int = 128, vision_layers: int = 3, vision_heads: int = 4,
                 image_size: int = IMAGE_SIZE, patch_size: int = PATCH) -> LlavaConfig:
    """LlavaConfig for the tiny model; ids come from ``processor.tokenizer``.

    The vision tower yields (image_size / patch_size)^2 visual tokens (CLS dropped by the
    "default" strategy, last layer's features). Word embeddings are tied.
    """
    tok = processor.tokenizer
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden, intermediate_size=4 * vision_hidden,
        num_hidden_layers=vision_layers, num_attention_heads=vision_heads,
        image_size=image_size, patch_size=patch_size, projection_dim=vision_hidden)
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=text_mlp,
        num_hidden_layers=text_layers, num_attention_heads=text_heads,
        num_key_value_heads=text_kv_heads or text_heads, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
        image_seq_length=(image_size // patch_size) ** 2, vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
