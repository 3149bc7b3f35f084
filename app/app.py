"""The HAP demo: one image and prompt through the full pipeline, every view of the design card.

Run `python -m app` (or `python app/app.py`, the Space's `app_file`). Scripts call the main
handler as `/analyze` (see `analyze` for the inputs and outputs). Settings (environment):

    HAP_APP_MODELS   comma-separated allow-list of model ids / folders; the first is the default
                     (default: the shipped tiny model and the hub checkpoints in HUB_MODELS)
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file (a Space's app_file): make `hap` and `analysis` importable
    sys.path.insert(0, str(ROOT))

import gradio as gr  # noqa: E402
from PIL import Image  # noqa: E402

import hap  # noqa: E402
from analysis import figures as views  # noqa: E402
from analysis.report import LABELS, TEACHING, answer_card, compare, explanation, summary  # noqa: E402

try:
    import spaces

    gpu = spaces.GPU(duration=120)
except ImportError:  # not on ZeroGPU: run as is

    def gpu(fn):
        return fn


TINY_MODEL = "assets/tiny-llava"
HUB_MODELS = {  # supported hub checkpoints -> decoder layers
    "llava-hf/llava-1.5-7b-hf": 32,
    "llava-hf/llava-interleave-qwen-0.5b-hf": 24,
    "Qwen/Qwen2-VL-2B-Instruct": 28,
}
EXAMPLES = ROOT / "assets" / "examples"
MAX_NEW_TOKENS = 32
QUEUE_SIZE = 16


def allowed_models() -> list[str]:
    """The allow-list from HAP_APP_MODELS, else the shipped tiny model and the supported hub checkpoints."""
    names = [n.strip() for n in os.environ.get("HAP_APP_MODELS", "").split(",") if n.strip()]
    return names or [TINY_MODEL, *HUB_MODELS]


def resolve(name: str) -> str:
    """A model name as `hap.load_model` takes it: repo-relative folders become absolute paths."""
    return str(ROOT / name) if (ROOT / name).is_dir() else name


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
            data = json.loads(config.read_text())
            return data.get("text_config", data).get("num_hidden_layers", 32)
        return HUB_MODELS.get(name, 32)


class LoadedModel:
    """The one model held in memory. Loading another replaces it only once the new one has loaded."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.model = None
        self.processor = None

    def get(self, name: str):
        """(model, processor) of `name`, loading it on first use; raises hap.ModelLoadError."""
        if name != self.name:
            self.model, self.processor = hap.load_model(resolve(name))
            self.name = name
        return self.model, self.processor

    def center_crop(self) -> bool:
        """Whether the processor crops the centre square (CLIP) rather than squashing the image (SigLIP)."""
        return bool(getattr(self.processor.image_processor, "do_center_crop", False))


LOADED = LoadedModel()


def _integer(name: str, value: float | None) -> int:
    """A slider's whole-number value as an int (API callers may send 3.0, never 2.5)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not float(value).is_integer():
        raise ValueError(f"{name}={value!r} must be a whole number")
    return int(value)


@gpu
def _compare(image: Image.Image, prompt: str, config: hap.HAPConfig, progress: gr.Progress):
    """The GPU part: the three runs on the loaded model.

    On ZeroGPU this runs in a forked worker, so the model is loaded before (in the main process,
    where it persists between calls) and read from LOADED here, not loaded inside.
    """
    return compare(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS,
                   lambda fraction, description: progress(fraction, desc=description))


def analyze(
    image: Image.Image | None,
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
    maps, per-group maps, uniform vs PAQ, explanation, JSON summary; and the state for re-drawing.
    """
    try:
        if image is None:
            raise ValueError("no image: upload one or click an example")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("the prompt is empty: type a question about the image")
        if not model_name:  # the dropdown itself rejects names outside the allow-list
            raise ValueError("no model chosen")
        config = hap.HAPConfig(  # validates every field, naming the one that is wrong
            method=method, retain=retain, groups=_integer("groups", groups),
            first_layers=_integer("first_layers", first_layers), decay=decay,
            temperature=math.inf if temperature == 0 else temperature, tau_sink=tau_sink, tau_disp=tau_disp,
            sink_rho=sink_rho, rows=rows,
        )
        progress(0.02, desc=f"loading {model_name}")
        LOADED.get(model_name)
        comparison = _compare(image.convert("RGB"), prompt, config, progress)
    except (ValueError, OSError) as err:  # invalid input or setting, unknown or unreachable model
        raise gr.Error(str(err), print_exception=False) from err
    progress(0.85, desc="figures")
    result = comparison.pruned
    view = views.model_view(image, LOADED.center_crop())
    layer = views.default_layer(result)
    figs = views.figures(result, view, layer)
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
        explanation(comparison),
        summary(comparison, model_name),
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


