"""The text that explains one comparison (`hap.compare`: the stock model, the chosen method and uniform
head averaging at the same budget): `answer_card`, `explanation` and `summary` turn the results into
the app's answer cards, teaching panel and JSON. Nothing here touches a model.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import hap
from hap.compare import Comparison
from hap.fusion import fusion_weights
from hap.views import class_counts, default_layer

LABELS = {"unpruned": "Unpruned", "pruned": "Pruned", "uniform": "Uniform averaging"}

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
"""


def answer_card(label: str, result: hap.Result) -> str:
    """Markdown: the answer with its retained tokens, FLOPs ratio and latency."""
    t = result.timings
    title = f"{LABELS.get(label, label)}" + (f" ({result.method})" if label == "pruned" else "")
    return (
        f"#### {title}\n"
        f"**{result.answer or '(empty answer)'}**\n\n"
        f"{result.retained_tokens:.1f} of {result.num_visual} visual tokens ({result.retain:.1%}, layer average) · "
        f"prefill FLOPs {result.flops_ratio:.1%} · latency {t['prepare_s'] + t['generate_s']:.2f} s "
        f"(prefill {t['prefill_s']:.2f} s, scoring {t['scoring_s']:.3f} s, decode {t['decode_s']:.2f} s)"
        + ("; traced: capturing every layer's attention for the figures adds time" if label == "pruned" else "")
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
            "small models trained briefly often have none."
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
    lines += [f"- Note: {note}." for note in result.notes]
    return "\n".join(lines)


def summary(comparison: Comparison, model: str) -> dict:
    """JSON for API callers: the chosen method's result without its token maps, plus the three answers."""
    data = replace(comparison.pruned, maps=None).to_json()
    del data["maps"]
    data["model"] = model
    data["runs"] = {
        label: {
            "method": r.method,
            "answer": r.answer,
            "retained_tokens": r.retained_tokens,
            "flops_ratio": r.flops_ratio,
            "latency_s": r.timings["prepare_s"] + r.timings["generate_s"],
        }
        for label, r in comparison.items()
    }
    return data
