"""The page: gr.Blocks only. Controls come from the knob registry, plots from `hap.views.VIEWS`, both by name.

Each knob of hap/knobs.py is a control named after it (label = the knob's name, info = its meaning):
a slider where the knob has both bounds, a number box otherwise, a radio for choices; the values are
the registry's defaults, per-model ones resolved for the chosen model (`app.settings.knob_defaults`).
Each is an `/analyze` parameter of the same name (`Handler.endpoint`), and a `/sweep` one unless the sweep
varies it (`SWEPT`). The page: the request (image, the examples' gallery under it, prompt, model, settings, Run) in a
column on the left, and beside it one tab per task (`TABS`), each opening on its main figure: what the method does on
this image (answers, conversation, kept tokens, head classes, PAQ, the maps before and after fusion), comparing
methods (what each method keeps, the budget sweep), checking PAQ (ground truth, causal truth, head utility, the per-head
maps and the inspector) and the head lab (the guided lesson, then the free lab). One Run feeds every tab; a tab's
costly work (keeps, sweep, causal) stays opt-in or its own setting. The page opens on an example already analysed
(`app.arrival`): the editor and the prompt hold it as built, the page's load fills every output.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

import gradio as gr

from hap.runs.inputs import FORMATS, InputLimits
from hap.knobs import KNOBS, SINK_DETECTORS, Knob
from hap.options import OPTIONS
from hap.views.report import LABELS, TEACHING
from hap.views import VIEW

from . import arrival, gallery
from . import causal as causal_section
from . import keeps as keeps_section
from . import lesson
from .handler import SWEPT, Handler, show_head, show_layer, show_turn
from .lab import (HEAD_PICKER, LAB_DETECTOR, LAB_DETECTOR_INFO, LAB_INTRO, NO_PLAN, TEACHING_PLAN,
                  TOKEN_PICKER, lab_answers)
from .arrival import Example
from .edit import NO_EDIT
from .present import CARDS, INSPECTOR, LESSON, OUTPUTS, SWEEP_OUTPUTS, TURN_OUTPUTS
from .settings import Settings, examples, knob_defaults, options_taken

MAIN_KNOBS = ("method", "retain", "flops_ratio")  # shown above the fold; the rest under "Advanced settings"
SLIDER_STEPS = 1000  # steps of a slider over a knob's range
DELETE_CACHE = (3600, 86400)  # (every, older than) seconds: uploads and figures leave the disk after a day
RULED = [k.name for k in KNOBS if k.rule is not None]  # knobs whose default depends on the model
# Knobs without a default (not given = None). gradio's number box shows None as 0 and sends 0, which such a
# knob never takes (its range starts above 0): the page sends None for it instead (`unset_zeros`).
UNSET = [k.name for k in KNOBS if k.optional and k.rule is None]
SWEEP_KNOBS = tuple(k.name for k in KNOBS if k.name not in SWEPT)
UNSET.extend(o.name for o in OPTIONS if o.choices is None)  # processor options: a number box's 0 = the checkpoint's own
OPTIONS_INTRO = (
    "How the image becomes visual tokens: the processor settings of the chosen model's family that change their "
    "count (pan-and-scan crops, tiles, splitting, pixels). Blank or default: the checkpoint's own, listed after a run "
    "in the explanation and the JSON summary (`processor_options`). Only the chosen model's options are shown; a model whose processor "
    "has none shows none (e.g. LLaVA-1.5). Each is the `/analyze` parameter and `python -m hap run` flag of its name."
)
SWEEP_INTRO = (
    "Every pruning method at budgets from keeping everything down to the least this model allows (its first "
    "layers keep every token, each group at least one), with the other settings above. Top: the probability each "
    "pruned model gives the unpruned answer (each method its own dash and marker, set slightly apart where they "
    "coincide); bottom: each method's answer at each budget, cut at its end, green where it is the unpruned one "
    "and red where it differs. Results are cached per input."
)

EDITOR_LABEL = "Image"  # short: the editor's toolbar sits at the top right of its box, over a longer label (1280 px)
INTRO = (
    "# HAP: head-adaptive visual token pruning\n"
    "Upload an image (or click an example; brush, erase or crop it in the editor to see what changes), ask a "
    "question, choose a budget and press **Run**. "
    "HAP scores every attention head by how well it aligns the prompt with the image (PAQ), fuses "
    "heads with those weights, and keeps only the best visual tokens inside the decoder. "
    "Each setting is named as the `/analyze` API parameter and `python -m hap run` flag it sets; "
    "a flops_ratio, when given, replaces retain.\n\n"
)


def control(knob: Knob, value: object) -> gr.components.Component:
    """The control of one knob, with the registry's range and `value`."""
    info = f"{knob.help} (0: not set)" if knob.name in UNSET else knob.help
    common = dict(value=value, label=knob.name, info=info, elem_id=f"knob-{knob.name}")
    if knob.choices is not None:
        return gr.Radio(list(knob.choices), **common)
    if knob.kind is str:
        return gr.Textbox(**common)
    if knob.kind is float and knob.low is not None and knob.high is not None and value is not None:
        step = (knob.high - knob.low) / SLIDER_STEPS
        return gr.Slider(knob.low + (step if knob.low_open else 0.0), knob.high, step=step, **common)
    return gr.Number(minimum=knob.low, maximum=knob.high, precision=0 if knob.kind is int else None, **common)


