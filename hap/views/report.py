"""The text that explains one comparison (`hap.runs.compare`: the stock model, the chosen method and uniform
head averaging at the same budget): `answer_card`, `explanation` and `summary` turn the results into
the app's answer cards, teaching panel and JSON, and say what the ground truth, one inspected head and a
budget sweep show. Nothing here touches a model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

import hap
from hap.methods import DEFAULT, UNIFORM
from hap.runs.compare import Comparison
from hap.scoring.fusion import fusion_weights
from hap.views import STATS, Truth, ViewData, class_counts, default_layer

LABELS = {"unpruned": "Unpruned", "pruned": "Pruned", UNIFORM: "Uniform averaging"}

TEACHING = """\
**Why heads differ.** A pruner scores each visual token by the attention the prompt pays it,
and most pruners average that attention over all heads. HAP first measures, per head and per
input, how well the head aligns the prompt with the image:

- **Sink heads** send most of the prompt's attention to a few *sink* tokens (patches with
  massive hidden-state norms) that carry little about the question: high *sink share*.
- **Dispersed heads** spread attention almost evenly over the image: normalised entropy
  (*dispersion*) close to 1, so they cannot tell patches apart.
- **Optimal heads** concentrate on the few regions the prompt asks about.

**PAQ** = (1 - sink share) x (1 - dispersion) is high only for the last kind (see *Head classes*
and *PAQ*). HAP fuses heads with weights softmax(PAQ / T) instead of a plain average, so the
aligned heads decide which tokens survive; layers are then fused per group by their share of the
weights (*Attention maps*). Compare the uniform and PAQ-weighted maps, then the kept tokens of
each group over the image and the three answers.

**Beyond the paper (HAP+, the defaults).** Each cut is scored by the *last* prompt row (the token
that predicts the answer) of the layer just before it, and the dropped tokens are not thrown away:
each is folded into the kept token it most resembles, which then draws the attention of all the
tokens it stands for (*proportional attention*). Set `rows=prompt`, `score_layers=segment` and
`merge=none` under *Advanced settings* to see the paper's HAP.
"""


def latency(result: hap.Result) -> float:
    """Seconds from the image and prompt to the last generated token: the image's encoding where it was shared between
    runs (`vision_s`, counted in each), then the run's own generate call."""
    t = result.timings
    return t["prepare_s"] + t.get("vision_s", 0.0) + t["generate_s"]


LOOP = 3  # a group of one to three words said this many times in a row, to the end, reads as a loop


def shown_answer(text: str) -> str:
    """`text` as the answer cards show it: where it ends in one to three words said again and again to its end (a
    loop run on to the token limit, e.g. "blue purple purple purple ..." under planted heads), cut after their first
    time and marked with how many more times they came; any other text as it is."""
    words = text.split()
    for start in range(len(words)):
        tail = words[start:]
        for period in (1, 2, 3):
            if len(tail) >= LOOP * period and all(w == tail[j % period] for j, w in enumerate(tail)):
                loop = " ".join(tail[:period])
                more = len(tail) // period - 1
                return f'{" ".join(words[:start + period])} … ("{loop}" {more} more times, to the end)'
    return text


def answer_card(label: str, result: hap.Result, tracing: float | None = None) -> str:
    """Markdown: the answer (`shown_answer`) with its retained tokens (layer average), FLOPs ratio and latency, and in
    words what the latency includes: every card's run is untraced (what it costs without the app's figures), the
    shared vision pass counted in each. `tracing`: the seconds of the traced replay the figures come from (the pruned
    card), stated apart, not in the latency."""
    t = result.timings
    title = f"{LABELS.get(label, label)}" + (f" ({result.method})" if label == "pruned" else "")
    together = t.get("decode_batch", 1)
    shared = f" ({together} answers, one batch)" if together > 1 else ""
    vision = f"image {t['vision_s']:.2f} s (one vision pass, in each card) + " if "vision_s" in t else ""
    figures = "" if tracing is None else f" · the figures' traced run {tracing:.2f} s more"
    return (
        f"#### {title}\n"
        f"**{shown_answer(result.answer) or '(empty answer)'}**\n\n"
        f"{result.retained_tokens:.1f} of {result.num_visual} visual tokens ({result.retain:.1%}) · "
        f"prefill FLOPs {result.flops_ratio:.1%} · latency {latency(result):.2f} s without the app's figures: {vision}"
        f"prefill {t['prefill_s']:.2f} s (scoring {t['scoring_s']:.3f} s) + decode {t['decode_s']:.2f} s"
        f"{shared}{figures}"
    )


