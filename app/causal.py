"""The page's "Is PAQ right?" section: causal head and token importance (hap.causal) and head utility (hap.utility)
beside PAQ, for every input; then "Static or per-image head weights?": the model's static head importance (measured
once, what HAWK weighs heads by), this image's PAQ weights and, where measured, its head utility, head by head.

`section()` lays it out, `analyze(...)` runs it on the loaded model (the setting `causal`: auto, ablation,
attribution or off) and `outputs(...)` gives its outputs by name (CAUSAL) and the `causal` and `head_utility` JSON
entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gradio as gr
import numpy as np
import torch
from PIL import Image

from hap import HAPConfig, causal, utility, views
from hap.runs.inputs import InputLimits
from hap.patch.decoder import decoder_shape
from hap.runs.run import build_inputs
from hap.scoring import importance
from hap.scoring.fusion import scaled
from hap.views import causal as causal_views

from .settings import resolve

CAUSAL = ("causal_text", "causal_heads", "causal_scatter", "causal_tokens", "utility_text", "utility_heads",
          "utility_scatter", "utility_layers", "heads_text", "heads_weights")
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

HEADS_INTRO = (
    "### Static or per-image head weights?\n"
    "HAP weights each head by its PAQ on *this* image. HAWK (CVPR 2026) weights each head by its importance measured "
    "once per model, by ablation over calibration items (`python -m analysis.head_importance`), the same for every "
    "image; `method=hawk` and `head_weight=static` use it. Below, for the layers that scored this run's cuts, the "
    "same heads under each: the static importance, this image's PAQ weight (softmax(PAQ / T) within the layer) and, "
    "where measured above, this image's head utility."
)
STATIC_HELD_OUT = {  # results/static_heads/benchmark.json (checked by tests/test_static_heads.py)
    "questions": 900, "seeds": "500000:500100", "command": "python -m analysis.benchmark --model assets/tiny-llava "
    "--seeds 500000:500100 --per-scene 9 --methods hawk hap_static hap uniform --retain 0.111 0.056 --accuracy-only "
    "--out results/static_heads",
    "static": {"0.111": 0.856, "0.056": 0.848}, "paq": {"0.111": 0.853, "0.056": 0.839},
    "hawk": {"0.111": 0.508, "0.056": 0.443}, "uniform": {"0.111": 0.761, "0.056": 0.577}, "unpruned": 0.857,
}


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
    gr.Markdown(HEADS_INTRO)
    out["heads_text"] = gr.Markdown("(no run yet)", elem_id="heads-text")
    out["heads_weights"] = gr.Plot(label="Static importance, PAQ weight and utility of the same heads",
                                   elem_id="plot-heads_weights")
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


def outputs(found: Found | None, data: views.ViewData, model_name: str,
            config: HAPConfig) -> tuple[dict[str, object], dict[str, dict]]:
    """(the section's outputs by name, its JSON entries: `causal` and `head_utility` unless off, `head_weights`)."""
    heads, heads_entry = heads_outputs(static_importance(model_name, config), found, data)
    if found is None:
        return {**dict.fromkeys(CAUSAL), "causal_text": OFF, "utility_text": "", **heads}, heads_entry
    shown, report = causal_outputs(found.causal, data)
    if found.choice:
        shown["causal_text"] = f"_{found.choice}_\n\n" + shown["causal_text"]
        report["auto_choice"] = found.choice
    if found.utility is None:
        return ({**shown, **dict.fromkeys(CAUSAL[5:8]), "utility_text": f"**Head utility** not measured: {found.choice}",
                 **heads}, {"causal": report, **heads_entry})
    entry = utility.to_json(found.utility)
    return ({**shown, **utility_outputs(found, entry, data), **heads},
            {"causal": report, "head_utility": entry, **heads_entry})


def static_importance(model_name: str, config: HAPConfig) -> tuple[np.ndarray | None, str]:
    """(the static head importance `[layers, heads]` of `config`'s `head_importance` file or the model folder's, the
    file), or (None, why there is none)."""
    path = config.head_importance or importance.model_file(resolve(model_name))
    if path is None:
        return None, importance.missing("the static weights", model_name)
    try:
        weights = importance.read(path).numpy()
    except ValueError as err:
        return None, str(err)
    return weights, path if config.head_importance else f"{model_name}/{importance.FILE}"


def scored_layers(data: views.ViewData) -> list[int]:
    """The layers whose maps scored the run's cuts (every layer with PAQ where the run made none)."""
    layers = sorted({layer for g in data.groups for layer in g.scored_by})
    return layers or [i for i in range(data.shape[0]) if np.isfinite(data.stats[i, :, 0]).all()]


def paq_weights(data: views.ViewData, layers: list[int]) -> np.ndarray:
    """softmax(PAQ / T) over each of `layers`' heads on this image, `[len(layers), heads]`."""
    paq = torch.from_numpy(np.nan_to_num(data.stats[layers, :, 0], nan=-np.inf)).double()
    return scaled(paq, data.temperature).softmax(-1).numpy()


def heads_outputs(static: tuple[np.ndarray | None, str], found: Found | None,
                  data: views.ViewData) -> tuple[dict[str, object], dict[str, dict]]:
    """(the "Static or per-image head weights?" outputs by name, the `head_weights` JSON entry: the scored layers,
    static importance, PAQ weight, utility where measured, their Spearman correlations)."""
    weights, source = static
    layers = scored_layers(data)
    if weights is None or not layers:
        why = source if weights is None else "no layer scored a cut in this run"
        return {"heads_text": f"**Static or per-image head weights?** Not shown: {why}.", "heads_weights": None}, {}
    if weights.shape[0] != data.shape[0] or weights.shape[1] != data.shape[1]:
        why = f"{source} holds {weights.shape[0]} x {weights.shape[1]} heads, this model {data.shape[0]} x {data.shape[1]}"
        return {"heads_text": f"**Static or per-image head weights?** Not shown: {why}.", "heads_weights": None}, {}
    rows = {"static importance": weights[layers], "PAQ weight (this image)": paq_weights(data, layers)}
    useful = None if found is None or found.utility is None else np.asarray(found.utility.values, float)[layers]
    if useful is not None and np.isfinite(useful).any():
        rows["utility (this image)"] = useful
    names = list(rows)
    rho = {f"{a} ~ {b}": causal.paq_spearman(rows[a], rows[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    entry = {"layers": layers, "source": source, "static": rows[names[0]].tolist(), "paq_weight": rows[names[1]].tolist(),
             "utility": None if len(names) < 3 else rows[names[2]].tolist(), "spearman": rho}
    figure = causal_views.head_weights_plotly(layers, rows, "The same heads: static importance, PAQ weight, utility")
    return {"heads_text": heads_text(layers, source, rho), "heads_weights": figure}, {"head_weights": entry}


def heads_text(layers: list[int], source: str, rho: dict[str, float | None]) -> str:
    """Markdown: the correlations in words, then the held-out comparison of the two weightings inside HAP."""
    def said(value: float | None) -> str:
        if value is None:
            return "undefined (a constant side)"
        if abs(value) <= 0.2:
            return f"{value:+.2f}: no relation to speak of"
        strength = "strongly" if abs(value) >= 0.5 else "loosely"
        return f"{value:+.2f}: they {'agree' if value > 0 else 'disagree'} {strength}"

    lines = [f"**Static or per-image head weights?** Layers {', '.join(map(str, layers))} (those that scored the "
             f"cuts); static importance from `{source}`. Spearman rank correlations over these heads:"]
    lines += [f"- {pair}: {said(value)}." for pair, value in rho.items()]
    lines.append(held_out_line(STATIC_HELD_OUT))
    return "\n".join(lines)


def held_out_line(h: dict) -> str:
    """The held-out comparison of static and PAQ weighting in HAP's pipeline, HAWK and uniform averaging, in words."""
    cells = "; ".join(f"at {float(r):.1%} of the tokens static {h['static'][r]:.1%}, PAQ {h['paq'][r]:.1%}, HAWK "
                      f"{h['hawk'][r]:.1%}, uniform {h['uniform'][r]:.1%}" for r in h["static"])
    gaps = [100 * (h["paq"][r] - h["static"][r]) for r in h["static"]]
    if all(abs(g) < 1 for g in gaps):
        verdict = "per-image PAQ weighting and static weights are level within a point here"
    else:
        ahead = "PAQ" if sum(gaps) > 0 else "static weights"
        verdict = f"{ahead} ahead by {', '.join(f'{abs(g):.1f}' for g in gaps)} points"
    return (f"- **Held-out** ({h['questions']} questions, seeds {h['seeds']}, unpruned {h['unpruned']:.1%}), accuracy "
            f"of HAP's pipeline with each weighting beside HAWK's rule and uniform averaging: {cells}. On the shipped "
            f"model {verdict}; what only per-image weights can follow is a head that behaves differently on one "
            f"image (the head lab's last lesson step). `{h['command']}`")


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