def unset_zeros(offset: int, names: tuple[str, ...], reset: tuple[int, ...] = ()) -> str:
    """Page-side JavaScript run on the event's inputs (`offset` of them before the knobs `names`): 0 -> null for
    UNSET, and null at the positions `reset` (Run sends no history: a new conversation)."""
    positions = [offset + i for i, name in enumerate(names) if name in UNSET]
    return (f"(...v) => {{ for (const i of {positions}) {{ if (v[i] === 0) v[i] = null; }} "
            f"for (const i of {list(reset)}) v[i] = null; return v; }}")


def option_control(option: Knob, shown: bool) -> gr.components.Component:
    """The control of one processor option (`hap.options.OPTIONS`), blank (the checkpoint's own), `shown` or hidden."""
    common = dict(label=option.name, info=option.help, elem_id=f"option-{option.name}", visible=shown)
    if option.choices is not None:
        return gr.Radio(["default", *option.choices], value="default", **common)
    return gr.Number(value=None, minimum=option.low, maximum=option.high,
                     precision=0 if option.kind is int else None, **common)


def option_controls(model_name: str) -> dict[str, gr.components.Component]:
    """Every processor option's control, in an accordion, those of `model_name`'s family shown (all where unknown)."""
    taken = options_taken(model_name)
    with gr.Accordion("Image processor options (visual-token count)", open=False):
        gr.Markdown(OPTIONS_INTRO)
        return {o.name: option_control(o, taken is None or o.name in taken) for o in OPTIONS}


def model_options(model_name: str) -> list:
    """The processor options' controls on a model change: those of its family shown (all where unknown), reset to
    the checkpoint's own."""
    taken = options_taken(model_name)
    return [gr.update(visible=taken is None or o.name in taken, value="default" if o.choices else None)
            for o in OPTIONS]


def model_defaults(model_name: str) -> list:
    """The values of the per-model knobs (RULED) for `model_name`: the controls' update on a model change."""
    defaults = knob_defaults(model_name)
    return [gr.update(value=defaults[name]) for name in RULED]


def intro(limits: InputLimits) -> str:
    return INTRO + (
        f"Images: {FORMATS}, up to {limits.max_bytes / 2**20:g} MB and {limits.max_pixels / 1e6:g} megapixels; "
        f"prompts up to {limits.max_prompt_chars} characters; a conversation up to {limits.max_history_turns} earlier "
        f"turns and {limits.max_conversation_chars} characters. One request runs at a time; when the queue is "
        "full, retry in a few seconds."
    )


