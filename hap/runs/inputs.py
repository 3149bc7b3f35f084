"""Checked inputs: any image a user can upload and any prompt they can type become a clean RGB
image and a safe chat prompt, or a ValueError that says what was wrong and what is allowed.

Limits are a dataclass with defaults; the app passes its own (a Space may want smaller ones).
The byte and pixel limits are enforced from the file size and the image header, before the
pixels are decoded, so a decompression bomb is refused without being expanded.
"""

from __future__ import annotations

import io
import json
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

FORMATS = "PNG, JPEG, GIF, WebP, BMP, TIFF"


@dataclass(frozen=True)
class InputLimits:
    max_bytes: int = 20 * 2**20  # an uploaded file larger than this is refused unread
    max_pixels: int = 40_000_000  # width * height read from the header, before decoding
    max_prompt_chars: int = 2000  # the model's context is checked too, in tokens, by hap.run
    max_history_turns: int = 8  # earlier (question, answer) turns a follow-up question may carry
    max_conversation_chars: int = 8000  # characters of every question and answer of a conversation, together


DEFAULT_LIMITS = InputLimits()


def load_image(image, limits: InputLimits = DEFAULT_LIMITS) -> Image.Image:
    """A PIL image, a file path, raw bytes or an `[H, W, 3|4]` / `[H, W]` uint8 array -> RGB PIL image.

    Grayscale, palette, RGBA (composited on white), CMYK and 16-bit images are converted; an
    animated image gives its first frame; EXIF orientation is applied.
    """
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise ValueError(f"image file not found: {path}")
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"the image file {path.name} is empty (0 bytes); upload a {FORMATS} image")
        if size > limits.max_bytes:
            raise ValueError(f"the image file is {size / 2**20:.1f} MB; the limit is {limits.max_bytes / 2**20:.0f} MB")
        return _decode(lambda: Image.open(path), limits)
    if isinstance(image, (bytes, bytearray)):
        if not image:
            raise ValueError(f"the image is empty (0 bytes); upload a {FORMATS} image")
        if len(image) > limits.max_bytes:
            raise ValueError(f"the image is {len(image) / 2**20:.1f} MB; the limit is {limits.max_bytes / 2**20:.0f} MB")
        return _decode(lambda: Image.open(io.BytesIO(image)), limits)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise ValueError(
                f"an image array must be uint8 of shape [H, W], [H, W, 3] or [H, W, 4], not {image.dtype} {image.shape}"
            )
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise ValueError(f"image must be a PIL image, a file path, bytes or a numpy array, not {type(image).__name__}")
    _check_pixels(image.size, limits)
    return _to_rgb(image)


def _check_pixels(size: tuple[int, int], limits: InputLimits) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ValueError(f"the image has no pixels ({w} x {h})")
    if w * h > limits.max_pixels:
        raise ValueError(
            f"the image is {w} x {h} = {w * h / 1e6:.1f} megapixels; the limit is {limits.max_pixels / 1e6:.0f} megapixels"
        )


def _decode(opener, limits: InputLimits) -> Image.Image:
    try:
        with opener() as img:
            _check_pixels(img.size, limits)  # from the header: nothing decoded yet
            img.seek(0)  # the first frame of an animation
            lenient, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False  # a library may set it
            try:  # (lmms-eval's task module does, process-wide): a truncated file is refused all the same
                img.load()
            finally:
                ImageFile.LOAD_TRUNCATED_IMAGES = lenient
            return _to_rgb(img)
    except Image.DecompressionBombError as err:
        raise ValueError(
            f"the image has over {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels (refused from its header); "
            f"the limit is {limits.max_pixels / 1e6:.0f} megapixels"
        ) from err
    except UnidentifiedImageError as err:
        raise ValueError(f"not a readable image ({err.__class__.__name__}); allowed formats: {FORMATS}") from err
    except (OSError, SyntaxError, EOFError) as err:  # truncated or corrupt data
        raise ValueError(f"the image file is truncated or corrupt ({err}); allowed formats: {FORMATS}") from err


