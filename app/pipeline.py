"""The computing steps of the app's requests: every input checked, then the runs on the loaded model
(`app.models.LOADED`), each GPU part with its ZeroGPU work estimate; failures turned into messages for the user.

Every request is checked in full here (gradio's own preprocessing is off, so an API call gets the same messages as
the page): the image must be an upload or a shipped example (`app.uploads`: any other server path refused with one
message) and goes through `hap.runs.inputs.load_image` (any PIL mode, first frame, EXIF rotation; empty, truncated,
non-image and oversized files refused), every knob through its registry entry (`hap.knobs.Knob.check`, then
`HAPConfig` for the combination), and the model against the allow-list (`app.settings.check_model`). Bad input, a
model that fails to load (the previous one stays loaded) and running out of memory (memory is freed) come back to
that user as a `gr.Error` with the message, never a traceback (`user_errors`); the server keeps serving.

`run_analysis` times the three answers on untraced runs and keeps a separate traced run of the chosen method for the
figures. On a scene that carries its ground truth (`hap.views.ground_truth`) for the prompt asked, the run's view data
gains it. `run_sweep` runs every pruning method over a range of budgets (`hap.runs.sweep`). What they return is drawn by
`app.present`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import wraps
from pathlib import Path

import gradio as gr
import torch
from PIL import Image

import hap
from hap import views
from hap.causal import resolve_setting
from hap.runs.compare import Comparison, compare
from hap.runs.features import FeatureCache, reusing_features
from hap.views.ground_truth import file_metadata, question_for, scene_truth
from hap.runs.inputs import InputLimits, check_history, clean_conversation
from hap.runs.keeps import Keeps, pruning
from hap.runs.keeps import keeps as every_method
from hap.knobs import KNOBS
from hap.lab.plan import Plan
from hap.options import OPTIONS, ProcessorOptions
from hap.patch import batch
from hap.patch.processors import option_defaults, processor_options
from hap.pruners import pruner_for
from hap.runs.run import free_memory, run
from hap.runs.sweep import sweep as every_budget

from . import causal as causal_section
from . import zerogpu
from .edit import EditDiff, ImageInput, image_input, load
from .lab import lab_configs, read_plan
from .models import LOADED
from .settings import Settings, check_clip, check_importance, check_model

LOG = logging.getLogger("hap.app")
MAX_NEW_TOKENS = 32
SEED = 0


def gpu(work: Callable[[zerogpu.Call], zerogpu.Work]) -> Callable[[Callable], Callable]:
    """`zerogpu.gpu` on the loaded model: on ZeroGPU a call asks for the seconds its `work` takes there."""
    return zerogpu.gpu(work, lambda: (LOADED.model, LOADED.processor))


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


def split_options(settings: dict) -> tuple[dict, ProcessorOptions]:
    """(the knobs, the processor options) of a request's settings: the options of `hap.options.OPTIONS` by name,
    checked (ValueError names a bad one); the rest are the knobs, for `check_settings`."""
    names = {o.name for o in OPTIONS}
    return ({k: v for k, v in settings.items() if k not in names},
            ProcessorOptions.of({k: v for k, v in settings.items() if k in names}))


@dataclass(frozen=True)
class Request:
    """One request's checked inputs: the image as given and as loaded, the prompt, the model (its allow-listed
    name), the knobs as a config, the processor options, the earlier turns, the head lab's plan and the limits."""

    picture: ImageInput
    image: Image.Image
    prompt: str
    model_name: str
    config: hap.HAPConfig
    options: ProcessorOptions
    history: list[tuple[str, str]]
    plan: Plan
    limits: InputLimits


