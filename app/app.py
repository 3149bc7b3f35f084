"""The HAP demo: one image and prompt through the full pipeline, every view of the design card.

Run `python -m app` (or `python app/app.py`, the Space's `app_file`). Scripts call the main
handler as `/analyze` (see `Handler.analyze` for the inputs and outputs). Settings (environment,
read when the demo is built; a bad value stops the start with a message naming the variable):

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
    HAP_APP_QUEUE_SIZE      requests that may wait for the one model lane (default 16); a request beyond
                            them is refused at once with gradio's busy message (gradio_client raises
                            QueueError "Queue is full! Please try again.", the page shows "This application
                            is currently busy. Please try again.")

Every request is checked in full by the handler (gradio's own preprocessing is off, so an API call
gets the same messages as the page): the image goes through `hap.inputs.load_image` (any PIL mode,
first frame, EXIF rotation; empty, truncated, non-image and oversized files refused), each numeric
setting is checked against the range of its control, and the model against the allow-list. Bad input,
a model that fails to load (the previous one stays loaded) and running out of memory (memory is freed)
come back to that user as a `gr.Error` with the message, never a traceback; the server keeps serving.
Models load with safetensors weights only and never run remote code (`hap.load_model`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file (a Space's app_file): make `hap` and `analysis` importable
    sys.path.insert(0, str(ROOT))

import gradio as gr  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

import hap  # noqa: E402
from analysis import figures as views  # noqa: E402
from analysis.report import LABELS, TEACHING, answer_card, compare, explanation, summary  # noqa: E402
from hap.inputs import DEFAULT_LIMITS, FORMATS, InputLimits, clean_prompt, load_image  # noqa: E402
from hap.run import free_memory  # noqa: E402

try:
    import spaces

    gpu = spaces.GPU(duration=120)
except ImportError:  # not on ZeroGPU: run as is

    def gpu(fn):
        return fn


LOG = logging.getLogger("hap.app")
TINY_MODEL = "assets/tiny-llava"
HUB_MODELS = {  # supported hub checkpoints -> decoder layers
    "llava-hf/llava-1.5-7b-hf": 32,
    "llava-hf/llava-interleave-qwen-0.5b-hf": 24,
    "Qwen/Qwen2-VL-2B-Instruct": 28,
}
EXAMPLES = ROOT / "assets" / "examples"
MAX_NEW_TOKENS = 32
QUEUE_SIZE = 16
SEED = 0


@dataclass(frozen=True)
class Knob:
    """The allowed range of a numeric setting: the range of its control on the page."""

    low: float
    high: float
    whole: bool = False

    def check(self, name: str, value) -> float | int:
        """`value` as a number in range, else ValueError naming the field and the range."""
        kind = "a whole number" if self.whole else "a number"
        allowed = f"{kind} in [{self.low:g}, {self.high:g}]"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}={value!r} ({type(value).__name__}) must be {allowed}")
        if math.isnan(value):
            raise ValueError(f"{name}=nan is not a number; allowed: {allowed}")
        if value < self.low:
            raise ValueError(f"{name}={value:g} is less than minimum {self.low:g}; allowed: {allowed}")
        if value > self.high:
            raise ValueError(f"{name}={value:g} is greater than maximum {self.high:g}; allowed: {allowed}")
        if self.whole:
            if not float(value).is_integer():
                raise ValueError(f"{name}={value!r} must be {allowed}")
            return int(value)
        return float(value)


KNOBS = {  # the sliders' ranges; the API is held to the same ones
    "retain": Knob(0.01, 1.0),
    "groups": Knob(1, 8, whole=True),
    "first_layers": Knob(0, 8, whole=True),
    "decay": Knob(0.05, 1.0),
    "tau_sink": Knob(0.0, 1.0),
    "tau_disp": Knob(0.0, 1.0),
    "sink_rho": Knob(1.0, 100.0),
}
MAX_TEMPERATURE = 1000.0


def _temperature(value) -> float:
    """The temperature field: 0 means uniform averaging (T = inf), else a number in (0, MAX_TEMPERATURE]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0 \
            or value > MAX_TEMPERATURE:
        raise ValueError(
            f"temperature={value!r} must be a number > 0, or 0 for uniform averaging; allowed: [0, {MAX_TEMPERATURE:g}]"
        )
    return math.inf if value == 0 else float(value)


def _choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {', '.join(choices)}")
    return value


def _env_number(env, name: str, default: float, low: float) -> float:
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


