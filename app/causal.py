"""The page's "Is PAQ right?" section: causal head and token importance (hap.causal) and head utility (hap.utility)
beside PAQ, for every input.

`section()` lays it out, `analyze(...)` runs it on the loaded model (the setting `causal`: auto, ablation,
attribution or off) and `outputs(...)` gives its outputs by name (CAUSAL) and the `causal` and `head_utility` JSON
entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gradio as gr
import numpy as np
from PIL import Image

from hap import HAPConfig, causal, utility, views
from hap.runs.inputs import InputLimits
from hap.patch.decoder import decoder_shape
from hap.runs.run import build_inputs
from hap.views import causal as causal_views

CAUSAL = ("causal_text", "causal_heads", "causal_scatter", "causal_tokens", "utility_text", "utility_heads",
          "utility_scatter", "utility_layers")
OFF = "**Is PAQ right?** Causal analysis is off (setting `causal`); set it to auto to see which heads and tokens " \
      "the answer depends on."
INTRO = (
    "## Is PAQ right?\n"
    "PAQ says how a head's attention *looks*. Whether the answer *depends* on the head is a different question, "
    "answered by intervening: zero the head's output (or, first-order, take the gradient of a gate on it) and watch "
    "the log-probability of the unpruned model's first answer token."
)
UTILITY_INTRO = (
    "### Head utility: would another weighting have kept the answer?\n"
    "PAQ exists to weight the heads whose maps pick the right tokens. Head utility asks each head directly: one cut "
    "entering the next layer keeps only the tokens that head's map scores highest (ceil(N / 9) of them, nothing "
    "merged), and its utility is the probability the pruned model still gives the unpruned answer token. The plain "
    "average and the PAQ weighting of the same layer's heads, cut the same way, are the reference lines."
)


CPU_PREFILLS = 4.0  # what "auto" spends on a CPU, in unpruned prefills of the decoder (FLOPs estimate)
ATTRIBUTION_PREFILLS = 3.0  # one forward and one backward (two forwards' FLOPs)


@dataclass
class Found:
    """What the section measured on one input."""

    causal: causal.Causal
    utility: utility.HeadUtility | None  # None: "auto" on a CPU left it out (`choice` says why)
    all_layers: bool  # head utility scored every layer (else the layers before the run's cuts: a large model)
    choice: str = ""  # what "auto" chose on a CPU, and why ("" where it ran the full section)


def section(default: str = "auto") -> tuple[gr.Radio, dict[str, gr.components.Component]]:
    """The setting and the section's outputs by name (CAUSAL)."""
    gr.Markdown(INTRO)
    setting = gr.Radio(list(causal.SETTINGS), value=default, label="causal", elem_id="causal-setting",
                       info="auto: exact ablation where cheap (small models), attribution on large ones; ablation: "
                            "exact, refused above hap.causal.ABLATION_BUDGET (heads x parameters); off: skip")
    out = {"causal_text": gr.Markdown("(no run yet)", elem_id="causal-text")}
    with gr.Row():
        out["causal_heads"] = gr.Plot(label="Causal head importance", elem_id="plot-causal_heads")
        out["causal_scatter"] = gr.Plot(label="PAQ vs importance", elem_id="plot-causal_scatter")
    out["causal_tokens"] = gr.Plot(label="Token importance and each group's kept tokens", elem_id="plot-causal_tokens")
    gr.Markdown(UTILITY_INTRO)
    out["utility_text"] = gr.Markdown("(no run yet)", elem_id="utility-text")
    with gr.Row():
        out["utility_heads"] = gr.Plot(label="Head utility", elem_id="plot-utility_heads")
        out["utility_scatter"] = gr.Plot(label="PAQ vs utility", elem_id="plot-utility_scatter")
    out["utility_layers"] = gr.Plot(label="Each head, the uniform average and the PAQ weighting at each cut",
                                    elem_id="plot-utility_layers")
    return setting, out


def analyze(model, processor, image: Image.Image, prompt: str, setting: str | None, limits: InputLimits,
            history: Sequence[tuple[str, str]] = (), config: HAPConfig | None = None,
            cuts: Sequence[int] = ()) -> Found | None:
    """The causal analysis the setting asks for (None: "auto") and head utility from `config`'s rows (its PAQ knobs
    weight the reference), or None when it is off; ValueError on a bad setting. `cuts`: the run's cut layers, where
    head utility is scored on a model too large for every layer (`hap.utility.auto_layers`)."""
    mode = causal.resolve_setting(model, setting or "auto")
    if mode is None:
        return None
    config = config or HAPConfig()
    layers, choice = utility.auto_layers(model, cuts), ""
    if (setting or "auto") == "auto" and mode == "attribution" and next(model.parameters()).device.type == "cpu":
        inputs, _, _ = build_inputs(processor, image, prompt, limits, history)
        ids = inputs["input_ids"][0]
        visual = int((ids == model.config.image_token_id).sum())
        layers, choice = cpu_layers(model, layers, visual, len(ids) - visual)
    found = causal.analyze(model, processor, image, prompt, mode, limits, history)
    measured = None if layers == [] else utility.utility(model, processor, image, prompt, rows=config.rows,
                                                         history=history, layers=layers, config=config,
                                                         limits=limits)
    return Found(found, measured, layers is None, choice)


