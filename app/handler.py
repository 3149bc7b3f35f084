"""The request handlers behind `/analyze`, `/sweep` and `/inspect`: every input checked, the one loaded model,
named outputs.

Every request is checked in full here (gradio's own preprocessing is off, so an API call gets the
same messages as the page): the image must be an upload or a shipped example (`app.uploads`: any other
server path refused with one message) and goes through `hap.inputs.load_image` (any PIL mode, first
frame, EXIF rotation; empty, truncated, non-image and oversized files refused), every knob through
its registry entry (`hap.knobs.Knob.check`, then `HAPConfig` for the combination), and the model
against the allow-list (`app.settings.check_model`). Bad input, a model that fails to load (the
previous one stays loaded) and running out of memory (memory is freed) come back to that user as a
`gr.Error` with the message, never a traceback; the server keeps serving. Models load with
safetensors weights only and never run remote code (`hap.load_model`). A hub id is loaded offline
(from the local cache, or a clear error within seconds) when the hub does not answer a 2-second
connection; online, its download shows on the page's progress bar (tqdm tracked).

`/analyze` times the three answers on untraced runs and draws the figures from a separate traced run
of the chosen method. On a scene that carries its ground truth (`hap.ground_truth`) for the
prompt asked, the maps outline the answering patches and the JSON gains `ground_truth`. `/sweep`
runs every pruning method over a range of budgets (`hap.sweep`), cached per input; `/inspect`
shows one head of the last `/analyze` run of the session, without running the model.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import socket
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import wraps
from pathlib import Path
from unittest import mock
from urllib.parse import urlparse

import gradio as gr
import huggingface_hub
import torch
from PIL import Image

import hap
from hap.ground_truth import file_metadata, question_for, scene_truth, truth_json
from hap.report import answer_card, explanation, head_text, summary, sweep_title, truth_text
from hap.sweep import sweep
from hap import views
from hap.causal import resolve_setting
from hap.compare import compare
from hap.features import FeatureCache, reusing_features
from hap.inputs import InputLimits, check_history, clean_conversation
from hap.keeps import Keeps, keeps_plotly, pruning
from hap.keeps import keeps as every_method
from hap.knobs import KNOBS
from hap.options import NO_OPTIONS, OPTIONS, ProcessorOptions
from hap.patch import batch
from hap.patch.processors import option_defaults, processor_options
from hap.planting import PLAN_KEYS, Plan
from hap.run import free_memory, run

from . import causal as causal_section
from . import conversation as chat
from . import keeps as keeps_section
from . import lesson
from . import zerogpu
from .edit import NO_EDIT, EditDiff, ImageInput, image_input, load
from .images import serve_figure, serve_images
from .lab import (LAB_VIEWS, NO_PLAN, half_width, lab_answers, lab_configs, lab_text, mark_planted, plan_from_share,
                  read_plan, side_by_side)
from .lab_pick import chosen_tokens, head_at, head_picker, plan_text, toggle_head, toggle_token, token_at, token_picker
from .settings import Settings, check_clip, check_model, is_local, resolve


def gpu(work: Callable[[zerogpu.Call], zerogpu.Work]) -> Callable[[Callable], Callable]:
    """`zerogpu.gpu` on the loaded model: on ZeroGPU a call asks for the seconds its `work` takes there."""
    return zerogpu.gpu(work, lambda: (LOADED.model, LOADED.processor))


LOG = logging.getLogger("hap.app")
MAX_NEW_TOKENS = 32
SEED = 0
CARDS = ("unpruned", "pruned", "uniform")  # the answer cards, in `Comparison.items()` order
INSPECTOR = ("inspector", "inspector_stats")  # the head inspector: one head's map and its numbers
EDIT = ("edit_diff", "edit_diff_plot")  # the run on the edited image against the run on the original
CONVERSATION = ("history", "conversation", "turn")  # the turns as the next history, as chat messages, the turn picker
LAB = ("lab_head_classes", "lab_uniform_vs_paq", "lab_kept_masks", "lab_answers", "lab_heads", "lab_tokens")
# the head lab's results side by side and its two pickers; the run's plan report is a state ("lab_report")
LESSON = ("lesson_text", *(f"lesson_{name}" for name in ("head_classes", "uniform_vs_paq", "kept_masks")))
OUTPUTS = (*CARDS, "layer", "head", *(v.name for v in views.VIEWS), "explanation", "lab", *LAB, "summary",
           "ground_truth",
           "keeps",  # "What each method keeps" (app.keeps; None unless the request asks)
           *causal_section.CAUSAL, *INSPECTOR, *EDIT, *CONVERSATION,
           "state", "lab_report", "turns")  # the states last: not among the API's outputs
TURN_OUTPUTS = OUTPUTS[: OUTPUTS.index("history")] + ("state", "lab_report")  # what picking a turn shows again
SWEPT = ("method", "retain", "flops_ratio")  # knobs /sweep varies itself: not among its parameters
SWEEP_OUTPUTS = ("sweep_plot", "sweep")
SWEEP_CACHE = 16  # sweeps kept (least recently used dropped)
FEATURE_CLIENTS = 16  # clients whose image features are kept (least recently served dropped), `FEATURE_IMAGES` each
FEATURE_IMAGES = 2  # the image asked about and one before it (an edit's original, a follow-up's first turn)
HUB_TIMEOUT_S = 2.0  # a hub that does not accept a connection within this is treated as offline


class LoadedModel:
    """The one model held in memory. Loading another replaces it only once the new one has loaded."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.model = None
        self.processor = None
        self.features: OrderedDict[str, FeatureCache] = OrderedDict()  # client -> its images' features
        self.options: ProcessorOptions = NO_OPTIONS  # the request's processor options (`planted`), reset after it

    def feature_cache(self, client: str) -> FeatureCache:
        """The image features kept for `client` (a session) on the loaded model; a new model starts empty."""
        cache = self.features.pop(client, None) or FeatureCache(FEATURE_IMAGES)
        self.features[client] = cache
        while len(self.features) > FEATURE_CLIENTS:
            self.features.popitem(last=False)
        return cache

    def get(self, name: str):
        """(model, processor) of `name`, loading it on first use; raises hap.ModelLoadError (the old one stays).

        A hub id loads in offline mode (the cache, else a clear error at once) when the hub is unreachable,
        instead of transformers' retries (about 25 s) before the same error."""
        if name != self.name:
            offline = not is_local(name) and not hub_reachable()
            with mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True) if offline else nullcontext():
                model, processor = hap.load_model(resolve(name))
            self.model, self.processor, self.name = model, processor, name
            self.features.clear()  # another model's features are never reused
            free_memory()  # the replaced model's weights
        return self.model, self.processor

    def reset(self) -> None:
        """Leave the loaded model stock after a request, whatever happened (no patch left behind, no processor
        options)."""
        self.options = NO_OPTIONS
        if self.model is not None:
            hap.unpatch(self.model)