@dataclass(frozen=True)
class Settings:
    """What the operator sets (see the module docstring); `from_env` reads the environment."""

    models: list[str] = field(default_factory=lambda: [TINY_MODEL, *HUB_MODELS])
    allow_local: bool = False
    limits: InputLimits = field(default_factory=lambda: InputLimits(max_bytes=10 * 2**20))
    queue_size: int = QUEUE_SIZE

    @classmethod
    def from_env(cls, env=None) -> Settings:
        env = os.environ if env is None else env
        models = [n.strip() for n in env.get("HAP_APP_MODELS", "").split(",") if n.strip()]
        allow = env.get("HAP_APP_ALLOW_LOCAL", "0").strip().lower()
        if allow not in ("", "0", "1", "false", "true", "no", "yes"):
            raise ValueError(f"HAP_APP_ALLOW_LOCAL={allow!r} must be 0 or 1")
        limits = InputLimits(
            max_bytes=int(_env_number(env, "HAP_APP_MAX_MB", 10, 0.001) * 2**20),
            max_pixels=int(_env_number(env, "HAP_APP_MAX_MEGAPIXELS", DEFAULT_LIMITS.max_pixels / 1e6, 1e-6) * 1e6),
            max_prompt_chars=int(_env_number(env, "HAP_APP_MAX_PROMPT", DEFAULT_LIMITS.max_prompt_chars, 1)),
        )
        queue = _env_number(env, "HAP_APP_QUEUE_SIZE", QUEUE_SIZE, 1)
        if not queue.is_integer():
            raise ValueError(f"HAP_APP_QUEUE_SIZE={queue:g} must be a whole number >= 1")
        return cls(models or [TINY_MODEL, *HUB_MODELS], allow in ("1", "true", "yes"), limits, int(queue))


def allowed_models() -> list[str]:
    """The allow-list from HAP_APP_MODELS, else the shipped tiny model and the supported hub checkpoints."""
    return Settings.from_env().models


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


def check_model(name, settings: Settings) -> str:
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


@dataclass(frozen=True)
class Defaults:
    """Settings that depend on the model's depth (the budget floor is about first_layers / layers)."""

    first_layers: int
    retain: float

    @classmethod
    def for_model(cls, name: str) -> Defaults:
        """FastV's K=2 and the 64-of-576 budget on deep models; on shallow ones, cut before layer 0, keep a quarter."""
        if cls.decoder_layers(name) >= 16:
            return cls(first_layers=2, retain=0.111)
        return cls(first_layers=0, retain=0.25)

    @staticmethod
    def decoder_layers(name: str) -> int:
        """Decoder depth from a local config.json or the known hub ids, without loading weights (32 if unknown)."""
        config = Path(resolve(name)) / "config.json"
        if config.is_file():
            try:
                data = json.loads(config.read_text())
                return int(data.get("text_config", data).get("num_hidden_layers", 32))
            except (ValueError, TypeError, AttributeError, OSError):  # an unreadable config: the load will say why
                return 32
        return HUB_MODELS.get(name, 32)