def knob_controls(defaults: dict[str, object]) -> dict[str, gr.components.Component]:
    """Every knob's control, the main ones first, the rest in an accordion; keyed and ordered as KNOBS."""
    made = {k.name: control(k, defaults[k.name]) for k in KNOBS if k.name in MAIN_KNOBS}
    with gr.Accordion("Advanced settings", open=False):
        made.update({k.name: control(k, defaults[k.name]) for k in KNOBS if k.name not in MAIN_KNOBS})
    return {k.name: made[k.name] for k in KNOBS}


def plot(name: str) -> gr.Plot:
    return gr.Plot(label=VIEW[name].label, elem_id=f"plot-{name}")


def request_column(names: list[str], first: Example | None
                   ) -> tuple[list[gr.components.Component], dict, gr.Button, list[tuple[gr.Dataset, list]]]:
    """The left column: ([image, prompt, model], the knob and processor-option controls by name, the Run button, the
    example galleries with their rows). The editor and the prompt open on the example `first` (`app.arrival`): values
    of the page as built, never set by the server after load."""
    image = gr.ImageEditor(value=first and first.image, type="filepath",
                           label=EDITOR_LABEL, height=340,
                           sources=("upload", "clipboard"), transforms=("crop",), elem_id="image-editor",
                           brush=gr.Brush(colors=["#000000", "#ffffff", "#808080", "#ff0000", "#0000ff"],
                                          default_color="#000000", color_mode="defaults"))
    galleries = example_galleries(names)  # beside the editor: what a click puts in it
    prompt = gr.Textbox(value=first and first.prompt, label="Prompt", placeholder="what color is the triangle ?",
                        lines=2, elem_id="prompt")
    model = gr.Dropdown(names, value=names[0], label="Model (loaded on first use)")
    knobs = {**knob_controls(knob_defaults(names[0])), **option_controls(names[0])}  # the knobs, the options
    run = gr.Button("Run (new conversation)", variant="primary", elem_id="run")
    return [image, prompt, model], knobs, run, galleries


def answer_column() -> dict[str, gr.components.Component]:
    """The top of the "this image" tab: the arrival note (`app.arrival.NOTE`: what the page opened on), the answer
    cards, the kept tokens, the conversation, the tokens per layer and the explanation, by output name."""
    note = gr.Markdown(arrival.IDLE, elem_id=arrival.NOTE)
    with gr.Row(equal_height=True):
        out = {k: gr.Markdown(f"#### {LABELS[k]}\n(no run yet)", elem_id=f"answer-{k}", container=True) for k in CARDS}
    out[arrival.NOTE] = note
    out["kept_masks"] = plot("kept_masks")  # the tab's main figure, under the answers
    out.update(conversation_section())
    out["token_counts"] = plot("token_counts")  # beside the groups: what each layer ran on (AutoPrune: its curve)
    with gr.Accordion("What am I looking at?", open=True):
        out["explanation"] = gr.Markdown(TEACHING, elem_id="explanation")
    return out


def conversation_section() -> dict[str, gr.components.Component]:
    """The conversation about the image (each turn with its kept tokens), the turn picker, the follow-up button and
    the history `/analyze` takes (hidden: the page fills it), by output name; the button under "follow_up"."""
    with gr.Group():
        out = {"conversation": gr.Chatbot(label="Conversation (each answer is the chosen method's, with its kept "
                                                "tokens)", height=320, elem_id="conversation"),
               "turn": gr.Radio([], label="Show turn (every view below)", elem_id="turn", interactive=True),
               "follow_up": gr.Button("Ask as a follow-up (same image, the conversation so far)", elem_id="follow-up"),
               "history": gr.JSON([], visible=False, elem_id="history")}
    return out


