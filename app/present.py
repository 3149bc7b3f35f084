"""What the page shows: the outputs of `/analyze`, `/sweep` and the stored-run views by name, built from what
`app.pipeline` computed (no model call here).

`OUTPUTS` names every output of `/analyze` in the order the page and the API give them (the states last: not among
the API's outputs); `analysis_outputs` builds them from an `app.pipeline.Analysis`: the three answer cards, the layer
and head sliders, every view of `hap.views.VIEWS`, the explanation, the JSON summary (with "input": the upload and
its conversion, "ground_truth" on a scene asked its own question and "edit" on an edited image), the ground-truth
note, the head lab, the "Is PAQ right?" section, the head inspector, the edit's comparison and the state for
re-drawing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gradio as gr

from hap import views
from hap.views.ground_truth import truth_json
from hap.runs.keeps import keeps_plotly
from hap.lab.plan import Plan
from hap.options import ProcessorOptions
from hap.views.report import answer_card, explanation, head_text, summary, sweep_title, truth_text

from . import causal as causal_section
from . import keeps as keeps_section
from . import conversation as chat
from .edit import NO_EDIT
from .images import serve_figure, serve_images
from .lab import LAB_VIEWS, NO_PLAN, lab_answers, lab_text, mark_planted, side_by_side
from .lab_pick import chosen_tokens, head_picker, token_picker

if TYPE_CHECKING:
    from .pipeline import Analysis

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
SWEEP_OUTPUTS = ("sweep_plot", "sweep")


def analysis_outputs(analysis: Analysis, shared: bool) -> dict[str, object]:
    """The outputs of one `/analyze` run by name (`OUTPUTS` but the conversation's, `CONVERSATION` and the turns);
    `shared`: whether the runs shared the image's features (HAP_APP_SHARE), reported in the JSON."""
    request, comparison, data = analysis.request, analysis.comparison, analysis.data
    config, plan, lab = request.config, request.plan, analysis.lab
    report = summary(comparison, analysis.timed, request.model_name)
    report["shared"] = shared
    report["input"] = {**analysis.info, "edited": request.picture.edited}
    report["processor_options"] = analysis.processor_options
    if data.truth is not None:
        report["ground_truth"] = truth_json(data.truth)
    shown, entries = causal_section.outputs(analysis.causal, data, request.model_name, config)
    report.update(entries)  # "causal" and "head_utility" unless off, "head_weights"
    edit = analysis.edit
    if edit is not None:
        report["edit"] = edit.to_json()
    figures = {**views.figures(data), "keeps": None}  # "keeps": marked PLANTED with the views, as one of them
    if analysis.keeps is not None:
        report["keeps"] = analysis.keeps.to_json()
        figures["keeps"] = keeps_plotly(data, analysis.keeps, keeps_section.FIGURE_PX)
    tracing = comparison.pruned.timings["generate_s"]  # the traced run the figures come from: not in a latency
    cards = {label: answer_card(label, r, tracing if label == "pruned" else None)
             for label, r in analysis.timed.items()}
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
        "explanation": (explanation(comparison) + f"\n- Input: {analysis.conversion}."
                        + chat.rows_note(len(request.history), config.rows)),
        "lab": lab_note,
        **lab_views,
        "lab_answers": lab_answers(lab),
        **lab_pictures(data, plan, planted_report),
        "lab_report": planted_report,
        "summary": report,
        "ground_truth": truth_text(data.truth, analysis.why_not),
        **shown,
        **dict(zip(INSPECTOR, inspect_head(data, data.layer, 0))),
        "edit_diff": NO_EDIT if edit is None else edit.text(),
        "edit_diff_plot": shown_if(None if edit is None else edit.figure()),
        "state": data,
    })
    outputs["explanation"] += options_line(report["processor_options"], request.options)
    return outputs


def sweep_outputs(result: dict, model_name: str) -> dict[str, object]:
    """`/sweep`'s outputs by name (`SWEEP_OUTPUTS`): the plot and the JSON."""
    return {"sweep_plot": views.sweep_plotly(result, sweep_title(result, model_name)), "sweep": result}


def options_line(used: dict[str, object], given: ProcessorOptions) -> str:
    """The explanation's line on the processor options the run used (`used`, by name), each marked as set by the
    request (`given`) or the checkpoint's own; "" for a family without any."""
    if not used:
        return ""
    marked = [f"`{name}` {value} ({'set' if name in given.given() else 'the checkpoint'})"
              for name, value in used.items()]
    return "\n- Processor options: " + ", ".join(marked) + "."


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


def inspect_head(data: views.ViewData, layer: int, head: int) -> tuple:
    """(the map of head `head` of layer `layer` over the image, its numbers as Markdown); ValueError outside."""
    data = data.at_layer(layer)
    figure = views.panels_plotly(views.head_panel(data, head), f"Head inspector: layer {layer}, head {head}")
    return serve_figure(figure), head_text(data, head)
