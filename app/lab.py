"""The page's head lab, "What if heads differed?" (`hap.plant`, docs/method.md §14): a plan chosen by the user,
labelled on every view of the run it shaped, and what it did, in words and numbers.

A planted run is never shown as the model's own: every figure's title starts with PLANTED_LABEL in red (its
badge), the planted heads are marked on the head-class grid, the answer cards say "planted heads", and
`lab_text` explains the run with its numbers (the classifier's precision / recall on the plan, how much of the
uniform-average and PAQ-fused maps the sink tokens hold, the answers of unpruned, uniform, the paper's HAP and
HAP+ at the chosen budget).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

import hap
from hap import views
from hap.lab.plan import Plan, share_plan

from .lab_pick import MISSED, PLANTED_MARK

PLANTED_LABEL = "PLANTED heads (hap.plant)"
PLANTED_TITLE = f'<b><span style="color:#d62728">{PLANTED_LABEL}</span></b> ·'  # a planted figure's
#                 first title line: its badge, above the panels, so that it neither lengthens nor covers a title
PLOTLY_MARGIN_T, PLOTLY_HEIGHT = 100, 450  # plotly's defaults, for a figure that sets neither
LAB_VIEWS = ("head_classes", "uniform_vs_paq", "kept_masks")  # the lab's results side by side
LAB_WIDTH = 560  # px a side-by-side figure gets in a 1280-px-wide window
NO_PLAN = ("No plan: this run is the model's own heads. Write a plan above (or fill one with the share helper) and "
           "press **Run** to see what planted sink or dispersed heads do to each pruner.")
LAB_INTRO = (
    "## What if heads differed? (head lab)\n"
    "The shipped model grew no sink heads, so its page shows none. Here you can **plant** heads: a planted *sink* "
    "head moves `strength` of its attention onto the sink tokens (visual-token indices; empty: the most redundant "
    "background patch of the image) and reads nothing from them; a planted *dispersed* head spreads `strength` of "
    "its visual attention evenly over the image. The plan applies to every run of the request (the answers, the "
    "maps, the causal section), and every view of it is marked PLANTED. It is an intervention chosen by you, like "
    "editing the image: it never replaces the model's own heads in any other run.\n\n"
    "Pick the plan three ways, all writing the one plan below: **click a head** on the head picker (toggles it as "
    "the kind chosen under *Plant*), **click the image** on the sink-token picker (toggles the visual token under "
    "the click as a sink token; it shows the last run's image on the model's token grid), or fill it from a share "
    "of the heads of some layers (seeded). The plan is the `/analyze` parameter `plant` (JSON: "
    "`{\"sink\": [[layer, head], ...], \"dispersed\": [...], \"sink_tokens\": [...], \"strength\": 0.9}`; empty = "
    "none) and the CLI's `--plant FILE`.")
NO_PLAN = ("No plan: this run is the model's own heads. Click heads on the head picker (or fill the plan with the "
           "share helper) and press **Run with this plan** to see what planted sink or dispersed heads do to each "
           "pruner.")
LAB_DETECTOR = "consensus"  # the lab's runs: the detector that can see a planted sink (the library default: norm)
LAB_DETECTOR_INFO = (
    "The lab's runs use this detector (other runs: the advanced setting, default norm, the paper's). The norm "
    "detector looks for tokens with massive hidden-state norms: a planted sink has one (the plan's massive, the "
    "default), else it never finds a planted sink head and PAQ ranks such a head high (it looks focused). "
    "consensus flags the tokens where many heads of a layer park their attention (docs/method.md §10).")
HEAD_PICKER = ("Head picker (click a head to plant or unplant it; x: sink, o: dispersed; pink: missed by the "
               "classifier; rows: layers, columns: heads)")
TOKEN_PICKER = "Sink-token picker (click a patch to toggle its visual token; red: the sink tokens)"
# The teaching example's plan: sinks in half the heads of the layers scoring the shipped model's cuts, found by the
# attention-consensus detector (LAB_DETECTOR).
TEACHING_PLAN = share_plan((0, 1, 3), 8, 0.5, seed=0)
PLAN_DEPTH = 3  # a plan nests at most this deep: {"sink": [[layer, head], ...], ...}


def read_plan(value) -> Plan:
    """The plan of `/analyze`'s `plant` (a JSON object or its text; `Plan.from_json`), its nesting checked first and
    without recursion, so that a value nested thousands deep is refused naming the field (json and repr would
    recurse into it and fail with a RecursionError)."""
    depth = nesting(value)
    if depth > PLAN_DEPTH:
        raise ValueError(f"plant nests {depth} levels deep; a plan nests at most {PLAN_DEPTH}: "
                         '{"sink": [[layer, head], ...], "dispersed": [...], "sink_tokens": [...], "strength": 0.9}')
    return Plan.from_json(value)


def nesting(value) -> int:
    """How deep `value` nests: a JSON text's brackets (outside its strings) or a Python value's lists, tuples and
    dicts; iterative, so any depth is measured."""
    if isinstance(value, str):
        deepest = depth = 0
        quoted = escaped = False
        for char in value:
            if quoted:
                escaped, quoted = (False, True) if escaped else (char == "\\", char != '"')
            elif char == '"':
                quoted = True
            elif char in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif char in "]}":
                depth -= 1
        return deepest
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def plan_from_share(kind: str, share: float, layers: str, seed: float, strength: float, sink_tokens: str,
                    shape: tuple[int, int]) -> dict:
    """The plan JSON of "plant `kind` heads in `share`% of the heads of layers `layers` ('a-b' or 'a')", drawn with
    `seed`, on a decoder of `shape` = (layers, heads); ValueError naming the field otherwise."""
    depth, heads = shape
    first, _, last = str(layers).partition("-")
    try:
        span = range(int(first), int(last or first) + 1)
    except ValueError as err:
        raise ValueError(f"layers={layers!r} must be 'a-b' or 'a' (layers 0..{depth - 1})") from err
    if not span or span.start < 0 or span.stop > depth:
        raise ValueError(f"layers={layers!r} must lie in 0..{depth - 1}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 100:
        raise ValueError(f"share={share!r} must be a number in [0, 100] (percent)")
    try:
        tokens = [int(t) for t in str(sink_tokens or "").replace(",", " ").split()] or None
    except ValueError as err:
        raise ValueError(f"sink tokens {sink_tokens!r} must be visual-token indices, e.g. '0 11'") from err
    return share_plan(span, heads, share / 100, int(seed or 0), kind, tokens, strength).to_json()


def mark_planted(figures: dict, plan: Plan, classifier: dict | None = None) -> dict:
    """Every figure of a planted run (outputs by name) with PLANTED_TITLE (PLANTED in red) as its title's first line,
    every text prefixed by PLANTED_LABEL; the planted heads marked on the head-class grid (x: sink, o: dispersed),
    black where the classifier found them in their planted class, pink (`app.lab_pick.MISSED`) where it missed them
    (`classifier`: `hap.lab.plan.classifier_report`)."""
    import plotly.graph_objects as go

    marked = {}
    for name, fig in figures.items():
        if not isinstance(fig, go.Figure):  # a text of the section: marked too; nothing drawn: as is
            marked[name] = f"**{PLANTED_LABEL}** · {fig}" if isinstance(fig, str) and fig else fig
            continue
        fig = go.Figure(fig)
        title = f"{PLANTED_TITLE}<br>{fig.layout.title.text or ''}"
        before = fig.layout.margin.t if fig.layout.margin.t is not None else PLOTLY_MARGIN_T
        top = max(before + views.FIGURE_TITLE_LINE_PX,
                  views.FIGURE_TITLE_PAD_PX + (title.count("<br>") + 1) * views.FIGURE_TITLE_LINE_PX + 12)
        fig.update_layout(title=dict(text=title, y=1, yref="container", yanchor="top",
                                     pad=dict(t=views.FIGURE_TITLE_PAD_PX)),
                          margin=dict(t=top), height=(fig.layout.height or PLOTLY_HEIGHT) + top - before)
        if name == "head_classes":
            for trace in planted_traces(plan, classifier):
                fig.add_trace(trace)
        marked[name] = fig
    return marked


def side_by_side(data: views.ViewData, plan: Plan, classifier: dict | None) -> dict:
    """The lab's views of a planted run by name (`LAB_VIEWS`: head classes, uniform vs PAQ, kept tokens), drawn for
    half the page's width and marked planted."""
    return mark_planted(half_width(data), plan, classifier)