def check_request(settings: Settings, image, prompt: str, model_name: str, knobs: dict, history=None,
                  plant: dict | str | None = None) -> Request:
    """Every input of a request checked against the demo's `settings`, cheapest first (the history and prompt, the
    model, the knobs and options, the CLIP model, the image, the plan), then the image loaded."""
    knobs, options = split_options(knobs)
    limits = settings.limits
    turns = check_history(history, limits)
    clean_conversation(prompt, turns, set(), limits)  # types, lengths, empty; hap.run cleans them (and says what)
    model_name, config = check_model(model_name, settings), check_settings(knobs)
    check_clip(config.clip_model, settings)
    check_importance(config.head_importance, settings)
    picture = image_input(image, limits)
    plan = read_plan(plant)
    return Request(picture, load(picture.source, picture.name, limits), prompt, model_name, config, options, turns,
                   plan, limits)


def image_key(source: str | Image.Image) -> str:
    """SHA-256 of the uploaded file's bytes; for an in-process PIL image, of its mode, size and pixels (the same
    bytes read as 20x10 or 10x20 are different images)."""
    if isinstance(source, Image.Image):
        data = f"{source.mode} {source.size[0]}x{source.size[1]}\n".encode() + source.tobytes()
    else:
        data = Path(source).read_bytes()
    return hashlib.sha256(data).hexdigest()


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


@contextmanager
def planted(plan: Plan):
    """`hap.plant` of `plan` on the loaded model, for a block (the empty plan plants nothing), with the request's
    processor options (`LOADED.options`, `hap.patch.processors.processor_options`) in effect."""
    with hap.plant(LOADED.model, plan.sink, plan.dispersed, plan.sink_tokens, plan.strength, plan.massive), \
            processor_options(LOADED.model, LOADED.processor, LOADED.options):
        yield


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


def compare_work(shared: bool, plan: Plan) -> zerogpu.Work:
    """What `gpu_compare` runs: the three answers (decoded as one batch where `shared` and nothing is planted), the
    method again untraced unless `shared`, the lab's two with a plan."""
    runs = 3 + (not shared) + 2 * (not plan.empty)
    together = shared and plan.empty
    return zerogpu.answers(runs=runs, traced=1, new_tokens=MAX_NEW_TOKENS, together=together)


@gpu(lambda call: compare_work(call.arguments["cache"] is not None, call.arguments["plan"]))
def gpu_compare(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits, progress: gr.Progress,
                history: list[tuple[str, str]], plan: Plan = Plan(), cache: FeatureCache | None = None):
    """The GPU part: the three runs on the loaded model, each with `plan` planted. Returns (comparison with the
    traced run, for the figures; the three results to report, for their latencies; with a plan, the head lab's four
    answers: unpruned, uniform, the paper's HAP and HAP+).

    With a `cache` (HAP_APP_SHARE=1) the image is encoded once for every run (`hap.runs.features`), the three answers are
    decoded as one batch after each run's own prefill (`hap.runs.compare`'s `together`; one by one with a plan planted)
    and the method is timed untraced, as it runs without the app's figures, then replayed traced for them
    (`hap.runs.run.traced_replay`); each of the three results carries the image's encoding as `vision_s`
    (`shared_vision`: counted once in each latency); without one, every run encodes the image and decodes alone, and
    the method runs again untraced for its latency.

    On ZeroGPU this runs in a forked worker, so the model is loaded before (in the main process,
    where it persists between calls) and read from LOADED here, not loaded inside.
    """
    with planted(plan), reusing_features(LOADED.model, cache):
        spent = None if cache is None else cache.seconds
        comparison = compare(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS,
                             staged(progress, cache), limits, history, together=cache is not None)
        timed = {**dict(comparison.items()), "pruned": comparison.timed}
        if cache is not None:
            shared_vision(timed, cache, cache.seconds - spent)
        else:
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