def edit_section() -> dict[str, gr.components.Component]:
    """The run on the edited image against the run on the original, by output name (EDIT)."""
    gr.Markdown("## What the edit changed")
    return {"edit_diff": gr.Markdown(NO_EDIT, elem_id="edit-diff"),
            "edit_diff_plot": gr.Plot(label="Kept tokens after the edit", elem_id="plot-edit_diff", visible=False)}


def example_galleries(names: list[str]) -> list[tuple[gr.Dataset, list]]:
    """The examples as compact galleries (`app.gallery`: a thumbnail and its question each), with their rows
    ([image, prompt, model]); a click fills image, prompt and model (`app.gallery.attach`)."""
    scenes, photos = examples(names)
    made = []
    if scenes:
        made.append((gallery.gallery(scenes, "Examples: synthetic scenes, each asked its own question",
                                     "examples-scenes"), scenes))
    if photos:
        made.append((gallery.gallery(photos, "Photographs (real checkpoints; need the weights)", "examples-photos",
                                     photo=True), photos))
    return made


def method_sections() -> dict[str, gr.components.Component]:
    """The "this image" tab under the answers: head heterogeneity (classes, PAQ) and the maps after head and layer
    fusion, uniform against PAQ, by output name."""
    gr.Markdown("## Head heterogeneity")
    with gr.Row():
        out = {name: plot(name) for name in ("head_classes", "paq")}
    gr.Markdown("## Attention maps over the image, after fusion")
    out.update({name: plot(name) for name in ("layer_maps", "group_maps", "uniform_vs_paq")})
    return out


def check_sections() -> tuple[gr.Radio, dict[str, gr.components.Component]]:
    """The "check PAQ" tab: the ground truth beside each head's grounding, the causal truth and head utility
    (`app.causal`), the per-head maps with the layer slider and the head inspector, and the raw JSON: (the causal
    setting, the outputs by name)."""
    with gr.Row():
        out = {"ground_truth": gr.Markdown("**Ground truth.** (no run yet)", elem_id="ground-truth"),
               "grounding": plot("grounding")}
    setting, causal_out = causal_section.section()
    out.update(causal_out)
    gr.Markdown("## Each head over the image")
    out["layer"] = gr.Slider(0, 1, value=0, step=1, label="Layer (per-head maps and head inspector)",
                             interactive=False, elem_id="layer-slider")
    out["head_maps"] = plot("head_maps")
    out.update(inspector_section())
    with gr.Accordion("Raw result (JSON)", open=False):
        out["summary"] = gr.JSON(label="Result")
    return setting, out


def inspector_section() -> dict[str, gr.components.Component]:
    """The head inspector: a head slider (the layer is the layer slider's), the head's map and its numbers."""
    gr.Markdown("### Head inspector")
    head = gr.Slider(0, 1, value=0, step=1, label="Head", interactive=False, elem_id="head-slider")
    with gr.Row():
        figure = gr.Plot(label="One head over the image", elem_id="plot-inspector")
        stats = gr.Markdown("(no run yet)", elem_id="inspector-stats")
    return {"head": head, **dict(zip(INSPECTOR, (figure, stats)))}