LOADED = LoadedModel()


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether the hub (HF_ENDPOINT) accepts a TCP connection within `timeout` seconds; False in offline mode."""
    if huggingface_hub.constants.is_offline_mode():
        return False
    url = urlparse(huggingface_hub.constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


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


@contextmanager
def planted(plan: Plan):
    """`hap.plant` of `plan` on the loaded model, for a block (the empty plan plants nothing), with the request's
    processor options (`LOADED.options`, `hap.patch.processors.processor_options`) in effect."""
    with hap.plant(LOADED.model, plan.sink, plan.dispersed, plan.sink_tokens, plan.strength, plan.massive), \
            processor_options(LOADED.model, LOADED.processor, LOADED.options):
        yield


def split_options(settings: dict) -> tuple[dict, ProcessorOptions]:
    """(the knobs, the processor options) of a request's settings: the options of `hap.options.OPTIONS` by name,
    checked (ValueError names a bad one); the rest are the knobs, for `check_settings`."""
    names = {o.name for o in OPTIONS}
    return ({k: v for k, v in settings.items() if k not in names},
            ProcessorOptions.of({k: v for k, v in settings.items() if k in names}))


def options_line(used: dict[str, object], given: ProcessorOptions) -> str:
    """The explanation's line on the processor options the run used (`used`, by name), each marked as set by the
    request (`given`) or the checkpoint's own; "" for a family without any."""
    if not used:
        return ""
    marked = [f"`{name}` {value} ({'set' if name in given.given() else 'the checkpoint'})"
              for name, value in used.items()]
    return "\n- Processor options: " + ", ".join(marked) + "."