def build_demo(models: list[str] | None = None) -> gr.Blocks:
    """The Blocks app; `models` overrides the allow-list (its first entry is the default)."""
    names = models or allowed_models()
    defaults = Defaults.for_model(names[0])
    with gr.Blocks(title="HAP: head-adaptive visual token pruning") as demo:
        gr.Markdown(
            "# HAP: head-adaptive visual token pruning\n"
            "Upload an image (or click an example), ask a question, choose a budget and press **Run**. "
            "HAP scores every attention head by how well it aligns the prompt with the image (PAQ), fuses "
            "heads with those weights, and keeps only the best visual tokens inside the decoder."
        )
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                image = gr.Image(type="pil", label="Image", height=280)
                prompt = gr.Textbox(label="Prompt", placeholder="what color is the triangle ?", lines=2)
                model = gr.Dropdown(names, value=names[0], label="Model (loaded on first use)")
                method = gr.Radio(list(hap.METHODS), value="hap", label="Method")
                retain = gr.Slider(0.01, 1.0, value=defaults.retain, step=0.001,
                                   label="Budget: fraction of visual tokens kept (average over all layers)")
                with gr.Accordion("Advanced settings", open=False):
                    groups = gr.Slider(1, 8, value=3, step=1, label="Groups of layers after the first ones")
                    first_layers = gr.Slider(0, 8, value=defaults.first_layers, step=1,
                                             label="First layers on all tokens (0 cuts before layer 0)")
                    decay = gr.Slider(0.05, 1.0, value=0.5, step=0.05, label="Budget decay between groups")
                    temperature = gr.Number(0.1, label="Temperature T of softmax(PAQ / T) (0 = uniform)")
                    tau_sink = gr.Slider(0.0, 1.0, value=0.5, step=0.01, label="Sink threshold on sink share")
                    tau_disp = gr.Slider(0.0, 1.0, value=0.9, step=0.01, label="Dispersed threshold on dispersion")
                    sink_rho = gr.Slider(1.0, 100.0, value=10.0, step=0.5,
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
        run.click(analyze, inputs, outputs, api_name="analyze", concurrency_limit=1, concurrency_id="model")
        prompt.submit(analyze, inputs, outputs, api_visibility="private", concurrency_limit=1, concurrency_id="model")
        layer.input(show_layer, [state, layer], head_maps, api_visibility="private", trigger_mode="always_last")
        model.change(model_defaults, model, [first_layers, retain], api_visibility="private")
    demo.queue(max_size=QUEUE_SIZE)
    return demo


demo = build_demo()


def launch_options() -> dict:
    """`demo.launch` keywords of every deployment (tests add the host and port).

    show_error passes the message of errors raised outside the handler (an upload that is not an
    image fails in gradio's own preprocessing) to the page instead of a generic one.
    """
    return dict(theme=gr.themes.Soft(), max_file_size="10mb", show_error=True)


def main() -> None:
    """Serve the demo (127.0.0.1:7860 unless GRADIO_SERVER_NAME / GRADIO_SERVER_PORT say otherwise)."""
    demo.launch(**launch_options())


if __name__ == "__main__":
    main()