def lab_section() -> tuple[dict[str, gr.components.Component], dict[str, gr.components.Component]]:
    """The head lab, "What if heads differed?": (its controls by name: the plan (`plant`), the pickers' kind, the
    lab's sink detector, the share helper and its button, the run button; its outputs by name (`LAB` and "lab"):
    the two pickers, then the run's views side by side, its answers and its text, and the run's plan report)."""
    gr.Markdown(LAB_INTRO)
    controls = {"plant": gr.Code(value="", language="json", label="Plan (the /analyze parameter `plant`; empty = none)",
                                 elem_id="plant", interactive=True)}
    out = {}
    with gr.Row():
        controls["kind"] = gr.Radio(["sink", "dispersed"], value="sink", label="Plant (clicks and the share helper)",
                                    elem_id="lab-kind")
        controls["detector"] = gr.Radio(list(SINK_DETECTORS), value=LAB_DETECTOR,
                                        label="sink_detector (lab runs)", info=LAB_DETECTOR_INFO,
                                        elem_id="lab-detector")
    with gr.Row():
        out["lab_heads"] = gr.Image(label=HEAD_PICKER, interactive=False, format="png", elem_id="lab-heads")
        out["lab_tokens"] = gr.Image(label=TOKEN_PICKER, interactive=False, format="png", elem_id="lab-tokens")
    with gr.Row():
        controls["share"] = gr.Slider(0, 100, value=50, step=1, label="in % of the heads", elem_id="lab-share")
        controls["layers"] = gr.Textbox(value="0-1", label="of layers a-b", elem_id="lab-layers")
        controls["seed"] = gr.Number(value=0, precision=0, label="seed", elem_id="lab-seed")
    with gr.Row():
        controls["strength"] = gr.Slider(0, 1, value=0.9, step=0.01, label="strength", elem_id="lab-strength")
        controls["sink_tokens"] = gr.Textbox(value="", label="sink tokens (visual-token indices; empty: the most "
                                             "redundant patch)", elem_id="lab-sink-tokens")
        controls["fill"] = gr.Button("Fill the plan", elem_id="lab-fill")
    controls["run"] = gr.Button("Run with this plan (new conversation)", variant="primary", elem_id="lab-run")
    gr.Markdown("### This run with the plan, side by side")
    with gr.Row():
        out["lab_head_classes"] = gr.Plot(label="Head classes: the planted heads found or missed",
                                          elem_id="plot-lab_head_classes", visible=False)
        with gr.Column():
            out["lab_answers"] = gr.Markdown(lab_answers({}), elem_id="lab-answers", container=True)
            out["lab"] = gr.Markdown(NO_PLAN, elem_id="lab")
    with gr.Row():
        out["lab_uniform_vs_paq"] = gr.Plot(label=VIEW["uniform_vs_paq"].label, elem_id="plot-lab_uniform_vs_paq",
                                            visible=False)
        out["lab_kept_masks"] = gr.Plot(label=VIEW["kept_masks"].label, elem_id="plot-lab_kept_masks", visible=False)
    out["lab_report"] = gr.State()
    return controls, out


def lesson_section() -> tuple[list[gr.Button], dict[str, gr.components.Component]]:
    """The guided lesson (`app.lesson`): (its step buttons, its outputs by name: `LESSON`, the views hidden until a
    step shows them)."""
    gr.Markdown(lesson.INTRO)
    with gr.Row():
        buttons = [gr.Button(step.button, elem_id=f"lesson-{i + 1}") for i, step in enumerate(lesson.STEPS)]
    out = {"lesson_text": gr.Markdown("(press a step)", elem_id="lesson-text")}
    labels = {"head_classes": "Head classes", "uniform_vs_paq": VIEW["uniform_vs_paq"].label,
              "kept_masks": VIEW["kept_masks"].label}
    for row in (("head_classes", "uniform_vs_paq"), ("kept_masks", None)):  # fixed half-page slots: showing or
        with gr.Row():                                                        # hiding a view reflows nothing
            for name in row:
                with gr.Column():
                    if name:
                        out[f"lesson_{name}"] = gr.Plot(label=labels[name], elem_id=f"plot-lesson_{name}",
                                                        visible=False)
    return buttons, out


def sweep_section() -> tuple[gr.Button, dict[str, gr.components.Component]]:
    """The budget sweep: its button and outputs by name (SWEEP_OUTPUTS)."""
    gr.Markdown(f"## Budget sweep\n{SWEEP_INTRO}")
    button = gr.Button("Sweep the budget", elem_id="sweep")
    figure = gr.Plot(label="Budget sweep", elem_id="plot-sweep")
    with gr.Accordion("Sweep (JSON)", open=False):
        data = gr.JSON(label="Sweep", elem_id="sweep-json")
    return button, dict(zip(SWEEP_OUTPUTS, (figure, data)))