def compare_work(shared: bool, plan: Plan) -> zerogpu.Work:
    """What `_compare` runs: the three answers (decoded as one batch where `shared` and nothing is planted), the method
    again untraced unless `shared`, the lab's two with a plan."""
    runs = 3 + (not shared) + 2 * (not plan.empty)
    together = shared and plan.empty
    return zerogpu.answers(runs=runs, traced=1, new_tokens=MAX_NEW_TOKENS, together=together)


@gpu(lambda call: compare_work(call.arguments["cache"] is not None, call.arguments["plan"]))
def _compare(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits, progress: gr.Progress,
             history: list[tuple[str, str]], plan: Plan = Plan(), cache: FeatureCache | None = None):
    """The GPU part: the three runs on the loaded model, each with `plan` planted. Returns (comparison with the
    traced run, for the figures; the three results to report, for their latencies; with a plan, the head lab's four
    answers: unpruned, uniform, the paper's HAP and HAP+).

    With a `cache` (HAP_APP_SHARE=1) the image is encoded once for every run (`hap.features`), the three answers are
    decoded as one batch after each run's own prefill (`hap.compare`'s `together`; one by one with a plan planted)
    and the method is timed on its traced run, whose latency then includes the attention capture (the card says
    so); without one, every run encodes the image and decodes alone, and the method runs again untraced for its
    latency.

    On ZeroGPU this runs in a forked worker, so the model is loaded before (in the main process,
    where it persists between calls) and read from LOADED here, not loaded inside.
    """
    with planted(plan), reusing_features(LOADED.model, cache):
        comparison = compare(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS,
                             staged(progress, cache), limits, history, together=cache is not None)
        timed = dict(comparison.items())
        if cache is None:
            progress(0.8, desc=f"{config.method} again, untraced, for its latency")
            timed["pruned"] = run(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS, trace=False,
                                  limits=limits, history=history)
        lab = {}
        if not plan.empty:
            progress(0.85, desc="head lab: the paper's HAP and HAP+ with the plan")
            lab = {"unpruned": comparison.unpruned.answer, "uniform": comparison.uniform.answer}
            for label, cfg in lab_configs(config).items():
                lab[label] = run(LOADED.model, LOADED.processor, image, prompt, cfg, MAX_NEW_TOKENS, trace=False,
                                 limits=limits, history=history).answer
    return comparison, timed, lab


@gpu(lambda call: zerogpu.answers(runs=1, traced=1, new_tokens=MAX_NEW_TOKENS))
def _original(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits,
              history: list[tuple[str, str]], plan: Plan = Plan(), cache: FeatureCache | None = None) -> hap.Result:
    """The GPU part of an edit's comparison: the chosen method, traced, on the original image (`plan` planted)."""
    with planted(plan), reusing_features(LOADED.model, cache):
        return run(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS, trace=True, limits=limits,
                   history=history)


@gpu(lambda call: zerogpu.answers(runs=len(pruning()), traced=0, new_tokens=MAX_NEW_TOKENS, together=True))
def _keeps(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits,
           history: list[tuple[str, str]], done: dict[str, hap.Result], plan: Plan = Plan(),
           cache: FeatureCache | None = None) -> Keeps:
    """The GPU part of "What each method keeps" (`hap.keeps.keeps`; see `_compare` for ZeroGPU): every method at
    `config`'s budget but those `done`, `plan` planted, the image's features from `cache`."""
    with planted(plan), reusing_features(LOADED.model, cache):
        return every_method(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS, limits, history,
                            done)


@gpu(zerogpu.causal_work)
def _causal(image: Image.Image, prompt: str, setting: str | None, limits: InputLimits,
            history: list[tuple[str, str]], config: hap.HAPConfig, cuts: list[int], plan: Plan = Plan(),
            cache: FeatureCache | None = None):
    """The GPU part of the "Is PAQ right?" section (`app.causal.analyze`; see `_compare` for ZeroGPU), `plan`
    planted, the image's features from `cache`."""
    with planted(plan), reusing_features(LOADED.model, cache):
        return causal_section.analyze(LOADED.model, LOADED.processor, image, prompt, setting, limits, history,
                                      config, cuts)


