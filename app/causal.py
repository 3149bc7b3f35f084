"""The page's "Is PAQ right?" section: causal head and token importance (hap.causal) beside PAQ, for every input.

`section()` lays it out, `analyze(...)` runs it on the loaded model (the setting `causal`: auto, ablation,
attribution or off) and `outputs(...)` gives its outputs by name (CAUSAL) and the `causal` JSON entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import gradio as gr
import numpy as np
from PIL import Image

from hap import causal, causal_views, views
from hap.inputs import InputLimits

CAUSAL = ("causal_text", "causal_heads", "causal_scatter", "causal_tokens")
OFF = "**Is PAQ right?** Causal analysis is off (setting `causal`); set it to auto to see which heads and tokens " \
      "the answer depends on."
INTRO = (
    "## Is PAQ right?\n"
    "PAQ says how a head's attention *looks*. Whether the answer *depends* on the head is a different question, "
    "answered by intervening: zero the head's output (or, first-order, take the gradient of a gate on it) and watch "
    "the log-probability of the unpruned model's first answer token."
)


def section(default: str = "auto") -> tuple[gr.Radio, dict[str, gr.components.Component]]:
    """The setting and the section's outputs by name (CAUSAL)."""
    gr.Markdown(INTRO)
    setting = gr.Radio(list(causal.SETTINGS), value=default, label="causal", elem_id="causal-setting",
                       info="auto: exact ablation where cheap (small models), attribution on large ones; off: skip")
    out = {"causal_text": gr.Markdown("(no run yet)", elem_id="causal-text")}
    with gr.Row():
        out["causal_heads"] = gr.Plot(label="Causal head importance", elem_id="plot-causal_heads")
        out["causal_scatter"] = gr.Plot(label="PAQ vs importance", elem_id="plot-causal_scatter")
    out["causal_tokens"] = gr.Plot(label="Token importance and each group's kept tokens", elem_id="plot-causal_tokens")
    return setting, out


def analyze(model, processor, image: Image.Image, prompt: str, setting: str | None, limits: InputLimits,
            history: Sequence[tuple[str, str]] = ()) -> causal.Causal | None:
    """The causal analysis the setting asks for (None: "auto"), or None when it is off; ValueError on a bad one."""
    mode = causal.resolve_setting(model, setting or "auto")
    return None if mode is None else causal.analyze(model, processor, image, prompt, mode, limits, history)


def outputs(found: causal.Causal | None, data: views.ViewData) -> tuple[dict[str, object], dict | None]:
    """(the section's outputs by name, the `causal` JSON entry or None when off)."""
    if found is None:
        return {"causal_text": OFF, "causal_heads": None, "causal_scatter": None, "causal_tokens": None}, None
    paq = data.stats[..., 0]
    report = causal.to_json(found, paq, [g.kept for g in data.groups])
    how = f"{found.mode}, {found.seconds:.2f} s"
    return {
        "causal_text": text(found, report, data),
        "causal_heads": causal_views.importance_plotly(causal_views.importance_grid(data, found.head_importance),
                                                       f"Causal head importance ({how})"),
        "causal_scatter": causal_views.scatter_plotly(paq, found.head_importance, report["paq_spearman"],
                                                      "PAQ vs causal importance"),
        "causal_tokens": causal_views.tokens_plotly(data, found.token_importance.numpy(),
                                                    f"Token importance for {found.answer_text.strip()!r} ({how})"),
    }, report


def text(found: causal.Causal, report: dict, data: views.ViewData) -> str:
    """Markdown: this run's numbers and what they mean (attention vs causation), with the geometric truth beside
    the causal one on a scene asked its own question."""
    heads = found.head_importance.numpy()
    L, H = heads.shape
    top = np.argsort(-heads.ravel())[:3]
    rho = report["paq_spearman"]
    rho_text = "undefined (too few heads scored)" if rho is None else f"{rho:.2f}"
    shares = ", ".join(f"group {g.index} {'-' if s is None else f'{s:.0%}'}"
                       for g, s in zip(data.groups, report["kept_importance"]))
    exact = "exactly, one forward per head" if found.mode == "ablation" else \
        "to first order (attribution: one forward and one backward through a gate on each head)"
    lines = [
        f"**Causal truth** ({found.mode}, {found.seconds:.2f} s): the unpruned model's first answer token is "
        f"{found.answer_text.strip()!r} (log p {found.log_prob:.2f}); each head's importance is the drop in that log p "
        f"when the head is zeroed at every prompt position, measured {exact}.",
        f"- Most important heads: " + ", ".join(f"L{i // H}h{i % H} ({heads.ravel()[i]:+.3f})" for i in top) + ".",
        f"- Spearman(PAQ, importance) over the scored heads: **{rho_text}**. "
        + _meaning(rho),
        f"- Share of the positive token importance each group keeps: {shares or 'no cuts'}.",
        "- Attention is where a head looks, not what the answer uses (Jain & Wallace 2019; Wiegreffe & Pinter 2019): "
        "a head can focus on the right object and still not matter (a later head or the MLP does the work), and a "
        "dispersed head can carry the answer. Pruning keeps tokens, not heads, so the token map is the closer check.",
    ]
    if data.truth is not None and data.truth.patches.any():
        lines.append(_truth_line(found, data))
    return "\n".join(lines)


def _meaning(rho: float | None) -> str:
    if rho is None:
        return ""
    if rho >= 0.5:
        return "PAQ ranks heads much as the intervention does: here the heads it favours are the ones the answer uses."
    if rho > 0.2:
        return "PAQ agrees only loosely with the intervention."
    return ("PAQ and the intervention disagree: the heads that look well aligned are not the ones this answer "
            "depends on.")


def _truth_line(found: causal.Causal, data: views.ViewData) -> str:
    """Geometric truth (the answering patches, each head's grounding on them) against causal truth."""
    patches = np.asarray(data.truth.patches, dtype=bool)
    k = int(patches.sum())
    precision = causal.token_precision(found.token_importance.numpy(), patches)
    grounding = data.truth.grounding
    agree = None if grounding is None else causal.paq_spearman(grounding, found.head_importance)
    agree_text = "undefined" if agree is None else f"{agree:.2f}"
    return (f"- **Geometric vs causal truth** (this scene's own question): of the {k} most important tokens, "
            f"{precision:.0%} are answering patches (chance {k / patches.size:.0%}); Spearman(grounding, "
            f"importance) over the scored heads {agree_text}.")