def shared_vision(timed: dict[str, hap.Result], cache: FeatureCache, spent: float) -> None:
    """Give each result of `timed` (by card) the image's encoding, `vision_s`, which `hap.views.report.latency` counts
    once in each: the features' seconds when they were computed (`cache.last_seconds`; this request's `spent` seconds,
    or an earlier request's), taken out of the run that computed them, if any: the first prefilled (`compare`: the
    chosen method, then unpruned, then uniform) that reads them from the cache (a method that runs the tower itself,
    `needs_cls`, does not)."""
    prefilled = (timed["pruned"], timed["unpruned"], timed["uniform"])
    computer = next((r for r in prefilled if not pruner_for(hap.HAPConfig(**r.config)).needs_cls), None) \
        if spent else None
    for result in timed.values():
        result.timings["vision_s"] = cache.last_seconds
        if result is computer:
            result.timings["generate_s"] -= spent
            result.timings["decode_s"] -= spent  # generate's seconds after the prefill held the encoding


@gpu(lambda call: zerogpu.answers(runs=1, traced=1, new_tokens=MAX_NEW_TOKENS))
def gpu_original(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits,
                 history: list[tuple[str, str]], plan: Plan = Plan(), cache: FeatureCache | None = None) -> hap.Result:
    """The GPU part of an edit's comparison: the chosen method, traced, on the original image (`plan` planted)."""
    with planted(plan), reusing_features(LOADED.model, cache):
        return run(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS, trace=True, limits=limits,
                   history=history)


@gpu(lambda call: zerogpu.answers(runs=len(pruning()), traced=0, new_tokens=MAX_NEW_TOKENS, together=True))
def gpu_keeps(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits,
              history: list[tuple[str, str]], done: dict[str, hap.Result], plan: Plan = Plan(),
              cache: FeatureCache | None = None) -> Keeps:
    """The GPU part of "What each method keeps" (`hap.runs.keeps.keeps`; see `gpu_compare` for ZeroGPU): every method at
    `config`'s budget but those `done`, `plan` planted, the image's features from `cache`."""
    with planted(plan), reusing_features(LOADED.model, cache):
        return every_method(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS, limits, history,
                            done)


@gpu(zerogpu.causal_work)
def gpu_causal(image: Image.Image, prompt: str, setting: str | None, limits: InputLimits,
               history: list[tuple[str, str]], config: hap.HAPConfig, cuts: list[int], plan: Plan = Plan(),
               cache: FeatureCache | None = None):
    """The GPU part of the "Is PAQ right?" section (`app.causal.analyze`; see `gpu_compare` for ZeroGPU), `plan`
    planted, the image's features from `cache`."""
    with planted(plan), reusing_features(LOADED.model, cache):
        return causal_section.analyze(LOADED.model, LOADED.processor, image, prompt, setting, limits, history,
                                      config, cuts)


def sweep_work(call: zerogpu.Call) -> zerogpu.Work:
    """What `gpu_sweep` runs: shared with a feature cache, its budgets decoded together where the model allows."""
    shared = call.arguments["cache"] is not None
    return zerogpu.sweep_work(MAX_NEW_TOKENS, shared, together=shared and batch.refusal(call.model) is None)


@gpu(sweep_work)
def gpu_sweep(image: Image.Image, prompt: str, config: hap.HAPConfig, limits: InputLimits, progress: gr.Progress,
              cache: FeatureCache | None = None):
    """The GPU part of `/sweep` (see `gpu_compare` for ZeroGPU); with a `cache` the image is encoded once and the
    runs share what `hap.runs.sweep` shares."""
    with processor_options(LOADED.model, LOADED.processor, LOADED.options), reusing_features(LOADED.model, cache):
        return every_budget(LOADED.model, LOADED.processor, image, prompt, config, MAX_NEW_TOKENS, limits,
                            lambda fraction, description: progress(0.05 + 0.9 * fraction, desc=description),
                            shared=cache is not None)


def load_model(request: Request, progress: gr.Progress) -> None:
    """The request's model loaded (`LOADED`), with the request's processor options for its runs."""
    progress(0.02, desc=f"loading {request.model_name}")
    LOADED.get(request.model_name)
    LOADED.options = request.options