def sweep_work(call: zerogpu.Call) -> zerogpu.Work:
    """What `_sweep` runs: shared with a feature cache, its budgets decoded together where the model allows."""
    shared = call.arguments["cache"] is not None
    return zerogpu.sweep_work(MAX_NEW_TOKENS, shared, together=shared and batch.refusal(call.model) is None)


@gpu(sweep_work)
def _sweep(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits, progress: gr.Progress,
           cache: FeatureCache | None = None):
    """The GPU part of `/sweep` (see `_compare` for ZeroGPU); with a `cache` the image is encoded once and the
    runs share what `hap.sweep` shares."""
    with processor_options(LOADED.model, LOADED.processor, LOADED.options), reusing_features(LOADED.model, cache):
        return sweep(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS, limits,
                     lambda fraction, description: progress(0.05 + 0.9 * fraction, desc=description),
                     shared=cache is not None)


def staged(progress: gr.Progress, cache: FeatureCache | None) -> Callable[[float, str], None]:
    """The progress bar's stage callback; with a feature `cache` each stage also says whether the image is being
    encoded or its features are reused (counted from this request's start)."""
    start = None if cache is None else (cache.hits, cache.misses)

    def stage(fraction: float, description: str) -> None:
        if start is not None:
            hits, misses = cache.hits - start[0], cache.misses - start[1]
            description += " · image features reused" if hits + misses else " · one vision pass for all runs"
        progress(fraction, desc=description)

    return stage


def user_errors(fn: Callable) -> Callable:
    """`fn` with every failure turned into a gr.Error with the message (no traceback) and the model left stock:
    bad input and unloadable models say what is wrong, running out of memory frees it, a bug is logged."""

    @wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
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
            LOG.exception("%s failed", fn.__name__)
            free_memory()
            raise gr.Error(f"internal error ({err.__class__.__name__}: {err}); the server is still running",
                           print_exception=False) from err
        finally:
            LOADED.reset()

    return guarded


def client(request: gr.Request | None) -> str:
    """The client a request comes from: its gradio session ("" for a call made in-process, without a request)."""
    return getattr(request, "session_hash", None) or ""


def image_key(source: str | Image.Image) -> str:
    """SHA-256 of the uploaded file's bytes; for an in-process PIL image, of its mode, size and pixels (the same
    bytes read as 20x10 or 10x20 are different images)."""
    if isinstance(source, Image.Image):
        data = f"{source.mode} {source.size[0]}x{source.size[1]}\n".encode() + source.tobytes()
    else:
        data = Path(source).read_bytes()
    return hashlib.sha256(data).hexdigest()


