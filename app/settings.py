"""What the operator sets (environment, read when the demo is built), the model allow-list and per-model defaults.

    HAP_APP_MODELS          comma-separated allow-list of model ids / folders; the first is the default
                            (default: the shipped tiny model and the hub checkpoints in HUB_MODELS).
                            Nothing else can be loaded through the page or the API.
    HAP_APP_ALLOW_LOCAL     1 lets allow-listed local folders be loaded (default 0: hub ids only, plus
                            the shipped assets/tiny-llava, which is always allowed)
    HAP_APP_MAX_MB          largest image upload in MB (default 10); gradio refuses a larger upload
                            (HTTP 413) before it is stored, and the handler checks the size before reading
    HAP_APP_MAX_MEGAPIXELS  largest width x height in megapixels (default 40), read from the image
                            header before any pixel is decoded (decompression bombs are refused unread)
    HAP_APP_MAX_PROMPT      longest prompt in characters (default 2000)
    HAP_APP_MAX_TURNS       earlier turns a follow-up question may carry in `history` (default 8)
    HAP_APP_MAX_CONVERSATION  characters of a conversation's questions and answers together (default 8000)
    HAP_APP_SHARE           1 (default): the runs of a request share work: the image is encoded once per client
                            and image (`hap.runs.features`), the method's traced run is also the one it is timed on,
                            and a sweep stops each answer at its third word; 0: every run from the pixels, timed
                            on a separate untraced run (the behaviour before the sharing; `analysis.app_speed`
                            measures both)
    HAP_APP_QUEUE_SIZE      requests that may wait for the one model lane (default 16); a request beyond
                            them is refused at once with gradio's busy message (gradio_client raises
                            QueueError "Queue is full! Please try again.", the page shows "This application
                            is currently busy. Please try again.")

A bad value stops the start with a message naming the variable. Knob defaults that depend on the
model (`Knob.rule` in hap/knobs.py, docs/method.md §4) are resolved from the decoder's depth, read
from the model's config.json or `HUB_MODELS` without loading weights.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from hap.runs.inputs import DEFAULT_LIMITS, InputLimits
from hap.knobs import KNOBS, knob
from hap.patch.processors import options_of

from .editor_guard import HEAD

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = "assets/tiny-llava"
HUB_MODELS = {  # supported hub checkpoints -> decoder layers
    "llava-hf/llava-1.5-7b-hf": 32,
    "llava-hf/llava-interleave-qwen-0.5b-hf": 24,
    "Qwen/Qwen2-VL-2B-Instruct": 28,
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": 24,  # small enough for a CPU
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": 28,
    "llava-hf/llava-v1.6-vicuna-7b-hf": 32,
    "llava-hf/llava-v1.6-mistral-7b-hf": 32,
    "OpenGVLab/InternVL3-1B-hf": 24,
    "OpenGVLab/InternVL3-8B-hf": 28,
    "HuggingFaceTB/SmolVLM-256M-Instruct": 30,  # Idefics3ForConditionalGeneration; small enough for a CPU
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": 24,  # SmolVLMForConditionalGeneration
    "Qwen/Qwen3-VL-2B-Instruct": 28,
    "Qwen/Qwen3-VL-8B-Instruct": 36,
    "google/gemma-3-4b-it": 34,
    "google/gemma-3-12b-it": 48,
}
HUB_ARCHITECTURES = {  # supported hub checkpoints -> model class (their config.json's `architectures`)
    "llava-hf/llava-1.5-7b-hf": "LlavaForConditionalGeneration",
    "llava-hf/llava-interleave-qwen-0.5b-hf": "LlavaForConditionalGeneration",
    "Qwen/Qwen2-VL-2B-Instruct": "Qwen2VLForConditionalGeneration",
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": "LlavaOnevisionForConditionalGeneration",
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": "LlavaOnevisionForConditionalGeneration",
    "llava-hf/llava-v1.6-vicuna-7b-hf": "LlavaNextForConditionalGeneration",
    "llava-hf/llava-v1.6-mistral-7b-hf": "LlavaNextForConditionalGeneration",
    "OpenGVLab/InternVL3-1B-hf": "InternVLForConditionalGeneration",
    "OpenGVLab/InternVL3-8B-hf": "InternVLForConditionalGeneration",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "Idefics3ForConditionalGeneration",
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": "SmolVLMForConditionalGeneration",
    "Qwen/Qwen3-VL-2B-Instruct": "Qwen3VLForConditionalGeneration",
    "Qwen/Qwen3-VL-8B-Instruct": "Qwen3VLForConditionalGeneration",
    "google/gemma-3-4b-it": "Gemma3ForConditionalGeneration",
    "google/gemma-3-12b-it": "Gemma3ForConditionalGeneration",
}
UNKNOWN_DEPTH = 32  # decoder layers assumed when a model's config cannot be read (its load will say why)
EXAMPLES = ROOT / "assets" / "examples"
QUEUE_SIZE = 16


def _env_number(env: Mapping[str, str], name: str, default: float, low: float) -> float:
    """The number in `env[name]` (`default` when unset), else ValueError naming the variable."""
    raw = env.get(name, "").strip()
    if not raw:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= low or math.isinf(value):
        raise ValueError(f"{name}={raw!r} must be a number >= {low:g}")
    return value


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """The flag in `env[name]` (`default` when unset or empty), else ValueError naming the variable."""
    raw = env.get(name, "").strip().lower()
    if raw not in ("", "0", "1", "false", "true", "no", "yes"):
        raise ValueError(f"{name}={raw!r} must be 0 or 1")
    return default if raw == "" else raw in ("1", "true", "yes")


@dataclass(frozen=True)
class Settings:
    """What the operator sets (see the module docstring); `from_env` reads the environment."""

    models: list[str] = field(default_factory=lambda: [TINY_MODEL, *HUB_MODELS])
    allow_local: bool = False
    limits: InputLimits = field(default_factory=lambda: InputLimits(max_bytes=10 * 2**20))
    queue_size: int = QUEUE_SIZE
    share: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        models = [n.strip() for n in env.get("HAP_APP_MODELS", "").split(",") if n.strip()]
        allow, share = (_env_flag(env, name, default) for name, default in (("HAP_APP_ALLOW_LOCAL", False),
                                                                               ("HAP_APP_SHARE", True)))
        limits = InputLimits(
            max_bytes=int(_env_number(env, "HAP_APP_MAX_MB", 10, 0.001) * 2**20),
            max_pixels=int(_env_number(env, "HAP_APP_MAX_MEGAPIXELS", DEFAULT_LIMITS.max_pixels / 1e6, 1e-6) * 1e6),
            max_prompt_chars=int(_env_number(env, "HAP_APP_MAX_PROMPT", DEFAULT_LIMITS.max_prompt_chars, 1)),
            max_history_turns=int(_env_number(env, "HAP_APP_MAX_TURNS", DEFAULT_LIMITS.max_history_turns, 0)),
            max_conversation_chars=int(_env_number(env, "HAP_APP_MAX_CONVERSATION",
                                                   DEFAULT_LIMITS.max_conversation_chars, 1)),
        )
        queue = _env_number(env, "HAP_APP_QUEUE_SIZE", QUEUE_SIZE, 1)
        if not queue.is_integer():
            raise ValueError(f"HAP_APP_QUEUE_SIZE={queue:g} must be a whole number >= 1")
        return cls(models or [TINY_MODEL, *HUB_MODELS], allow, limits, int(queue), share)


def launch_options(limits: InputLimits | None = None) -> dict:
    """`demo.launch` keywords of every deployment (tests add the host and port).

    max_file_size: gradio refuses a larger upload (HTTP 413; gradio_client refuses to send it) before
    storing it; pass the demo's limits when they differ from the environment's. show_error passes the
    message of errors raised outside the handler to the page instead of a generic one. head: the script that holds a
    file given to the image editor while it starts (`app.editor_guard`).
    """
    limits = limits or Settings.from_env().limits
    return dict(theme=gr.themes.Soft(), max_file_size=limits.max_bytes, show_error=True, head=HEAD)


# --- models ----------------------------------------------------------------------------------------
def resolve(name: str) -> str:
    """A model name as `hap.load_model` takes it: repo-relative folders become absolute paths."""
    return str(ROOT / name) if (ROOT / name).is_dir() else name


def is_local(name: str) -> bool:
    """Whether `name` means a folder on this machine rather than a hub id (transformers would read a folder)."""
    return (
        name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
        or Path(resolve(name)).expanduser().is_dir() or Path(name).expanduser().is_dir()
    )


def is_shipped(name: str) -> bool:
    return Path(resolve(name)).resolve() == (ROOT / TINY_MODEL).resolve()


def check_model(name: object, settings: Settings) -> str:
    """`name` if this server may load it, else ValueError saying what is allowed."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model_name={name!r}: choose one of {', '.join(settings.models)}")
    if name not in settings.models:
        raise ValueError(
            f"model {name!r} is not on this server's allow-list (HAP_APP_MODELS); choose one of "
            f"{', '.join(settings.models)}"
        )
    if is_local(name) and not is_shipped(name) and not settings.allow_local:
        raise ValueError(
            f"model {name!r} is a local folder, and loading local folders is off on this server "
            "(the operator enables it with HAP_APP_ALLOW_LOCAL=1); choose a hub model or the shipped tiny model"
        )
    return name


