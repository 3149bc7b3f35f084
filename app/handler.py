"""The request handler behind `/analyze`: every input checked, the one loaded model, named outputs.

Every request is checked in full here (gradio's own preprocessing is off, so an API call gets the
same messages as the page): the image goes through `hap.inputs.load_image` (any PIL mode, first
frame, EXIF rotation; empty, truncated, non-image and oversized files refused), every knob through
its registry entry (`hap.knobs.Knob.check`, then `HAPConfig` for the combination), and the model
against the allow-list (`app.settings.check_model`). Bad input, a model that fails to load (the
previous one stays loaded) and running out of memory (memory is freed) come back to that user as a
`gr.Error` with the message, never a traceback; the server keeps serving. Models load with
safetensors weights only and never run remote code (`hap.load_model`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import gradio as gr
import torch
from PIL import Image

import hap
from analysis.report import answer_card, explanation, summary
from hap import views
from hap.compare import compare
from hap.inputs import FORMATS, InputLimits, clean_prompt, load_image
from hap.knobs import KNOBS
from hap.run import free_memory

from .settings import Settings, check_model, resolve

try:
    import spaces

    gpu = spaces.GPU(duration=120)
except ImportError:  # not on ZeroGPU: run as is

    def gpu(fn):
        return fn


LOG = logging.getLogger("hap.app")
MAX_NEW_TOKENS = 32
SEED = 0
CARDS = ("unpruned", "pruned", "uniform")  # the answer cards, in `Comparison.items()` order
OUTPUTS = (*CARDS, "layer", *(v.name for v in views.VIEWS), "explanation", "summary", "state")


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


def check_settings(settings: dict) -> hap.HAPConfig:
    """The knobs of one request as a config: each value through its registry entry, the combination through
    `HAPConfig`; ValueError names the first wrong one and what is allowed. A `flops_ratio` given replaces
    `retain` (the page always sends a retain); None leaves a knob at its per-model default."""
    unknown = set(settings) - {k.name for k in KNOBS}
    if unknown:
        raise ValueError(f"unknown settings {', '.join(sorted(unknown))}; known: {', '.join(k.name for k in KNOBS)}")
    values = {k.name: k.check(settings.get(k.name)) for k in KNOBS}
    if values["flops_ratio"] is not None:
        values["retain"] = None
    return hap.HAPConfig(**values, seed=SEED)


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

    def analyze(self, image, prompt: str, model_name: str, progress: gr.Progress = gr.Progress(),
                **settings) -> dict[str, object]:
        """Run the full pipeline; `settings` are the knobs of hap/knobs.py by name (`KNOBS`).

        Returns the outputs by name (`OUTPUTS`): the three answer cards, the layer slider, every view of
        `hap.views.VIEWS`, the explanation, the JSON summary (with "input": the upload and its conversion)
        and the state for re-drawing. Any failure is a gr.Error with the message.
        """
        try:
            return self._analyze(image, prompt, model_name, settings, progress)
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

    def check(self, image, prompt, model_name, settings: dict) -> tuple[str | Image.Image, str, str, hap.HAPConfig]:
        """Every input checked, cheapest first: (image source, its name, model, config)."""
        source, name = upload_path(image)
        clean_prompt(prompt, set(), self.settings.limits)  # type, length, empty; hap.run cleans it (and says what)
        return source, name, check_model(model_name, self.settings), check_settings(settings)

    def _analyze(self, image, prompt, model_name, settings: dict, progress) -> dict[str, object]:
        source, name, model_name, config = self.check(image, prompt, model_name, settings)
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
        data = views.ViewData.from_result(comparison.pruned, img, LOADED.center_crop())
        report = summary(comparison, model_name)
        report["input"] = info
        return {
            **{label: answer_card(label, r) for label, r in comparison.items()},
            "layer": gr.Slider(value=data.layer, maximum=data.shape[0] - 1, interactive=True),
            **views.figures(data),
            "explanation": explanation(comparison) + f"\n- Input: {conversion}.",
            "summary": report,
            "state": data,
        }

    def endpoint(self, components: dict[str, gr.components.Component]) -> Callable:
        """`analyze` as gradio calls it: outputs given to `components` by name, and a signature naming every
        knob (keyword-only, default None), which gradio reads for the `/analyze` parameter names and defaults."""

        def call(*args, **kwargs):
            return {components[name]: value for name, value in self.analyze(*args, **kwargs).items()}

        signature = inspect.signature(self.analyze)
        fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        knobs = [inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=None) for k in KNOBS]
        call.__signature__ = signature.replace(parameters=fixed + knobs)
        call.__name__ = "analyze"
        return call


def show_layer(state: views.ViewData | None, layer: float):
    """Re-draw the per-head maps for another layer from the stored run (no model call)."""
    if state is None:
        raise gr.Error("press Run first")
    try:
        return views.VIEW["head_maps"].figure(state.at_layer(int(layer)))
    except ValueError as err:
        raise gr.Error(str(err), print_exception=False) from err