class Handler:
    """`/analyze` and `/sweep` of one demo: check every input against the demo's `Settings`, then run."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sweeps: OrderedDict[tuple, dict] = OrderedDict()  # LRU: (image hash, prompt, model, config) -> sweep

    @user_errors
    def analyze(self, image, prompt: str, model_name: str, progress: gr.Progress = gr.Progress(track_tqdm=True), *,
                history: list | str | None = None, turns: list[chat.Turn] | None = None, causal: str | None = None,
                plant: dict | str | None = None, keeps: bool | None = None, request: gr.Request | None = None,
                **settings) -> dict[str, object]:
        """Run the full pipeline; `settings` are the knobs of hap/knobs.py by name (`KNOBS`) and the processor options
        of hap/options.py (`OPTIONS`: None the checkpoint's own; one the model's family lacks is refused by name; the
        JSON gains "processor_options", every option of the family as it ran). `image` is an upload
        or the page's editor value (`app.edit.image_input`); `causal` the "Is PAQ right?" setting (`hap.causal.SETTINGS`,
        None: auto; the JSON gains "causal" and "head_utility" unless off); `history` the earlier `[question, answer]`
        turns about the image (None or []: a first question), `turns` the page's stored conversation
        (`app.conversation`); `plant` a head lab plan (`hap.planting.Plan.from_json`: a JSON object or its text,
        empty = none), planted for every run of the request, whose views are then all marked PLANTED and whose
        JSON gains "plant" (the plan, the sink tokens used, the classifier's precision / recall on it, the lab's
        answers); `keeps` (true: opt-in) also runs every pruning method at the budget ("What each method keeps",
        `hap.keeps`; the JSON gains "keeps"); `request` (gradio's) names the client whose image features are kept
        (`LoadedModel.feature_cache`).

        Returns the outputs by name (`OUTPUTS`): the three answer cards, the layer and head sliders, every view
        of `hap.views.VIEWS`, the explanation, the JSON summary (with "input": the upload and its conversion,
        "ground_truth" on a scene asked its own question and "edit" on an edited image), the ground-truth note,
        the head inspector, the edit's comparison, the conversation (its history, messages and turn picker), the
        state for re-drawing and the turns. Any failure is a gr.Error with the message.
        """
        return self._analyze(image, prompt, model_name, settings, progress, history, turns, causal, plant,
                             client(request), keeps_section.check(keeps))

    @user_errors
    def sweep(self, image, prompt: str, model_name: str, progress: gr.Progress = gr.Progress(track_tqdm=True),
              request: gr.Request | None = None, **settings) -> dict[str, object]:
        """Every pruning method at budgets from 1.0 down to the model's smallest (`hap.sweep`); `settings`
        are the knobs but the swept ones (SWEPT) and the processor options, checked as `/analyze` checks them.
        Outputs by name (`SWEEP_OUTPUTS`): the plot and the JSON. Cached per input (image bytes, prompt, model, knobs,
        processor options)."""
        settings, options = split_options(settings)
        picture, model_name, config, _ = self.check(image, prompt, model_name, {**settings, "method": "hap"})
        img = load(picture.source, picture.name, self.settings.limits)
        key = (image_key(picture.source), prompt, model_name, tuple(config.to_dict().items()), options)
        if key not in self.sweeps:
            progress(0.02, desc=f"loading {model_name}")
            LOADED.get(model_name)
            LOADED.options = options
            self.sweeps[key] = _sweep(img, prompt, config, self.settings.limits, progress,
                                      self.features(client(request)))
            while len(self.sweeps) > SWEEP_CACHE:
                self.sweeps.popitem(last=False)
        self.sweeps.move_to_end(key)
        result = self.sweeps[key]
        return {"sweep_plot": views.sweep_plotly(result, sweep_title(result, model_name)), "sweep": result}

    def check(self, image, prompt, model_name, settings: dict, history=None
              ) -> tuple[ImageInput, str, hap.HAPConfig, list[tuple[str, str]]]:
        """Every input checked, cheapest first: (the image, model, config, history's turns)."""
        limits = self.settings.limits
        turns = check_history(history, limits)
        clean_conversation(prompt, turns, set(), limits)  # types, lengths, empty; hap.run cleans them (and says what)
        model_name, config = check_model(model_name, self.settings), check_settings(settings)
        check_clip(config.clip_model, self.settings)
        return image_input(image, limits), model_name, config, turns

    def features(self, client: str) -> FeatureCache | None:
        """The image features kept for `client` on the loaded model, or None where the sharing is off."""
        return LOADED.feature_cache(client) if self.settings.share else None

    def _analyze(self, image, prompt, model_name, settings: dict, progress, history, turns,
                 causal: str | None, plant, session: str, keeps: bool = False) -> dict[str, object]:
        settings, options = split_options(settings)
        picture, model_name, config, history = self.check(image, prompt, model_name, settings, history)
        plan = read_plan(plant)
        limits = self.settings.limits
        img = load(picture.source, picture.name, limits)
        pixels = image_key(img)
        earlier = chat.continued(turns, history, pixels, model_name)  # a follow-up: the same image and model
        info, conversion = describe_input(picture.source, picture.name, img)
        meta = file_metadata(picture.source)  # the upload's own text chunks, before any conversion
        progress(0.02, desc=f"loading {model_name}")
        LOADED.get(model_name)
        LOADED.options = options
        resolve_setting(LOADED.model, causal or "auto")  # a bad or too costly causal setting, refused before any run
        with planted(plan):  # a plan out of the model's range, or options its processor lacks, refused before any run
            pass
        torch.manual_seed(SEED)
        cache = self.features(session)
        comparison, timed, lab = _compare(img, prompt, config, limits, progress, history, plan, cache)
        progress(0.9, desc="figures")
        data = views.ViewData.from_result(comparison.pruned, img)
        question, why_not = question_for(meta, prompt, data.shape[2])
        if picture.edited:
            question, why_not = None, "the image was edited in the editor, and an edited scene has no saved ground truth"
        report = summary(comparison, timed, model_name)
        report["shared"] = self.settings.share
        report["input"] = {**info, "edited": picture.edited}
        report["processor_options"] = {**option_defaults(LOADED.model, LOADED.processor), **options.given()}
        if question is not None:
            data = replace(data, truth=scene_truth(question, data))
            report["ground_truth"] = truth_json(data.truth)
        progress(0.91, desc="causal head and token importance, head utility")
        cuts = [g.layers[0] for g in data.groups]
        shown, entries = causal_section.outputs(
            _causal(img, prompt, causal, limits, history, config, cuts, plan, cache), data)
        report.update(entries)  # "causal" and "head_utility", unless off
        edit = self.edit_diff(picture, prompt, config, history, data, comparison.pruned.answer, progress, plan, cache)
        if edit is not None:
            report["edit"] = edit.to_json()
        figures = {**views.figures(data), "keeps": None}  # "keeps": marked PLANTED with the views, as one of them
        if keeps:
            progress(0.93, desc="every method at this budget: one prefill each, the answers as one batch")
            done = {r.method: r for r in (comparison.pruned, comparison.uniform)}
            found = _keeps(img, prompt, config, limits, history, done, plan, cache)
            report["keeps"] = found.to_json()
            figures["keeps"] = keeps_plotly(data, found)
        cards = {label: answer_card(label, r, traced=r is comparison.pruned) for label, r in timed.items()}
        lab_note, planted_report = NO_PLAN, None
        if not plan.empty:
            planted_report = comparison.pruned.plant
            report["plant"] = {**planted_report, "answers": lab}
            lab_note = lab_text(planted_report, data, lab, config)
            figures = mark_planted(figures, plan, planted_report["classifier"])
            shown = mark_planted(shown, plan, planted_report["classifier"])
            cards = {label: card.replace("####", "#### PLANTED heads ·", 1) for label, card in cards.items()}
        lab_drawn = side_by_side(data, plan, planted_report["classifier"]) if planted_report else {}
        lab_views = {f"lab_{name}": shown_if(lab_drawn.get(name)) for name in LAB_VIEWS}
        outputs = serve_images({
            **cards,
            "layer": gr.Slider(value=data.layer, maximum=data.shape[0] - 1, interactive=True),
            "head": gr.Slider(value=0, maximum=data.shape[1] - 1, interactive=True),
            **figures,
            "explanation": explanation(comparison) + f"\n- Input: {conversion}." + chat.rows_note(len(history), config.rows),
            "lab": lab_note,
            **lab_views,
            "lab_answers": lab_answers(lab),
            **lab_pictures(data, plan, planted_report),
            "lab_report": planted_report,
            "summary": report,
            "ground_truth": truth_text(data.truth, why_not),
            **shown,
            **dict(zip(INSPECTOR, inspect_head(data, data.layer, 0))),
            "edit_diff": NO_EDIT if edit is None else edit.text(),
            "edit_diff_plot": shown_if(None if edit is None else edit.figure()),
            "state": data,
        })
        outputs["explanation"] += options_line(report["processor_options"], options)
        turn = chat.Turn(prompt, comparison.pruned.answer, [list(g.kept) for g in data.groups], data.shape[2], outputs,
                         pixels, model_name)
        conversation = [*earlier, turn]
        return {**outputs, **conversation_outputs(conversation, len(conversation) - 1)}

    def edit_diff(self, picture: ImageInput, prompt: str, config: hap.HAPConfig, history: list[tuple[str, str]],
                  after: views.ViewData, answer: str, progress, plan: Plan = Plan(),
                  cache: FeatureCache | None = None) -> EditDiff | None:
        """For an edited image, the chosen method's traced run on the original and how the edit changed it."""
        if not picture.edited:
            return None
        progress(0.92, desc=f"{config.method} on the original image, to compare with the edit")
        original = load(picture.original, picture.name, self.settings.limits)
        before = _original(original, prompt, config, self.settings.limits, history, plan, cache)
        return EditDiff.of(views.ViewData.from_result(before, original), after,
                           (before.answer, answer))

    @user_errors
    def fill_plan(self, model_name: str, kind: str, share: float, layers: str, seed: float, strength: float,
                  sink_tokens: str) -> str:
        """The head lab's share helper: the plan JSON of "plant `kind` heads in `share`% of the heads of layers
        `layers`" (`app.lab.plan_from_share`) for the model `model_name`, loaded if needed."""
        return json.dumps(plan_from_share(kind, share, layers, seed, strength, sink_tokens,
                                          self.lab_shape(model_name)))

    @user_errors
    def lab_pickers(self, model_name: str, plant: str, state: views.ViewData | None, run: dict | None) -> tuple:
        """The head lab's (head picker, sink-token picker, sink tokens as text) for the plan JSON `plant`: on the last
        run's classes and image (`state`; its plan report `run` marks found / missed heads when the plan is the one
        it ran), else on the model's shape and no image. An unfinished plan (typing) leaves them as they are."""
        try:
            plan = read_plan(plant)
        except ValueError:
            return gr.skip(), gr.skip(), gr.skip()
        tokens = " ".join(map(str, chosen_tokens(plan) or ())) or str(plan.sink_tokens or "")  # indices, or a count
        if state is None:
            return head_picker(self.lab_shape(model_name), plan), None, tokens
        same = run is not None and Plan.from_json({k: run[k] for k in PLAN_KEYS}) == plan
        pictures = lab_pictures(state, plan, run if same else None)
        return pictures["lab_heads"], pictures["lab_tokens"], tokens

    @user_errors
    def click_head(self, plant: str, kind: str, model_name: str, state: views.ViewData | None,
                   evt: gr.SelectData) -> str:
        """The plan JSON with the head under the click on the head picker toggled as `kind`."""
        shape = state.shape[:2] if state is not None else self.lab_shape(model_name)
        head = head_at(*evt.index, shape)
        return gr.skip() if head is None else plan_text(toggle_head(read_plan(plant), head, kind))

    @user_errors
    def click_token(self, plant: str, state: views.ViewData | None, evt: gr.SelectData) -> str:
        """The plan JSON with the visual token under the click on the sink-token picker toggled."""
        if state is None:
            raise gr.Error("press Run first: the sink-token picker shows the last run's image on its token grid")
        height, width = state.image.shape[:2]
        token = token_at(*evt.index, (width, height), state.grid, state.shape[2])
        return plan_text(toggle_token(read_plan(plant), token))

    def lesson_outputs(self, index: int, model_name: str) -> tuple:
        """`lesson_step` as the page's event returns it: the outputs in `LESSON` order."""
        step = self.lesson_step(index, model_name)
        return tuple(step[name] for name in LESSON)

    @user_errors
    def lesson_step(self, index: int, model_name: str) -> dict[str, object]:
        """Step `index` of the guided lesson (`app.lesson.STEPS`) on `model_name`: its text from the run's own numbers
        and its views (half the page wide, marked PLANTED with a plan; the views it does not use hidden), by name
        (`LESSON`)."""
        step = lesson.STEPS[index]
        out = self.analyze(**lesson.request(model_name, step))
        drawn = half_width(out["state"])
        if not step.plan.empty:
            drawn = mark_planted(drawn, step.plan, out["summary"]["plant"]["classifier"])
        return {"lesson_text": step.say(lesson.Numbers.of(out)),
                **{f"lesson_{name}": shown_if(drawn[name] if name in step.views else None) for name in LAB_VIEWS}}

    def lab_shape(self, model_name: str) -> tuple[int, int]:
        """(layers, query heads) of `model_name`'s decoder, from its config (the weights are not loaded; a hub id
        offline when the hub does not answer, as `LoadedModel.get`)."""
        from transformers import AutoConfig

        name = check_model(model_name, self.settings)
        if LOADED.name == name:
            config = LOADED.model.config
        else:
            offline = not is_local(name) and not hub_reachable()
            with mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True) if offline else nullcontext():
                config = AutoConfig.from_pretrained(resolve(name), trust_remote_code=False)
        text = config.text_config
        return text.num_hidden_layers, text.num_attention_heads

    def endpoint(self, method: Callable, components: dict[str, gr.components.Component],
                 knobs: tuple[str, ...]) -> Callable:
        """`method` (`analyze` or `sweep`) as gradio calls it: outputs given to `components` by name, and a
        signature naming the `knobs` (keyword-only, default None), which gradio reads for the API parameter
        names and defaults."""

        def call(*args, **kwargs):
            return {components[name]: value for name, value in method(*args, **kwargs).items()}

        signature = inspect.signature(method)
        fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        named = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in knobs]
        call.__signature__ = signature.replace(parameters=fixed + named)
        call.__annotations__ = {"request": gr.Request}  # gradio hands the request to a parameter typed so
        call.__name__ = method.__name__
        return call