def by_component(fn, components: dict[str, gr.components.Component]) -> dict:
    """`fn()`'s outputs by name given to `components` by name (those it leaves out unchanged)."""
    return {components[name]: value for name, value in fn().items()}


TABS = {"image": "What it does on this image", "compare": "Compare methods", "check": "Check PAQ",
        "lab": "Head lab"}  # tab id -> label; each tab's elem_id is tab-<id> (its button: tab-<id>-button)


def tab(name: str) -> gr.Tab:
    """The tab `name` of TABS."""
    return gr.Tab(TABS[name], id=name, elem_id=f"tab-{name}")


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
    env = Settings.from_env()
    settings = replace(env, models=models or env.models, allow_local=env.allow_local if allow_local is None
                       else allow_local, limits=limits or env.limits, queue_size=queue_size or env.queue_size)
    handler = Handler(settings)
    arrived = arrival.Arrival(handler, settings.models)
    with gr.Blocks(title="HAP: head-adaptive visual token pruning", delete_cache=DELETE_CACHE) as demo:
        gr.Markdown(intro(settings.limits))
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                request, knobs, run, galleries = request_column(settings.models, arrived.opening)
                options = {o.name: knobs.pop(o.name) for o in OPTIONS}  # the API's last parameters, after the knobs'
                for dataset, rows in galleries:
                    gallery.attach(dataset, rows, request)
            with gr.Column(scale=3), gr.Tabs(elem_id="tabs"):
                with tab("image"):
                    out = answer_column()
                    out.update(edit_section())
                    out.update(method_sections(), state=gr.State(), turns=gr.State())
                with tab("compare"):
                    keeps_box, keeps_ticked, keeps_run, keeps_out = keeps_section.section()
                    out.update(keeps_out)
                    sweep, sweep_out = sweep_section()
                with tab("check"):
                    causal_setting, check_out = check_sections()
                    out.update(check_out)
                with tab("lab"):
                    lesson_steps, lesson_out = lesson_section()
                    lab, lab_out = lab_section()
                    out.update(lab_out)
                    if examples(settings.models)[0]:
                        gr.Examples([[*examples(settings.models)[0][0], json.dumps(TEACHING_PLAN.to_json()),
                                      LAB_DETECTOR]], [*request, lab["plant"], lab["detector"]],
                                    label="Head lab teaching example: sinks planted in half the heads of the scoring "
                                          "layers (layers 0, 1, 3), found by the consensus detector; press Run with "
                                          "this plan")
        outputs = [out[name] for name in OUTPUTS]
        _, prompt, model = request
        # The API's image is a file, as an upload (gradio_client: handle_file); the page sends the editor's value
        # through twins of the same events. Neither button below is shown: they only carry the API names.
        api_request, api = [gr.Image(type="filepath", image_mode=None, visible=False), prompt, model], gr.Button(
            visible=False)
        # preprocess=False: the handler checks every raw value itself (gradio would decode the upload and
        # range-check controls with messages that do not name the field). gradio refuses a path outside its
        # upload cache only in a FileData dict carrying meta; the handler checks every path, with meta or
        # without, against the upload cache and the examples (app/uploads.py)
        conversation = {"history": out["history"], "turns": out["turns"], "causal": causal_setting,
                        "plant": lab["plant"], "keeps": keeps_box}
        inputs = {**knobs, **conversation, **options}
        lane = dict(inputs_kwargs=inputs, concurrency_limit=1, concurrency_id="model",
                    preprocess=False, js=unset_zeros(len(request), tuple(inputs)))
        history_at = len(request) + list(lane["inputs_kwargs"]).index("history")  # Run: no history, a new conversation
        new = {**lane, "js": unset_zeros(len(request), tuple(inputs), reset=(history_at,))}
        analyze = handler.endpoint(handler.analyze, out, (*knobs, *options))
        api.click(analyze, api_request, outputs, api_name="analyze", **lane)
        lab_lane = {**new, "inputs_kwargs": {**new["inputs_kwargs"], "sink_detector": lab["detector"]}}
        keeps_lane = {**new, "inputs_kwargs": {**new["inputs_kwargs"], "keeps": keeps_ticked}}
        refusals = dict(fn=keeps_section.refused_text, inputs=out["summary"], outputs=out["keeps_refused"],
                        api_visibility="private")  # after every run, and a picked turn: the keeps grid's refusals
        seen = dict(fn=arrival.seen, outputs=out[arrival.NOTE], api_visibility="private")  # the note, once a run
        for event, kwargs in ((run.click, new), (prompt.submit, new), (out["follow_up"].click, lane),  # replaces it
                              (lab["run"].click, lab_lane), (keeps_run.click, keeps_lane)):
            ran = event(analyze, request, outputs, api_visibility="private", **kwargs)
            ran.then(**refusals)
            ran.success(**seen)
        pickers = dict(fn=handler.lab_pickers, inputs=[model, lab["plant"], out["state"], out["lab_report"]],
                       outputs=[out["lab_heads"], out["lab_tokens"], lab["sink_tokens"]], api_visibility="private")
        lab["plant"].change(**pickers)
        # On arrival (app.arrival): the kept result at once (one update of every output); a missing one runs on the
        # model lane and fills the page
        pending = gr.State()
        shown = {**{name: out[name] for name in (*OUTPUTS, arrival.NOTE)}, arrival.PENDING: pending}
        demo.load(partial(by_component, arrived.shown, shown), outputs=list(shown.values()), api_visibility="private",
                  show_progress="hidden", concurrency_limit=None)  # no model call: visitors served side by side
        pending.change(partial(by_component, arrived.compute, out), outputs=[*outputs, out[arrival.NOTE]],
                       api_visibility="private", concurrency_limit=1, concurrency_id="model")
        out["lab_heads"].select(handler.click_head, [lab["plant"], lab["kind"], model, out["state"]], lab["plant"],
                                api_visibility="private")
        out["lab_tokens"].select(handler.click_token, [lab["plant"], out["state"]], lab["plant"],
                                 api_visibility="private")
        lab["fill"].click(handler.fill_plan, [model, *(lab[k] for k in ("kind", "share", "layers", "seed", "strength",
                                                                  "sink_tokens"))], lab["plant"], api_visibility="private")
        for index, button in enumerate(lesson_steps):
            button.click(partial(handler.lesson_outputs, index), model, [lesson_out[name] for name in LESSON],
                         api_visibility="private", concurrency_limit=1, concurrency_id="model")
        sweep_lane = {**lane, "inputs_kwargs": {**{k: knobs[k] for k in SWEEP_KNOBS}, **options},
                      "js": unset_zeros(len(request), (*SWEEP_KNOBS, *options))}
        sweeper, sweep_outputs = handler.endpoint(handler.sweep, sweep_out, (*SWEEP_KNOBS, *options)), [
            sweep_out[name] for name in SWEEP_OUTPUTS]
        api.click(sweeper, api_request, sweep_outputs, api_name="sweep", **sweep_lane)
        sweep.click(sweeper, request, sweep_outputs, api_visibility="private", **sweep_lane)
        out["turn"].input(show_turn, [out["turns"], out["turn"]], [out[name] for name in TURN_OUTPUTS],
                          api_visibility="private").then(**refusals)
        stored = [out["state"], out["layer"], out["head"]]
        inspector = [out[name] for name in INSPECTOR]
        out["layer"].input(show_layer, stored, [out["head_maps"], *inspector], api_visibility="private",
                           trigger_mode="always_last")
        out["head"].input(show_head, stored, inspector, api_name="inspect", trigger_mode="always_last")
        model.change(model_defaults, model, [knobs[name] for name in RULED], api_visibility="private")
        model.change(model_options, model, list(options.values()), api_visibility="private")
    demo.queue(max_size=settings.queue_size)
    demo.hap_handler = handler  # its `settings` are what this demo enforces
    demo.hap_arrival = arrived
    return demo
