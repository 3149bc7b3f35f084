"""The page's "What each method keeps" section: every pruning method of the registry at the page's budget, one small
map per method over the analysed image (`hap.runs.keeps`).

Opt-in, so that `/analyze`'s default cost does not grow: the request field `keeps` (the section's checkbox, which Run
and follow-ups read, or its own button) runs every method once more at the budget, the answers decoded as one batch
and the image's features reused; the JSON gains `keeps`.
"""

from __future__ import annotations

import gradio as gr

from hap.runs.keeps import refused_lines

INTRO = (
    "## What each method keeps\n"
    "Every pruning method of the method list at this page's budget, on the analysed image: one small map per method, "
    "the tokens its first cut keeps bright and the rest dimmed, the answering patches outlined on a scene asked its "
    "own question. Each title gives the method's answer and its overlap with HAP's: the share of HAP's (visual token, "
    "decoder layer) pairs the method also runs. A method the model refuses, or whose budget it cannot reach, is listed "
    "beside the figure with the reason, one line each. It costs one prefill per method (the answers decoded together, the image encoded once), so it "
    "runs only when asked: tick the box (Run and follow-ups then include it) or press the button."
)
FIGURE_PX = 650  # the figure's width at a 1280-px window (4/5 of the tabs' column): its titles wrap to it
NOT_RUN = "not run: tick 'keeps' or press 'Compare every method' (each method costs a prefill)"


def check(value: object) -> bool:
    """The request field `keeps`: true or false (None: false); ValueError otherwise."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"keeps={value!r} must be true or false (run every method at the budget)")
    return value


def refused_text(summary: dict | None) -> str:
    """The side text of the figure: the methods it leaves out, one line each with the reason (Markdown), from the
    `/analyze` JSON `summary`; NOT_RUN where the run did not ask for every method."""
    entry = (summary or {}).get("keeps")
    if entry is None:
        return NOT_RUN
    lines = refused_lines(entry["refused"])
    return "**Not in the figure**\n\n" + "\n".join(f"- {line}" for line in lines) if lines else "Every method ran."


def section() -> tuple[gr.Checkbox, gr.Checkbox, gr.Button, dict[str, gr.components.Component]]:
    """(the `keeps` checkbox, a hidden ticked one for the button, the button, the components by name: the figure
    "keeps" (an `/analyze` output) and beside it "keeps_refused", the methods it leaves out (`refused_text`, which the
    page fills from the run's JSON))."""
    gr.Markdown(INTRO)
    with gr.Row():
        box = gr.Checkbox(False, label="keeps", info="also run every method at this budget (one prefill each, the "
                          "answers as one batch)", elem_id="keeps-setting")
        button = gr.Button("Compare every method (new conversation)", elem_id="keeps-run")
    ticked = gr.Checkbox(True, visible=False)
    with gr.Row():
        with gr.Column(scale=4):
            figure = gr.Plot(label="What each method keeps", elem_id="plot-keeps")
        with gr.Column(scale=1, min_width=200):
            side = gr.Markdown(NOT_RUN, elem_id="keeps-refused")
    return box, ticked, button, {"keeps": figure, "keeps_refused": side}