def lab_pictures(data: views.ViewData, plan: Plan, run: dict | None) -> dict[str, object]:
    """The head lab's two pickers on a run's `data`: the head picker with its classes (found / missed marked from
    the planted run's report `run`), the sink-token picker with the plan's sink tokens (those the run used, where
    the plan left them to the default); no token picker where the visual tokens do not form the grid."""
    tokens = chosen_tokens(plan) if run is None or chosen_tokens(plan) is not None else run["sink_tokens_used"]
    rows, cols = data.grid
    return {"lab_heads": head_picker(data.shape[:2], plan, data.head_class, run and run["classifier"]),
            "lab_tokens": token_picker(data.image, data.grid, tokens) if rows * cols == data.shape[2] else None}


def shown_if(figure) -> gr.Plot:
    """A plot that is shown only when it has a figure: nothing drawn where there is nothing to show (the API gets
    gradio's update, `{"value": ..., "visible": ...}`)."""
    return gr.Plot(value=serve_figure(figure), visible=figure is not None)


def conversation_outputs(turns: list[chat.Turn], shown: int) -> dict[str, object]:
    """The conversation's outputs (CONVERSATION and the turns) with turn `shown` picked."""
    return {"history": chat.history(turns), "conversation": chat.messages(turns),
            "turn": gr.Radio(choices=[chat.label(i) for i in range(len(turns))], value=chat.label(shown),
                             interactive=True),
            "turns": turns}