def _to_rgb(img: Image.Image) -> Image.Image:
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        scale = 1 / 256 if img.mode.startswith("I;16") or np.asarray(img).max() > 255 else 1
        img = Image.fromarray(np.clip(np.asarray(img, dtype=np.float64) * scale, 0, 255).astype(np.uint8))
    if img.mode in ("P", "PA"):
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA"):
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, img.convert("RGBA"))
    return img.convert("RGB")


def check_history(history, limits: InputLimits = DEFAULT_LIMITS) -> list[tuple[str, str]]:
    """The earlier turns of a conversation as `(question, answer)` pairs, from a list of `[question, answer]`
    pairs of strings (or that list as JSON text); None or "" is no history. ValueError names what is wrong."""
    if history is None or (isinstance(history, str) and not history.strip()):
        return []
    if isinstance(history, str):
        try:
            history = json.loads(history)
        except json.JSONDecodeError as err:
            raise ValueError(f"history is not valid JSON ({err}); give a list of [question, answer] pairs") from err
    if not isinstance(history, (list, tuple)):
        raise ValueError(f"history must be a list of [question, answer] pairs, not {type(history).__name__}")
    if len(history) > limits.max_history_turns:
        raise ValueError(f"the history has {len(history)} turns; the limit is {limits.max_history_turns}: "
                         "start a new conversation")
    pairs = []
    for i, turn in enumerate(history):
        if not isinstance(turn, (list, tuple)) or len(turn) != 2:
            raise ValueError(f"history[{i}] must be a [question, answer] pair, not {_short(turn)}")
        if not all(isinstance(text, str) for text in turn):
            raise ValueError(f"history[{i}] must hold two strings (question, answer), not "
                             f"{', '.join(type(text).__name__ for text in turn)}")
        if not turn[0].strip():
            raise ValueError(f"history[{i}]: the question is empty")
        pairs.append((turn[0], turn[1]))
    return pairs


def _short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def clean_conversation(prompt, history, special_tokens: set[str], limits: InputLimits = DEFAULT_LIMITS
                       ) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(the prompt, the history's pairs, notes), each text cleaned as `clean_prompt` cleans a prompt (an
    answer may be empty), the history checked by `check_history` and the whole conversation bounded by
    `limits.max_conversation_chars`."""
    pairs = check_history(history, limits)
    total = sum(len(q) + len(a) for q, a in pairs) + (len(prompt) if isinstance(prompt, str) else 0)
    if total > limits.max_conversation_chars:
        raise ValueError(f"the conversation has {total} characters; the limit is {limits.max_conversation_chars}: "
                         "start a new conversation")
    prompt, notes = clean_prompt(prompt, special_tokens, limits)
    cleaned = []
    for i, (q, a) in enumerate(pairs):
        try:
            q, q_notes = clean_prompt(q, special_tokens, limits)
            a, a_notes = clean_prompt(a, special_tokens, limits) if a.strip() else ("", [])
        except ValueError as err:
            raise ValueError(f"history[{i}]: {err}") from err
        notes += [f"history[{i}]: {note}" for note in q_notes + a_notes]
        cleaned.append((q, a))
    return prompt, cleaned, notes


def clean_prompt(prompt, special_tokens: set[str], limits: InputLimits = DEFAULT_LIMITS) -> tuple[str, list[str]]:
    """The prompt without control characters or special tokens, and notes on what was removed.

    Special tokens (the image token, BOS/EOS, chat markers) are removed so typed text can never
    add an image slot or end the turn. Right-to-left and other non-ASCII text is kept as typed.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be text, not {type(prompt).__name__}")
    if len(prompt) > limits.max_prompt_chars:
        raise ValueError(f"the prompt has {len(prompt)} characters; the limit is {limits.max_prompt_chars}")
    notes = []
    kept = "".join(c for c in prompt if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co"))
    kept = kept.replace("\t", " ")
    if kept != prompt:
        notes.append("removed control or invisible formatting characters from the prompt")
    for token in sorted(special_tokens, key=lambda t: (-len(t), t)):  # longest first, then a fixed order
        if token and token in kept:
            kept = kept.replace(token, " ")
            notes.append(f"removed the special token {token!r} from the prompt")
    if not kept.strip():
        raise ValueError("the prompt is empty: type a question about the image")
    return kept.strip(), notes