def check_clip(name: str, settings: Settings) -> str:
    """`name` (the `clip_model` knob, cdpruner's CLIP) if this server may load it: the default, or a local folder where
    local folders are allowed; else ValueError saying so (any other hub id would download a checkpoint)."""
    default = knob("clip_model").default
    if name != default and not (is_local(name) and settings.allow_local):
        raise ValueError(f"clip_model={name!r}: this server loads only {default!r}"
                         + (" or a local folder" if settings.allow_local else ""))
    return name


def check_importance(path: str | None, settings: Settings) -> str | None:
    """`path` (the `head_importance` knob) if this server may read it: unset (the model folder's file), or any file
    where local folders are allowed; else ValueError saying so (a path would read the server's files)."""
    if path is not None and not settings.allow_local:
        raise ValueError(f"head_importance={path!r}: this server reads only the model folder's own static head "
                         "importance (leave head_importance empty)")
    return path


def decoder_layers(name: str) -> int:
    """Decoder depth from a local config.json or the known hub ids, without loading weights (UNKNOWN_DEPTH else)."""
    config = Path(resolve(name)) / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
            return int(data.get("text_config", data).get("num_hidden_layers", UNKNOWN_DEPTH))
        except (ValueError, TypeError, AttributeError, OSError):  # an unreadable config: the load will say why
            return UNKNOWN_DEPTH
    return HUB_MODELS.get(name, UNKNOWN_DEPTH)


