"""The Gradio event handlers of the page and its API: `/analyze`, `/sweep`, the head lab's helpers and pickers, the
guided lesson's steps, and the views re-drawn from the stored run (turn, layer, head) without running the model.

Each handler checks its inputs and runs the model through `app.pipeline` (every failure a `gr.Error` with the message,
the model left stock), then builds the page's outputs by name through `app.present`. `/sweep` results are cached per
input; `/inspect` shows one head of the last `/analyze` run of the session.
"""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from collections.abc import Callable

import gradio as gr

from hap import views
from hap.runs.features import FeatureCache
from hap.lab.plan import PLAN_KEYS, Plan

from . import conversation as chat
from . import keeps as keeps_section
from . import lesson
from .images import serve_figure
from .lab import LAB_VIEWS, half_width, mark_planted, plan_from_share, read_plan
from .lab_pick import chosen_tokens, head_at, head_picker, plan_text, toggle_head, toggle_token, token_at
from .models import LOADED
from .pipeline import check_request, image_key, run_analysis, run_sweep, user_errors
from .present import (LESSON, TURN_OUTPUTS, analysis_outputs, conversation_outputs, inspect_head, lab_pictures,
                      shown_if, sweep_outputs)
from .settings import Settings, check_model

SWEPT = ("method", "retain", "flops_ratio")  # knobs /sweep varies itself: not among its parameters
SWEEP_CACHE = 16  # sweeps kept (least recently used dropped)


def client(request: gr.Request | None) -> str:
    """The client a request comes from: its gradio session ("" for a call made in-process, without a request)."""
    return getattr(request, "session_hash", None) or ""


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
        (`app.conversation`); `plant` a head lab plan (`hap.lab.plan.Plan.from_json`: a JSON object or its text,
        empty = none), planted for every run of the request, whose views are then all marked PLANTED and whose
        JSON gains "plant" (the plan, the sink tokens used, the classifier's precision / recall on it, the lab's
        answers); `keeps` (true: opt-in) also runs every pruning method at the budget ("What each method keeps",
        `hap.runs.keeps`; the JSON gains "keeps"); `request` (gradio's) names the client whose image features are kept
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
        """Every pruning method at budgets from 1.0 down to the model's smallest (`hap.runs.sweep`); `settings`
        are the knobs but the swept ones (SWEPT) and the processor options, checked as `/analyze` checks them.
        Outputs by name (`SWEEP_OUTPUTS`): the plot and the JSON. Cached per input (image bytes, prompt, model, knobs,
        processor options)."""
        checked = check_request(self.settings, image, prompt, model_name, {**settings, "method": "hap"})
        key = (image_key(checked.picture.source), prompt, checked.model_name,
               tuple(checked.config.to_dict().items()), checked.options)
        if key not in self.sweeps:
            self.sweeps[key] = run_sweep(checked, progress, self.features(client(request)))
            while len(self.sweeps) > SWEEP_CACHE:
                self.sweeps.popitem(last=False)
        self.sweeps.move_to_end(key)
        return sweep_outputs(self.sweeps[key], checked.model_name)

    def features(self, client: str) -> FeatureCache | None:
        """The image features kept for `client` on the loaded model, or None where the sharing is off."""
        return LOADED.feature_cache(client) if self.settings.share else None

    def _analyze(self, image, prompt, model_name, settings: dict, progress, history, turns,
                 causal: str | None, plant, session: str, keeps: bool = False) -> dict[str, object]:
        """`analyze` on its checked arguments: the runs (`app.pipeline.run_analysis`), their outputs (`app.present`), and
        the conversation continued with this turn."""
        request = check_request(self.settings, image, prompt, model_name, settings, history, plant)
        pixels = image_key(request.image)
        earlier = chat.continued(turns, request.history, pixels, request.model_name)  # the same image and model
        found = run_analysis(request, causal, progress, self.features(session), keeps)
        outputs = analysis_outputs(found, self.settings.share)
        data = found.data
        turn = chat.Turn(prompt, found.comparison.pruned.answer, [list(g.kept) for g in data.groups], data.shape[2],
                         outputs, pixels, request.model_name)
        conversation = [*earlier, turn]
        return {**outputs, **conversation_outputs(conversation, len(conversation) - 1)}

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
        """(layers, query heads) of `model_name`'s decoder, from its config (`app.models.LoadedModel.shape`: the
        weights are not loaded)."""
        return LOADED.shape(check_model(model_name, self.settings))

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


def show_turn(turns: list[chat.Turn] | None, choice: str) -> tuple:
    """Every view of the picked turn's run, from the stored conversation (no model call); TURN_OUTPUTS order."""
    try:
        outputs = chat.pick(turns or [], choice).outputs
    except ValueError as err:
        raise gr.Error(str(err), print_exception=False) from err
    return tuple(outputs[name] for name in TURN_OUTPUTS)


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