def half_width(data: views.ViewData, names: tuple[str, ...] = LAB_VIEWS) -> dict:
    """The views `names` of a run by name, drawn for half the page's width (LAB_WIDTH; titles wrapped to it)."""
    drawn = {}
    for name in names:
        view = views.VIEW[name]
        inputs = view.inputs(data)
        if isinstance(inputs, views.Panels):
            drawn[name] = view.plotly(replace(inputs, width=LAB_WIDTH), view.title_for(data))
        else:
            drawn[name] = view.plotly(inputs, views.wrap_title(view.title_for(data),
                                                               LAB_WIDTH // views.FIGURE_TITLE_CHAR_PX))
    return drawn


def planted_traces(plan: Plan, classifier: dict | None) -> list:
    """The head-class grid's marks of the planted heads: one scatter per (class, found / missed) that has heads."""
    import plotly.graph_objects as go

    traces = []
    for kind, heads, symbol in (("sink", plan.sink, "x"), ("dispersed", plan.dispersed, "circle-open")):
        missed = {tuple(h) for h in (classifier or {}).get(kind, {}).get("missed", ())}
        for outcome, color, chosen in (("found", PLANTED_MARK, [h for h in heads if h not in missed]),
                                       ("missed", MISSED, [h for h in heads if h in missed])):
            if chosen:
                label = f"planted {kind}, {outcome} by the classifier" if classifier else f"planted {kind}"
                traces.append(go.Scatter(x=[h for _, h in chosen], y=[l for l, _ in chosen], mode="markers",
                                         marker=dict(symbol=symbol, size=14, color=color, line=dict(width=2,
                                                                                                    color=color)),
                                         name=label, hovertemplate=f"{label}: layer %{{y}}, head %{{x}}<extra></extra>"))
    return traces


def lab_answers(answers: dict[str, str]) -> str:
    """Markdown: the lab's answers at the chosen budget (unpruned, uniform, the paper's HAP, HAP+), each marked
    planted; NO_PLAN's short form without a plan."""
    if not answers:
        return "#### Answers with the plan\n(no plan: nothing planted)"
    return "#### PLANTED heads · answers at this budget\n" + "\n".join(
        f"- {label}: **{answer or '(empty)'}**" for label, answer in answers.items())


def map_share(scores: np.ndarray, tokens: list[int]) -> float:
    """Share of a token map's total score (`scores [visual]`, NaN for absent tokens) held by `tokens`."""
    values = np.nan_to_num(np.asarray(scores, float))
    total = values.sum()
    return float(values[tokens].sum() / total) if total > 0 else 0.0


def lab_text(report: dict, data: views.ViewData, answers: dict, config: hap.HAPConfig) -> str:
    """Markdown: what the plan did on this run, with its numbers (`report`: `Result.plant`)."""
    tokens = report["sink_tokens_used"] or []
    lines = [f"**PLANTED heads, not the model's own.** {len(report['sink'])} sink heads "
             f"{[tuple(p) for p in report['sink']]}, {len(report['dispersed'])} dispersed heads "
             f"{[tuple(p) for p in report['dispersed']]}, strength {report['strength']}, sink tokens {tokens}"
             + (" (default: the most redundant patch of this image)." if report["sink_tokens"] is None else ".")]
    for kind in ("sink", "dispersed"):
        c = report["classifier"][kind]
        if c["planted"]:
            lines.append(f"- The classifier (sink_detector={config.sink_detector}) classed {len(c['found'])} of the "
                         f"{c['planted']} planted {kind} heads {kind} (recall {_pct(c['recall'])}); of the "
                         f"{c['classified']} heads it classed {kind}, {_pct(c['precision'])} were planted (precision)."
                         + (f" Missed: {[tuple(p) for p in c['missed']]}." if c["missed"] else ""))
    if report["sink"] and config.sink_detector == "norm" and not report.get("massive", True):
        lines.append("- The norm detector (the paper's) flags tokens with massive hidden-state norms; this plan's "
                     "sinks have none (massive: false), so no planted sink can be classed sink, and a head parked on "
                     "one token looks perfectly focused: PAQ ranks it high. Set sink_detector (the lab's, or the "
                     "advanced setting) to consensus or both to find them.")
    if data.groups and tokens:
        g = data.groups[0]
        kept = sorted(set(tokens) & set(g.kept))
        lines.append(f"- At the first cut (layers {list(g.layers)}), the sink tokens hold "
                     f"{map_share(data.group_uniform[0], tokens):.1%} of the uniform-average map and "
                     f"{map_share(data.group_maps[0], tokens):.1%} of the PAQ-fused map; {len(kept)} of "
                     f"{len(tokens)} sink tokens were kept among {len(g.kept)} tokens.")
        if config.diversity > 0 and not kept and report["classifier"]["sink"]["missed"]:
            lines.append(f"- HAP+'s diversity (diversity={config.diversity:g}) keeps detected sink tokens last "
                         "(docs/method.md §10): with none left after the cut, the planted sink heads have nothing to "
                         "park on and run as stock heads, so the classifier, reading this pruned run, cannot class "
                         "them sink. Set diversity to 0 (the relevance top-k) to see them classed.")
    lines.append("- Answers at this budget with the plan: " + "; ".join(f"{k}: **{v or '(empty)'}**"
                                                                        for k, v in answers.items()) + ".")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def lab_configs(config: hap.HAPConfig) -> dict[str, hap.HAPConfig]:
    """The paper's HAP and HAP+ (the page's HAP settings) at `config`'s budget and schedule."""
    schedule = {k: getattr(config, k) for k in ("retain", "flops_ratio", "first_layers", "groups", "decay")}
    return {"HAP (paper)": hap.HAPConfig.paper(**schedule), "HAP+": replace(config, method="hap")}