def architecture(name: str) -> str | None:
    """The model class of `name`: a local config.json's first `architectures`, else `HUB_ARCHITECTURES` (None:
    unknown; the load will say whether it is supported)."""
    config = Path(resolve(name)) / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text())["architectures"][0]
        except (ValueError, TypeError, KeyError, IndexError, OSError):
            return None
    return HUB_ARCHITECTURES.get(name)


def options_taken(name: str) -> tuple[str, ...] | None:
    """The processor options (`hap.options`) the family of model `name` takes (`hap.patch.processors.options_of`),
    without loading it; None where its family is unknown."""
    arch = architecture(name)
    return None if arch is None else options_of(arch)


def knob_defaults(name: str) -> dict[str, object]:
    """Every knob's default for model `name`: the registry's per-model rules applied to its depth."""
    layers = decoder_layers(name)
    return {k.name: k.resolve(layers) for k in KNOBS}


def examples(names: list[str]) -> tuple[list[list], list[list]]:
    """(scene examples for the default model, photographs for a real checkpoint) as [image, prompt, model] rows."""
    scenes, photos = [], []
    if (EXAMPLES / "scenes.json").is_file():
        scenes = [[str(EXAMPLES / e["file"]), e["prompt"], names[0]]
                  for e in json.loads((EXAMPLES / "scenes.json").read_text())]
    hub = next((n for n in names if n in HUB_MODELS), None)
    if hub and (EXAMPLES / "photos" / "photos.json").is_file():
        photos = [[str(EXAMPLES / "photos" / e["file"]), e["prompt"], hub]
                  for e in json.loads((EXAMPLES / "photos" / "photos.json").read_text())]
    return scenes, photos