class LoadedModel:
    """The one model held in memory. Loading another replaces it only once the new one has loaded."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.model = None
        self.processor = None

    def get(self, name: str):
        """(model, processor) of `name`, loading it on first use; raises hap.ModelLoadError (the old one stays)."""
        if name != self.name:
            model, processor = hap.load_model(resolve(name))
            self.model, self.processor, self.name = model, processor, name
            free_memory()  # the replaced model's weights
        return self.model, self.processor

    def center_crop(self) -> bool:
        """Whether the processor crops the centre square (CLIP) rather than squashing the image (SigLIP)."""
        return bool(getattr(self.processor.image_processor, "do_center_crop", False))

    def reset(self) -> None:
        """Leave the loaded model stock after a request, whatever happened (no patch left behind)."""
        if self.model is not None:
            hap.unpatch(self.model)


LOADED = LoadedModel()


def upload_path(image) -> tuple[str | Image.Image, str]:
    """(what `load_image` reads, the name to show) of the image input: an uploaded file (gradio's FileData,
    already in gradio's upload cache) or, in-process, a PIL image."""
    if image is None:
        raise ValueError("no image: upload one or click an example")
    if isinstance(image, Image.Image):
        return image, "image"
    if isinstance(image, dict) and isinstance(image.get("path"), str) and image["path"]:
        return image["path"], Path(str(image.get("orig_name") or image["path"])).name
    raise ValueError(f"the image must be an uploaded file ({FORMATS}; gradio_client: handle_file(path))")


def describe_input(source, name: str, img: Image.Image) -> tuple[dict, str]:
    """What was uploaded and how it was converted: JSON for API callers and a line for the page."""
    info = {"file": name, "width": img.width, "height": img.height}
    opened = nullcontext(source) if isinstance(source, Image.Image) else Image.open(source)  # header only
    with opened as src:
        info.update(format=src.format, mode=src.mode, animated=bool(getattr(src, "is_animated", False)),
                    exif_orientation=int(src.getexif().get(0x0112, 1)))
        transparent = "A" in src.mode or "transparency" in src.info
    steps = [f"{info['format'] or 'image'} {info['mode']}"]
    if info["mode"] != "RGB":
        steps.append(f"converted to RGB{' (transparent pixels on white)' if transparent else ''}")
    if info["animated"]:
        steps.append("first frame of the animation")
    if info["exif_orientation"] != 1:
        steps.append(f"EXIF orientation {info['exif_orientation']} applied")
    steps.append(f"{img.width} x {img.height} pixels")
    return info, "; ".join(steps)


@gpu
def _compare(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits, progress: gr.Progress):
    """The GPU part: the three runs on the loaded model.

    On ZeroGPU this runs in a forked worker, so the model is loaded before (in the main process,
    where it persists between calls) and read from LOADED here, not loaded inside.
    """
    return compare(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS,
                   lambda fraction, description: progress(fraction, desc=description), limits)


class Handler:
    """`/analyze` of one demo: checks every input against the demo's `Settings`, then runs the pipeline."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def check(self, image, prompt, model_name, method, retain, groups, first_layers, decay, temperature,
              tau_sink, tau_disp, sink_rho, rows) -> tuple[str | Image.Image, str, str, str, hap.HAPConfig]:
        """Every input checked, cheapest first; ValueError names the first that is wrong and what is allowed."""
        source, name = upload_path(image)
        limits = self.settings.limits
        clean_prompt(prompt, set(), limits)  # type, length, empty; hap.run cleans it (and says what it removed)
        model_name = check_model(model_name, self.settings)
        values = {k: KNOBS[k].check(k, v) for k, v in dict(
            retain=retain, groups=groups, first_layers=first_layers, decay=decay, tau_sink=tau_sink,
            tau_disp=tau_disp, sink_rho=sink_rho).items()}
        config = hap.HAPConfig(  # validates the combination too, naming the field that is wrong
            method=_choice("method", method, hap.METHODS), rows=_choice("rows", rows, ("prompt", "last")),
            temperature=_temperature(temperature), seed=SEED, **values,
        )
        return source, name, prompt, model_name, config

    def analyze(
        self,
        image,
        prompt: str,
        model_name: str,
        method: str,
        retain: float,
        groups: float,
        first_layers: float,
        decay: float,
        temperature: float,
        tau_sink: float,
        tau_disp: float,
        sink_rho: float,
        rows: str,
        progress: gr.Progress = gr.Progress(),
    ):
        """Run the full pipeline; see the module docstring.

        Inputs: image, prompt, model, method, retain, groups, first layers, decay, temperature (0 =
        uniform), tau_sink, tau_disp, sink_rho, rows ("prompt" or "last"). Outputs: three answer cards (unpruned, chosen
        method, uniform), kept-token masks, head classes, PAQ, layer shown, per-head maps, per-layer
        maps, per-group maps, uniform vs PAQ, explanation, JSON summary (with "input": the upload and its
        conversion); and the state for re-drawing. Any failure is a gr.Error with the message.
        """
        try:
            return self._analyze(image, prompt, model_name, method, retain, groups, first_layers, decay,
                                 temperature, tau_sink, tau_disp, sink_rho, rows, progress)
        except gr.Error:
            raise
        except (ValueError, OSError) as err:  # invalid input or setting; unknown, refused or unloadable model
            raise gr.Error(str(err), print_exception=False) from err
        except (MemoryError, torch.OutOfMemoryError) as err:
            free_memory()
            message = str(err) if isinstance(err, MemoryError) and "memory was freed" in str(err) else (
                f"out of memory ({err.__class__.__name__}); memory was freed. "
                "Try a smaller image, a smaller model or again later")
            raise gr.Error(message, print_exception=False) from err
        except Exception as err:  # a bug: log it here, tell the user without the traceback, keep serving
            LOG.exception("analyze failed")
            free_memory()
            raise gr.Error(f"internal error ({err.__class__.__name__}: {err}); the server is still running",
                           print_exception=False) from err
        finally:
            LOADED.reset()

    def _analyze(self, image, prompt, model_name, method, retain, groups, first_layers, decay, temperature,
                 tau_sink, tau_disp, sink_rho, rows, progress):
        source, name, prompt, model_name, config = self.check(
            image, prompt, model_name, method, retain, groups, first_layers, decay, temperature, tau_sink, tau_disp,
            sink_rho, rows)
        try:
            img = load_image(source, self.settings.limits)
        except ValueError as err:
            raise ValueError(f"image {name!r}: {err}") from err
        info, conversion = describe_input(source, name, img)
        progress(0.02, desc=f"loading {model_name}")
        LOADED.get(model_name)
        torch.manual_seed(SEED)
        comparison = _compare(img, prompt, config, self.settings.limits, progress)
        progress(0.85, desc="figures")
        result = comparison.pruned
        view = views.model_view(img, LOADED.center_crop())
        layer = views.default_layer(result)
        figs = views.figures(result, view, layer)
        data = summary(comparison, model_name)
        data["input"] = info
        return (
            *(answer_card(label, r) for label, r in comparison.items()),
            figs["kept_masks"],
            figs["head_classes"],
            figs["paq"],
            gr.Slider(value=layer, maximum=result.num_layers - 1, interactive=True),
            figs["head_maps"],
            figs["layer_maps"],
            figs["group_maps"],
            figs["uniform_vs_paq"],
            explanation(comparison) + f"\n- Input: {conversion}.",
            data,
            (result, view),
        )


def show_layer(state, layer: float):
    """Re-draw the per-head maps for another layer from the stored result (no model call)."""
    if state is None:
        raise gr.Error("press Run first")
    result, view = state
    return views.head_maps_figure(result, view, int(layer))


def model_defaults(model_name: str):
    """Advanced settings suited to the chosen model."""
    d = Defaults.for_model(model_name)
    return gr.Slider(value=d.first_layers), gr.Slider(value=d.retain)


def _examples(names: list[str]) -> tuple[list[list], list[list]]:
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


def build_demo(
    models: list[str] | None = None,
    *,
    allow_local: bool | None = None,
    limits: InputLimits | None = None,
    queue_size: int | None = None,
) -> gr.Blocks:
    """The Blocks app with the environment's `Settings`; the arguments override them.

    `models` is the allow-list (its first entry is the default).
    """
    settings = Settings.from_env()
    settings = replace(
        settings,
        models=models or settings.models,
        allow_local=settings.allow_local if allow_local is None else allow_local,
        limits=limits or settings.limits,
        queue_size=queue_size or settings.queue_size,
    )
    names = settings.models
    handler = Handler(settings)
    defaults = Defaults.for_model(names[0])
    with gr.Blocks(title="HAP: head-adaptive visual token pruning") as demo:
        gr.Markdown(
            "# HAP: head-adaptive visual token pruning\n"
            "Upload an image (or click an example), ask a question, choose a budget and press **Run**. "
            "HAP scores every attention head by how well it aligns the prompt with the image (PAQ), fuses "
            "heads with those weights, and keeps only the best visual tokens inside the decoder.\n\n"
            f"Images: {FORMATS}, up to {settings.limits.max_bytes / 2**20:g} MB and "
            f"{settings.limits.max_pixels / 1e6:g} megapixels; prompts up to {settings.limits.max_prompt_chars} "
            "characters. One request runs at a time; when the queue is full, retry in a few seconds."
        )
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                image = gr.Image(type="filepath", image_mode=None, label="Image", height=280)
                prompt = gr.Textbox(label="Prompt", placeholder="what color is the triangle ?", lines=2)
                model = gr.Dropdown(names, value=names[0], label="Model (loaded on first use)")
                method = gr.Radio(list(hap.METHODS), value="hap", label="Method")
                retain = gr.Slider(*_range("retain"), value=defaults.retain, step=0.001,
                                   label="Budget: fraction of visual tokens kept (average over all layers)")
                with gr.Accordion("Advanced settings", open=False):
                    groups = gr.Slider(*_range("groups"), value=3, step=1,
                                       label="Groups of layers after the first ones")
                    first_layers = gr.Slider(*_range("first_layers"), value=defaults.first_layers, step=1,
                                             label="First layers on all tokens (0 cuts before layer 0)")
                    decay = gr.Slider(*_range("decay"), value=0.5, step=0.05, label="Budget decay between groups")
                    temperature = gr.Number(0.1, minimum=0, maximum=MAX_TEMPERATURE,
                                            label="Temperature T of softmax(PAQ / T) (0 = uniform)")
                    tau_sink = gr.Slider(*_range("tau_sink"), value=0.5, step=0.01,
                                         label="Sink threshold on sink share")
                    tau_disp = gr.Slider(*_range("tau_disp"), value=0.9, step=0.01,
                                         label="Dispersed threshold on dispersion")
                    sink_rho = gr.Slider(*_range("sink_rho"), value=10.0, step=0.5,
                                         label="Sink tokens: hidden-state norm above rho x the median")
                    rows = gr.Radio(["prompt", "last"], value="prompt",
                                    label="Prompt rows scoring tokens (all prompt tokens / last token)")
                run = gr.Button("Run", variant="primary", elem_id="run")
            with gr.Column(scale=2):
                with gr.Row(equal_height=True):
                    cards = [gr.Markdown(f"#### {LABELS[k]}\n(no run yet)", elem_id=f"answer-{k}", container=True)
                             for k in LABELS]
                kept = gr.Plot(label="Kept visual tokens per group", elem_id="plot-kept")
                with gr.Accordion("What am I looking at?", open=True):
                    explain = gr.Markdown(TEACHING, elem_id="explanation")
        scenes, photos = _examples(names)
        with gr.Row():
            if scenes:
                gr.Examples(scenes, [image, prompt, model], label="Synthetic scenes (the shipped tiny model)")
            if photos:
                gr.Examples(photos, [image, prompt, model], label="Photographs (real checkpoints; need the weights)")
        gr.Markdown("## Head heterogeneity")
        with gr.Row():
            classes = gr.Plot(label="Head classes", elem_id="plot-classes")
            paq = gr.Plot(label="PAQ", elem_id="plot-paq")
        gr.Markdown("## Attention maps over the image")
        layer = gr.Slider(0, 1, value=0, step=1, label="Layer for the per-head maps", interactive=False,
                          elem_id="layer-slider")
        head_maps = gr.Plot(label="Per head, before fusion", elem_id="plot-heads")
        layer_maps = gr.Plot(label="Per layer, after head fusion", elem_id="plot-layers")
        group_maps = gr.Plot(label="Per group, after layer fusion", elem_id="plot-groups")
        versus = gr.Plot(label="Uniform average vs PAQ weighting", elem_id="plot-versus")
        with gr.Accordion("Raw result (JSON)", open=False):
            raw = gr.JSON(label="Result")
        state = gr.State()

        inputs = [image, prompt, model, method, retain, groups, first_layers, decay, temperature,
                  tau_sink, tau_disp, sink_rho, rows]
        outputs = [*cards, kept, classes, paq, layer, head_maps, layer_maps, group_maps, versus, explain, raw, state]
        # preprocess=False: the handler checks every raw value itself (gradio would decode the upload and
        # range-check sliders with messages that do not name the field); files still arrive through
        # gradio's upload cache, which refuses paths outside it
        lane = dict(concurrency_limit=1, concurrency_id="model", preprocess=False)
        run.click(handler.analyze, inputs, outputs, api_name="analyze", **lane)
        prompt.submit(handler.analyze, inputs, outputs, api_visibility="private", **lane)
        layer.input(show_layer, [state, layer], head_maps, api_visibility="private", trigger_mode="always_last")
        model.change(model_defaults, model, [first_layers, retain], api_visibility="private")
    demo.queue(max_size=settings.queue_size)
    demo.hap_handler = handler  # its `settings` are what this demo enforces
    return demo


def _range(name: str) -> tuple[float, float]:
    return KNOBS[name].low, KNOBS[name].high


demo = build_demo()


def launch_options(limits: InputLimits | None = None) -> dict:
    """`demo.launch` keywords of every deployment (tests add the host and port).

    max_file_size: gradio refuses a larger upload (HTTP 413; gradio_client refuses to send it) before
    storing it; pass the demo's limits when they differ from the environment's. show_error passes the
    message of errors raised outside the handler to the page instead of a generic one.
    """
    limits = limits or Settings.from_env().limits
    return dict(theme=gr.themes.Soft(), max_file_size=limits.max_bytes, show_error=True)


def main() -> None:
    """Serve the demo (127.0.0.1:7860 unless GRADIO_SERVER_NAME / GRADIO_SERVER_PORT say otherwise)."""
    demo.launch(**launch_options(demo.hap_handler.settings.limits))


if __name__ == "__main__":
    main()