@dataclass(frozen=True)
class Analysis:
    """What one `/analyze` request computed, before anything is drawn (`app.present.analysis_outputs`): the input's
    description and conversion, the comparison (its traced method run), the three results to report, the head lab's
    answers, the traced run's view data (with its ground truth, if any, else `why_not`), the processor options the
    runs used, the causal section's findings, the edit's comparison and every method's keeps (None unless run)."""

    request: Request
    info: dict
    conversion: str
    comparison: Comparison
    timed: dict[str, hap.Result]
    lab: dict[str, str]
    data: views.ViewData
    why_not: str | None
    processor_options: dict[str, object]
    causal: causal_section.Found | None
    edit: EditDiff | None
    keeps: Keeps | None


def run_analysis(request: Request, causal: str | None, progress: gr.Progress, cache: FeatureCache | None,
            keeps: bool = False) -> Analysis:
    """The runs of `/analyze` (see `app.handler.Handler.analyze`): the comparison, the causal section's, the
    original's for an edited image and, with `keeps`, every method at the budget; the image's features from
    `cache`."""
    picture, img, prompt, config = request.picture, request.image, request.prompt, request.config
    limits, history, plan = request.limits, request.history, request.plan
    info, conversion = describe_input(picture.source, picture.name, img)
    meta = file_metadata(picture.source)  # the upload's own text chunks, before any conversion
    load_model(request, progress)
    resolve_setting(LOADED.model, causal or "auto")  # a bad or too costly causal setting, refused before any run
    with planted(plan):  # a plan out of the model's range, or options its processor lacks, refused before any run
        pass
    torch.manual_seed(SEED)
    comparison, timed, lab = gpu_compare(img, prompt, config, limits, progress, history, plan, cache)
    progress(0.9, desc="figures")
    data = views.ViewData.from_result(comparison.pruned, img)
    question, why_not = question_for(meta, prompt, data.shape[2])
    if picture.edited:
        question, why_not = None, "the image was edited in the editor, and an edited scene has no saved ground truth"
    used = {**option_defaults(LOADED.model, LOADED.processor), **request.options.given()}
    if question is not None:
        data = replace(data, truth=scene_truth(question, data))
    progress(0.91, desc="causal head and token importance, head utility")
    cuts = [g.layers[0] for g in data.groups]
    found = gpu_causal(img, prompt, causal, limits, history, config, cuts, plan, cache)
    edit = edit_diff(request, data, comparison.pruned.answer, progress, cache)
    kept = None
    if keeps:
        progress(0.93, desc="every method at this budget: one prefill each, the answers as one batch")
        done = {r.method: r for r in (comparison.pruned, comparison.uniform)}
        kept = gpu_keeps(img, prompt, config, limits, history, done, plan, cache)
    return Analysis(request, info, conversion, comparison, timed, lab, data, why_not, used, found, edit, kept)


def edit_diff(request: Request, after: views.ViewData, answer: str, progress: gr.Progress,
              cache: FeatureCache | None = None) -> EditDiff | None:
    """For an edited image, the chosen method's traced run on the original and how the edit changed it."""
    picture, config = request.picture, request.config
    if not picture.edited:
        return None
    progress(0.92, desc=f"{config.method} on the original image, to compare with the edit")
    original = load(picture.original, picture.name, request.limits)
    before = gpu_original(original, request.prompt, config, request.limits, request.history, request.plan, cache)
    return EditDiff.of(views.ViewData.from_result(before, original), after, (before.answer, answer))


def run_sweep(request: Request, progress: gr.Progress, cache: FeatureCache | None) -> dict:
    """`/sweep`'s result on the request's model (loaded if needed); the image's features from `cache`."""
    load_model(request, progress)
    return gpu_sweep(request.image, request.prompt, request.config, request.limits, progress, cache)


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