def cpu_layers(model, layers: list[int], visual: int, text: int,
               budget: float = CPU_PREFILLS) -> tuple[list[int], str]:
    """The head-utility layers "auto" keeps on a CPU: of `layers` (the layers before the run's cuts), in order, those
    whose estimated cost (`hap.utility.cost`, in unpruned prefills) still fits in `budget` after the attribution's;
    with the sentence the page shows about the choice."""
    shape, (_, heads) = decoder_shape(model), causal.head_layout(model)
    left = budget - ATTRIBUTION_PREFILLS
    kept = []
    for layer in layers:
        if utility.cost(shape, visual, text, heads, layers=[*kept, layer]) <= left:
            kept.append(layer)
    dropped = [l for l in layers if l not in kept]
    if not dropped:
        return kept, ""
    cost = utility.cost(shape, visual, text, heads, layers=layers)
    return kept, (f"On a CPU, `auto` keeps this section within about {budget:g} unpruned prefills: attribution "
                  f"({ATTRIBUTION_PREFILLS:g}) and head utility at "
                  + (f"layers {', '.join(map(str, kept))}" if kept else "no layer")
                  + f" (all of layers {', '.join(map(str, layers))} would take about {cost:.1f} more). "
                  "Set `causal` to attribution to score them all.")


def outputs(found: Found | None, data: views.ViewData) -> tuple[dict[str, object], dict[str, dict]]:
    """(the section's outputs by name, its JSON entries: `causal` and `head_utility`, none when off)."""
    if found is None:
        return {**dict.fromkeys(CAUSAL), "causal_text": OFF, "utility_text": ""}, {}
    shown, report = causal_outputs(found.causal, data)
    if found.choice:
        shown["causal_text"] = f"_{found.choice}_\n\n" + shown["causal_text"]
        report["auto_choice"] = found.choice
    if found.utility is None:
        return ({**shown, **dict.fromkeys(CAUSAL[5:]), "utility_text": f"**Head utility** not measured: {found.choice}"},
                {"causal": report})
    entry = utility.to_json(found.utility)
    return {**shown, **utility_outputs(found, entry, data)}, {"causal": report, "head_utility": entry}


def causal_outputs(found: causal.Causal, data: views.ViewData) -> tuple[dict[str, object], dict]:
    """(the causal part's outputs by name, the `causal` JSON entry)."""
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


def utility_outputs(found: Found, entry: dict, data: views.ViewData) -> dict[str, object]:
    """The head-utility part's outputs by name, from `entry` (`hap.utility.to_json`)."""
    u = found.utility
    answer = u.answer_text.strip()
    return {
        "utility_text": utility_text(found, entry, data.shape[2]),
        "utility_heads": causal_views.utility_plotly(causal_views.importance_grid(data, u.values),
                                                     f"Head utility for {answer!r}: keep {u.keep} by one head"),
        "utility_scatter": causal_views.scatter_plotly(u.paq, u.values, entry["spearman"], "PAQ vs head utility",
                                                       "head utility"),
        "utility_layers": causal_views.references_plotly(u.values, u.uniform, u.paq_weighted, u.paq, u.answer_prob,
                                                         "Would another weighting have kept the answer?"),
    }


def utility_text(found: Found, entry: dict, num_visual: int) -> str:
    """Markdown: how often the best head, the uniform average and the PAQ weighting keep the answer, and
    Spearman(PAQ, utility)."""
    u = found.utility
    scored = u.scored
    rho = entry["spearman"]
    rho_text = "undefined (too few heads scored)" if rho is None else f"{rho:.2f}"
    kept = entry["answer_kept"]
    where = "every layer but the last" if found.all_layers else \
        f"layers {', '.join(map(str, scored))} (before this run's cuts: a large model)"
    verdict = "" if rho is None else (
        "PAQ ranks heads much as their utility does." if rho >= 0.5 else
        "PAQ agrees only loosely with utility." if rho > 0.2 else
        "PAQ does not predict which heads' maps keep the answer here.")
    return "\n".join([
        f"**Head utility** ({u.seconds:.2f} s, rows={u.rows}, scored at {where}): one cut keeps {u.keep} of "
        f"{num_visual} visual tokens; the unpruned first answer token {u.answer_text.strip()!r} has p "
        f"{u.answer_prob:.2f} unpruned.",
        f"- Cuts that keep the answer (it stays the most likely token), of {kept['cuts']}: the best single head "
        f"{kept['best_head']}, the uniform average {kept['uniform']}, the PAQ weighting {kept['paq_weighted']}.",
        f"- Mean p(answer) after the cut: the best head {float(u.values[scored].amax(1).mean()):.2f}, the uniform "
        f"average {float(u.uniform[scored].mean()):.2f}, the PAQ weighting {float(u.paq_weighted[scored].mean()):.2f}.",
        f"- Spearman(PAQ, utility) over the scored heads (PAQ of the unpruned run, every token present): "
        f"**{rho_text}**. {verdict} Within layers (the heads one layer's weighting chooses between; across layers "
        f"utility mostly grows with depth): {_number(entry['spearman_within_layers'])}.",
    ])


def _number(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.2f}"