def show_turn(turns: list[chat.Turn] | None, choice: str) -> tuple:
    """Every view of the picked turn's run, from the stored conversation (no model call); TURN_OUTPUTS order."""
    try:
        outputs = chat.pick(turns or [], choice).outputs
    except ValueError as err:
        raise gr.Error(str(err), print_exception=False) from err
    return tuple(outputs[name] for name in TURN_OUTPUTS)


def inspect_head(data: views.ViewData, layer: int, head: int) -> tuple:
    """(the map of head `head` of layer `layer` over the image, its numbers as Markdown); ValueError outside."""
    data = data.at_layer(layer)
    figure = views.panels_plotly(views.head_panel(data, head), f"Head inspector: layer {layer}, head {head}")
    return serve_figure(figure), head_text(data, head)


def _stored(state: views.ViewData | None) -> views.ViewData:
    if state is None:
        raise gr.Error("press Run first: the head inspector and the layer slider show the last run")
    return state


def show_head(state: views.ViewData | None, layer: float, head: float) -> tuple:
    """The head inspector for (layer, head) from the stored run (no model call)."""
    try:
        return inspect_head(_stored(state), int(layer), int(head))
    except (ValueError, TypeError) as err:
        raise gr.Error(str(err), print_exception=False) from err


def show_layer(state: views.ViewData | None, layer: float, head: float) -> tuple:
    """Re-draw the per-head maps for another layer, and the head inspector, from the stored run (no model call)."""
    try:
        maps = views.VIEW["head_maps"].figure(_stored(state).at_layer(int(layer)))
        return serve_figure(maps), *show_head(state, layer, head)
    except ValueError as err:
        raise gr.Error(str(err), print_exception=False) from err