def explanation(comparison: Comparison) -> str:
    """Markdown: the teaching text followed by what this input shows."""
    result = comparison.pruned
    lines = [TEACHING, "**In this run.**"]
    counts = class_counts(result.head_class)
    layers = sum(1 for row in result.head_class if any(row))
    lines.append(
        f"- {counts['optimal']} optimal, {counts['dispersed']} dispersed and {counts['sink']} sink heads over "
        f"{layers} captured layers (thresholds: sink share >= {result.config['tau_sink']:g}, "
        f"dispersion >= {result.config['tau_disp']:g})."
    )
    sinks = [(l, n) for l, n in enumerate(result.sink_tokens) if n > 0]
    if not sinks:
        lines.append(
            f"- No visual token passed the massive-activation test (hidden-state norm > "
            f"{result.config['sink_rho']:g} x the median) in any captured layer, so no head is classed sink; "
            "small models often grow none (the shipped small model grew none in any of its training tries, "
            "long runs included; its model card lists them)."
        )
    else:
        lines.append("- Sink tokens found: " + ", ".join(f"layer {l}: {n}" for l, n in sinks) + ".")
    layer = default_layer(result.groups, result.paq)
    paq = result.paq[layer]
    if not bool(torch.isnan(paq).all()):
        temperature = result.config["temperature"]
        weights = fusion_weights(paq[None], temperature)[0]  # the head-fusion weights of this layer
        top = int(weights.argmax())
        lines.append(
            f"- Layer {layer}: head {top} has the highest PAQ ({float(paq[top]):.3g}) and gets "
            f"{float(weights[top]):.0%} of the fusion weight at T = {temperature:g} (uniform averaging would give "
            f"each head {1 / result.num_heads:.0%})."
        )
    uniform = {g.index: set(g.kept) for g in comparison.uniform.groups}
    if comparison.uniform is not result:
        for g in result.groups:
            shared = len(set(g.kept) & uniform.get(g.index, set()))
            lines.append(
                f"- Group {g.index} (layers {g.layers[0]}-{g.layers[1] - 1}) keeps {len(g.kept)} tokens; "
                f"{shared} of them are also kept by the uniform-averaging run (whose earlier cuts differ too)."
            )
    cfg = result.config
    if cfg["method"] == DEFAULT:
        rows = {"last": "the last prompt row", "prompt": "every prompt row", "question": "the question's rows"}
        lines.append(f"- Cuts scored by {rows[cfg['rows']]} of "
                     + ("the last layer of each segment" if cfg["score_layers"] == "last" else "every layer of each "
                        "segment") + "; dropped tokens "
                     + ({"none": "discarded.", "average": "folded into their most similar kept token.",
                         "proportional": "folded into their most similar kept token, which draws their attention "
                                         "(proportional attention)."}[cfg["merge"]]))
    lines += [f"- Note: {note}." for note in result.notes]
    return "\n".join(lines)


def summary(comparison: Comparison, timed: dict[str, hap.Result], model: str) -> dict:
    """JSON for API callers: the chosen method's traced result without its token maps, plus the three answers
    with the latencies of the runs they were timed on (`timed`, by label; "traced": the traced run itself, never where
    the method was timed untraced); "timings" are those of the pruned card's run, "tracing_s" the seconds of the traced
    run the figures come from."""
    data = replace(comparison.pruned, maps=None).to_json()
    del data["maps"]
    data["model"] = model
    data["runs"] = {
        label: {"method": r.method, "answer": r.answer, "retained_tokens": r.retained_tokens,
                "flops_ratio": r.flops_ratio, "latency_s": latency(r), "traced": r is comparison.pruned}
        for label, r in timed.items()
    }
    if "pruned" in timed:  # the timings of the run the pruned card reports; the traced one's seconds apart
        data["timings"] = dict(timed["pruned"].timings)
    data["tracing_s"] = comparison.pruned.timings["generate_s"]
    return data


def truth_text(truth: Truth | None, why_not: str) -> str:
    """Markdown: what the scene's ground truth says about the run, or why there is none."""
    if truth is None:
        return f"**Ground truth.** None for this run: {why_not}."
    lines = [f"**Ground truth** for \"{truth.question}\": {int(truth.patches.sum())} answering patches, outlined "
             "on every map."]
    if truth.grounding is None:
        lines.append("- No patch answers it (the prompt alone does): no grounding to compare with PAQ.")
    else:
        rho = "undefined (too few scored heads, or no spread)" if truth.spearman is None else f"{truth.spearman:.2f}"
        lines.append(f"- Spearman rank correlation of PAQ and grounding over the scored heads: {rho}. Grounding is a "
                     "head's share of visual attention on the answering patches divided by their share of the area "
                     "(1: no preference).")
        unknown = [] if truth.cut is None else np.flatnonzero(truth.cut).tolist()
        if unknown:
            lines.append(f"- Grounding unknown (grey) in layer{'s' * (len(unknown) > 1)} "
                         f"{', '.join(map(str, unknown))}: an earlier cut removed every answering patch from their "
                         "input, so there is nothing to measure (not 0).")
    lines += [f"- Group {g}: keeps {'-' if r is None else f'{r:.0%}'} of the answering patches."
              for g, r in enumerate(truth.kept_recall)]
    return "\n".join(lines)


def head_text(data: ViewData, head: int) -> str:
    """Markdown: one head of `data.layer`, its class and statistics (and grounding on a scene)."""
    layer = data.layer
    stats = data.stats[layer, head]
    rows = [f"**Layer {layer}, head {head}: {data.head_class[layer][head] or 'not scored'}**", "",
            "| statistic | value |", "|---|---|"]
    rows += [f"| {name} | {value:.3f} |" for name, value in zip(STATS, stats)]
    if data.truth is not None and data.truth.grounding is not None:
        why = data.truth.unknown(layer)
        rows.append(f"| grounding | {f'unknown: {why}' if why else f'{data.truth.grounding[layer, head]:.3f}'} |")
    if np.isnan(stats).all():
        rows.append("\nThis layer's attention was not captured (no cut was scored with it): no statistics.")
    return "\n".join(rows)


def sweep_title(sweep: dict, model: str) -> str:
    """The sweep plot's title: the model and the unpruned answer every point is compared with."""
    return f"Budget sweep on {model}: unpruned answer \"{sweep['unpruned']['answer'] or '(empty)'}\""
