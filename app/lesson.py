"""The guided lesson above the head lab: four steps, one click each, on a scene asked its own question (its ground
truth: the answering patches), at a budget where a few sink tokens compete with the object for the kept slots. Each
step is one `/analyze` run with the step's plan (`STEPS`, a small table) and the paper's HAP settings, and says what
that run did with its own numbers (`Numbers`, read from the run; the texts hold no fixed number):

1. the model's own heads;
2. sinks planted in half the heads of the layers scoring the first cut, parked on the most redundant patches, which
   carry a massive activation: what uniform head averaging keeps;
3. the same plan: what the classifier (the paper's norm test) finds, how PAQ weighting treats the sink heads, what
   HAP keeps;
4. dispersed heads planted instead;
5. static or adaptive: the sink plan again, HAP's heads weighted by the model's static head importance (measured once,
   with nothing planted: `head_weight="static"`) instead of this image's PAQ.

The scene was chosen on validation scenes (held-out seeds 400000-400029, their colour and shape questions;
`python -m app.lesson` reruns the choice): on the first shipped scene uniform averaging and HAP both lose the object
under the plan. `validate` prints, per scene, the answers and the answering patches each keeps at the first cut;
the lesson's scene is the one where uniform averaging's answer changed under the plan and HAP's did not, shipped as
assets/examples/lesson_400009.png (`analysis.scenes.save_scene`, its question in the metadata; not among the page's
examples).

One scene is one case, so each step also quotes the held-out figure for the same comparison (`HeldOut`; the last
step's `StaticHeldOut`: static against PAQ weighting and HAWK): accuracy
at RETAIN of the paper's HAP, uniform averaging and HAP+ over 120 held-out questions with the same kind of plan, from
a committed `analysis.heterogeneity` run (numbers quoted here, with the command, and checked against the committed
JSON by tests/test_lesson.py: results/ does not ship to a Space); where the scene goes the other way, the text says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from hap import views
from hap.knobs import KNOBS, knob
from hap.lab.plan import Plan, share_plan
from hap.scoring.fusion import fusion_weights
from hap.views.report import shown_answer

from .settings import EXAMPLES

SCENE = "lesson_400009.png"  # validation scene 400009 and its question (module docstring)
VALIDATION = range(400_000, 400_030)  # the held-out seeds the scene and plan were checked on
KINDS = ("color", "shape")  # their questions: one object answers each
RETAIN = 0.056  # visual tokens kept, layer average: few slots, so sink tokens and the object compete for them
SINK_TOKENS = 4  # sink tokens per image: the most redundant background patches (`hap.lab.plan.redundant_tokens`)
SINK_DETECTOR = "norm"  # the paper's: a massive planted sink token has the norm it looks for
SINKS = share_plan((0, 1), 8, 0.5, seed=0, sink_tokens=SINK_TOKENS)  # half the heads of the layers scoring cut 1
DISPERSED = share_plan((0, 1), 8, 0.5, seed=0, kind="dispersed")
ANSWERS = {"unpruned": "unpruned", "uniform": "uniform averaging", "pruned": "HAP (the paper's)"}
INTRO = ("## Guided lesson: what sink heads do to pruning\n"
         "Five steps on one scene asked its own question (its answering patches outlined on every map; chosen on "
         "validation scenes, docs/app.md), at "
         f"a budget of {RETAIN:.1%} of the visual tokens, with the paper's HAP settings. Each button runs one step "
         "on the shipped model; the text under it is written from that run's numbers, then gives the held-out "
         "figure for the same comparison: one scene is one case, the held-out questions the rule.")


@dataclass(frozen=True)
class Numbers:
    """What one step's run did, read from its outputs (`of`)."""

    question: str
    truth: str  # the scene's answer
    strength: float  # the plan's (0 without one)
    layers: list[int]  # the layers holding planted heads
    answers: dict[str, str]  # ANSWERS' labels -> answer
    classes: dict[str, int]  # head class -> heads
    classifier: dict | None  # the plan's `classifier_report` (None: nothing planted)
    kept: int  # tokens kept at the first cut
    visual: int
    first_cut: int  # its first layer
    sink_tokens: list[int]  # the planted sink tokens ([] without sinks)
    answering: int  # answering patches
    uniform_sinks: int  # sink tokens among the uniform average's top `kept` at the first cut
    uniform_answering: int  # answering patches among them
    paq_sinks: int  # sink tokens among HAP's kept tokens at the first cut (the PAQ-weighted map's top `kept`)
    paq_answering: int
    uniform_share: float  # share of the uniform-average map on the sink tokens
    paq_share: float  # share of the PAQ-weighted map on them
    planted_weight: float | None = None  # share of the first cut's head weights (as the run fused) on planted sink heads
    planted_paq: float | None = None  # share of softmax(PAQ / T) over the same heads on them (None: no sink planted)

    @classmethod
    def of(cls, outputs: dict) -> Numbers:
        """The numbers of an `/analyze` run (`Handler.analyze`'s outputs by name) on a scene with its ground truth."""
        from .lab import map_share

        data: views.ViewData = outputs["state"]
        summary = outputs["summary"]
        plant = summary.get("plant")
        group = data.groups[0]
        uniform = views.top_k(data.group_uniform[0], len(group.kept))
        paq = set(group.kept)
        sinks = set((plant or {}).get("sink_tokens_used") or []) if plant and plant["sink"] else set()
        answering = set(np.flatnonzero(data.truth.patches).tolist()) if data.truth is not None else set()
        return cls(data.truth.question if data.truth else "", scene()["answer"], (plant or {}).get("strength", 0.0),
                   sorted({layer for layer, _ in (plant or {}).get("sink", []) + (plant or {}).get("dispersed", [])}),
                   {label: summary["runs"][key]["answer"] for key, label in ANSWERS.items()},
                   views.class_counts(data.head_class), plant and plant["classifier"], len(group.kept), data.shape[2],
                   group.layers[0], sorted(sinks), len(answering), len(uniform & sinks), len(uniform & answering),
                   len(paq & sinks), len(paq & answering), map_share(data.group_uniform[0], sorted(sinks)),
                   map_share(data.group_maps[0], sorted(sinks)),
                   *planted_shares(group, (plant or {}).get("sink", []), data.temperature))

    def answers_line(self) -> str:
        """The answers as the answer cards show them (`hap.views.report.shown_answer`: a loop cut and marked), and the
        scene's."""
        return "; ".join(f"{label}: **{shown_answer(answer) or '(empty answer)'}**"
                         for label, answer in self.answers.items()) + f" (the scene's answer: **{self.truth}**)"

    def right(self, label: str) -> bool:
        """Whether the answer of `label` (of ANSWERS') starts with the scene's answer, as `validate` scores it."""
        return (self.answers[label].split() or [""])[0].lower() == self.truth.lower()

    def first_cut_objects(self) -> str:
        """What the first cut keeps of the answering patches, uniform averaging's top k against HAP's."""
        return (f"uniform averaging's top {self.kept} hold {self.uniform_answering} and HAP's {self.paq_answering} of "
                f"the {self.answering} answering patches")

    def layer_list(self) -> str:
        return ", ".join(map(str, self.layers))

    def keeps(self, sinks: int, answering: int) -> str:
        return (f"{sinks} of the {len(self.sink_tokens)} sink tokens and {answering} of the {self.answering} "
                "answering patches")


def planted_shares(group, planted: list, temperature: float) -> tuple[float | None, float | None]:
    """(share of `group`'s head weights, share of softmax(PAQ / T) over its scoring heads) on the `planted` [[layer,
    head], ...] heads among them; (None, None) where none of them scores the cut."""
    mask = np.zeros(np.shape(group.weights), dtype=bool)
    for layer, head in planted:
        if layer in group.scored_by:
            mask[group.scored_by.index(layer), head] = True
    if not mask.any():
        return None, None
    paq = fusion_weights(torch.tensor(group.paq, dtype=torch.float32)[None], temperature)[0].numpy()
    return float(np.asarray(group.weights)[mask].sum()), float(paq[mask].sum())


def own_text(n: Numbers) -> str:
    return (f"**Step 1 · the model's own heads.** Nothing planted: the model's own heads classed "
            f"{', '.join(f'{c} {k}' for k, c in n.classes.items())}. At the first cut (layer {n.first_cut}) "
            f"{n.kept} of {n.visual} tokens are kept; {n.first_cut_objects()}.")


def uniform_text(n: Numbers) -> str:
    return (f"**Step 2 · sinks planted, uniform averaging.** {n.classifier['sink']['planted']} sink heads are planted "
            f"(layers {n.layer_list()}; PLANTED on every view): they park {n.strength:.0%} of their "
            f"attention on the sink tokens {n.sink_tokens}, which carry a massive activation as real sink tokens do. "
            f"Uniform averaging counts that parked attention as importance: the sink tokens hold {n.uniform_share:.0%} "
            f"of its map at the first cut, and its top {n.kept} tokens there take "
            f"{n.keeps(n.uniform_sinks, n.uniform_answering)}.")


def paq_text(n: Numbers) -> str:
    sink = n.classifier["sink"]
    precision = "-" if sink["precision"] is None else f"{sink['precision']:.0%}"
    more = n.paq_answering - n.uniform_answering
    verdict = (f"On this run HAP keeps {more} more answering patch{'es' * (more > 1)} than uniform averaging." if more > 0 else
               "On this run HAP keeps no more of the answering patches than uniform averaging." if more == 0 else
               f"On this run HAP keeps {-more} fewer answering patch{'es' * (more < -1)} than uniform averaging.")
    return (f"**Step 3 · the classifier and PAQ.** The same plan. The paper's norm test "
            f"(sink_detector={SINK_DETECTOR}) classed {len(sink['found'])} of the {sink['planted']} planted sink heads "
            f"sink (precision {precision}); PAQ = (1 - sink share) x (1 - dispersion) weights them down: the sink "
            f"tokens hold {n.paq_share:.0%} of the PAQ-weighted map (uniform: {n.uniform_share:.0%}). The massive "
            f"activation also draws the other heads' attention, so the sink tokens can still rank high. At the first "
            f"cut HAP keeps "
            f"{n.keeps(n.paq_sinks, n.paq_answering)}; uniform averaging "
            f"{n.keeps(n.uniform_sinks, n.uniform_answering)}. {verdict}")


def dispersed_text(n: Numbers) -> str:
    spread = n.classifier["dispersed"]
    return (f"**Step 4 · dispersed heads.** Instead of sinks, {spread['planted']} heads (layers {n.layer_list()}) "
            f"spread {n.strength:.0%} of their visual attention evenly over the image. The classifier classed "
            f"{len(spread['found'])} of them dispersed; a flat map tells no patch from another, and PAQ weights such a "
            f"head down. At the first cut {n.first_cut_objects()}.")


def static_text(n: Numbers) -> str:
    return (f"**Step 5 · Static or adaptive?** The same sink plan, now with HAP's heads weighted by the model's "
            f"static head importance (head_weight=static), measured once by ablation on validation scenes with "
            f"nothing planted, as HAWK weighs heads, instead of this image's PAQ. The planted sink heads hold "
            f"{n.planted_weight:.0%} of the static weights at the first cut (the calibration never saw them park "
            f"their attention) against {n.planted_paq:.0%} of this image's PAQ weights. At the first cut the static "
            f"weighting keeps {n.keeps(n.paq_sinks, n.paq_answering)}; uniform averaging "
            f"{n.keeps(n.uniform_sinks, n.uniform_answering)}.")


HELD_OUT_COMMAND = ("python -m analysis.heterogeneity --seeds 500000:500060 --per-scene 2 --kinds sink "
                    "--sink-tokens 4 --retain 0.111 0.056 --methods hap uniform hap_paper --diversity 0.25 "
                    "--out results/diversity/sink_lab/w0.25")


@dataclass(frozen=True)
class HeldOut:
    """The held-out figure of a step's comparison: accuracy at RETAIN over held-out questions with the same kind of
    plan (`plan`: in `share` of the heads of the layers scoring HAP's cuts), quoted from the committed run `source`
    (its entry `kind` / `share`) that `command` reproduces."""

    plan: str  # in words ("nothing planted" where `share` is 0)
    source: str
    kind: str  # the run's plan kind: "sink_4" (4 massive sink tokens per image) or "dispersed"
    share: float  # of the scoring layers' heads planted
    command: str
    unpruned: float  # with the plan
    paper: float  # the paper's HAP (`hap_paper`)
    uniform: float
    plus: float  # HAP+ (`hap`) with `diversity`
    diversity: float
    questions: int = 120
    seeds: str = "500000:500060"
    layers: tuple[int, ...] = (0, 1, 3)  # the scoring layers the plan plants in

    def text(self, n: Numbers) -> str:
        """The held-out figure, then whether the scene `n` goes the same way (the paper's HAP against uniform)."""
        default = knob("diversity").default
        now = "" if self.diversity == default else f"; the library's default is now {default:g}"
        plan = (f"{self.share:.0%} of the heads of the layers scoring HAP's cuts ({', '.join(map(str, self.layers))}) "
                f"planted as {self.plan}") if self.share else self.plan
        line = (f"**Held-out:** over {self.questions} held-out questions (seeds {self.seeds}) with the same kind of "
                f"plan ({plan}), at retain {RETAIN:.1%} the paper's HAP answers {self.paper:.1%} right, uniform "
                f"averaging {self.uniform:.1%}, HAP+ (diversity {self.diversity:g}{now}) {self.plus:.1%}; unpruned "
                f"{'with the plan ' if self.share else ''}{self.unpruned:.1%}.")
        return f"{line} {self.verdict(n)} From {self.source}, written by `{self.command}`."

    def verdict(self, n: Numbers) -> str:
        """Whether the scene's answers go the way the held-out figure does: the paper's HAP against uniform averaging."""
        paper, uniform = n.right(ANSWERS["pruned"]), n.right(ANSWERS["uniform"])
        gap = abs(self.paper - self.uniform) * 100
        rule = (f"the paper's HAP answers {gap:.1f} points {'below' if self.paper < self.uniform else 'above'} "
                "uniform averaging" if self.paper != self.uniform else "the two answer alike")
        if paper == uniform:
            return (f"On this scene both answer {'right' if paper else 'wrong'}, so the scene cannot tell them apart; "
                    f"over the held-out questions {rule}.")
        if (paper > uniform) == (self.paper > self.uniform):
            return f"The scene goes the way of the held-out figure: {rule}."
        won = "the paper's HAP answers right and uniform averaging does not" if paper else \
            "uniform averaging answers right and the paper's HAP does not"
        return (f"**The scene and the held-out figure disagree:** on this scene {won}, while over the held-out "
                f"questions {rule}. The scene is one case, not the rule.")


SINKS_SOURCE = "results/diversity/sink_lab/w0.25/heterogeneity.json"
HELD_OUT = {  # by step kind; checked against the committed JSON by tests/test_lesson.py
    "own": HeldOut("nothing planted", SINKS_SOURCE, "sink_4", 0.0, HELD_OUT_COMMAND,
                   unpruned=0.858, paper=0.433, uniform=0.625, plus=0.833, diversity=0.25),
    "sinks": HeldOut("sink heads parked on 4 massive sink tokens per image, strength 0.9", SINKS_SOURCE, "sink_4", 0.5,
                     HELD_OUT_COMMAND, unpruned=0.558, paper=0.183, uniform=0.325, plus=0.833, diversity=0.25),
    "dispersed": HeldOut("dispersed heads, strength 0.9", "results/heterogeneity/heterogeneity.json", "dispersed", 0.5,
                         "python -m analysis.heterogeneity --seeds 500000:500060 --per-scene 2 --out "
                         "results/heterogeneity", unpruned=0.858, paper=0.500, uniform=0.617, plus=0.750,
                         diversity=0.0),
}


STATIC_SOURCE = "results/static_heads/lab_paper/heterogeneity.json"
STATIC_COMMAND = ("python -m analysis.heterogeneity --seeds 500000:500060 --per-scene 2 --kinds sink --sink-tokens 4 "
                  "--retain 0.111 0.056 --methods hawk hap_static hap uniform --rows prompt --score-layers segment "
                  "--merge none --diversity 0 --out results/static_heads/lab_paper")


@dataclass(frozen=True)
class StaticHeldOut:
    """The held-out figure of the last step: accuracy at RETAIN over held-out questions with the sink plan, of HAP
    with static head weights and with PAQ weights (the lesson's settings: the paper's HAP), HAWK and uniform averaging,
    quoted from the committed run `source` that `command` reproduces (tests/test_lesson.py checks them)."""

    static: float
    paq: float
    hawk: float
    uniform: float
    unpruned: float  # with the plan
    share: float = 0.5
    kind: str = "sink_4"
    source: str = STATIC_SOURCE
    command: str = STATIC_COMMAND
    questions: int = 120
    seeds: str = "500000:500060"
    layers: tuple[int, ...] = (0, 1, 2, 3)  # the layers scoring the paper's HAP's cuts there: the plan's layers

    def text(self, n: Numbers) -> str:
        """The held-out figure, then the scene's static answer beside it."""
        better = "above" if self.paq > self.static else "below" if self.paq < self.static else "level with"
        plan = (f"{self.share:.0%} of the heads of the layers scoring the paper's HAP's cuts "
                f"({', '.join(map(str, self.layers))}) planted as sink heads on 4 massive sink tokens per image")
        line = (f"**Held-out:** over {self.questions} held-out questions (seeds {self.seeds}) with the same kind of "
                f"plan ({plan}), at retain {RETAIN:.1%}, HAP with static head weights answers {self.static:.1%} right, with this image's "
                f"PAQ {self.paq:.1%} ({better} static), uniform averaging {self.uniform:.1%}, HAWK {self.hawk:.1%} "
                f"(HAWK reads layer 0's logits, which a plant does not change: it meets the planted heads as the stock "
                f"ones, so its figure is not a test of them); unpruned with the plan {self.unpruned:.1%}.")
        return f"{line} {self.verdict(n)} From {self.source}, written by `{self.command}`."

    def verdict(self, n: Numbers) -> str:
        """Whether the scene's static answer is right."""
        return (f"On this scene HAP with static weights answers {'right' if n.right(ANSWERS['pruned']) else 'wrong'} "
                f"(the card \"{ANSWERS['pruned']}\" above runs with head_weight=static).")


class Quoted(Protocol):
    """A step's held-out figure: its text on a run's numbers, and the scene's verdict alone."""

    def text(self, n: Numbers) -> str: ...

    def verdict(self, n: Numbers) -> str: ...


@dataclass(frozen=True)
class Step:
    """One step of the lesson: its button, its plan, the views it shows (of `app.lab.LAB_VIEWS`), its text and the
    knobs it sets beyond the paper's HAP settings."""

    button: str
    plan: Plan
    views: tuple[str, ...]
    text: Callable[[Numbers], str]
    held_out: Quoted
    knobs: dict = field(default_factory=dict)

    def say(self, numbers: Numbers) -> str:
        """The step's text on a run, the run's answers, then the held-out figure for the same comparison."""
        return f"{self.text(numbers)}\n\n- Answers: {numbers.answers_line()}.\n\n{self.held_out.text(numbers)}"


STEPS = (
    Step("1 · The model's own heads", Plan(), ("head_classes", "uniform_vs_paq"), own_text, HELD_OUT["own"]),
    Step("2 · Plant sinks: uniform averaging", SINKS, ("uniform_vs_paq", "kept_masks"), uniform_text,
         HELD_OUT["sinks"]),
    Step("3 · The classifier, PAQ and HAP", SINKS, ("head_classes", "uniform_vs_paq", "kept_masks"), paq_text,
         HELD_OUT["sinks"]),
    Step("4 · Dispersed heads", DISPERSED, ("head_classes", "uniform_vs_paq"), dispersed_text, HELD_OUT["dispersed"]),
    Step("5 · Static or adaptive?", SINKS, ("uniform_vs_paq", "kept_masks"), static_text,
         StaticHeldOut(static=0.208, paq=0.225, hawk=0.458, uniform=0.250, unpruned=0.575), {"head_weight": "static"}),
)


def scene() -> dict:
    """The lesson's scene: its question as its metadata holds it (text, answer, kind, answering patches)."""
    from hap.views.ground_truth import file_metadata

    return file_metadata(EXAMPLES / SCENE)["question"]


def request(model_name: str, step: Step) -> dict:
    """The `Handler.analyze` arguments of a step: the scene, its question, the model, the paper's HAP settings at
    RETAIN with SINK_DETECTOR, the step's plan, no causal section."""
    from .settings import knob_defaults

    knobs = {**knob_defaults(model_name), **{k.name: k.paper for k in KNOBS if k.paper is not None},
             "retain": RETAIN, "flops_ratio": None, "sink_detector": SINK_DETECTOR, **step.knobs}
    from .uploads import file_data

    return dict(image=file_data(EXAMPLES / SCENE), prompt=scene()["text"], model_name=model_name, causal="off",
                plant=json.dumps(step.plan.to_json()) if not step.plan.empty else "", **knobs)


def validate(seeds: range = VALIDATION, model_name: str = "assets/tiny-llava") -> list[dict]:
    """The lesson's plan on held-out scenes (`seeds`, one colour or shape question each): per scene the stock and
    planted answers of unpruned, uniform averaging and the paper's HAP at RETAIN, and the answering patches each
    keeps at the first cut (uniform: its map's top k). Prints a line per scene and the totals."""
    import hap
    from analysis.scenes import heldout_items

    from .settings import resolve

    model, processor = hap.load_model(resolve(model_name))
    paper = hap.HAPConfig.paper(retain=RETAIN, sink_detector=SINK_DETECTOR)
    configs = {"unpruned": hap.HAPConfig(method="none"), "uniform": replace(paper, method="uniform")}
    rows = []
    for scene_, question in heldout_items(seeds, 1, KINDS):
        def answer(config):
            words = hap.run(model, processor, scene_.image, question.text, config, max_new_tokens=3).answer.split()
            return (words or [""])[0].lower()

        row = {"seed": scene_.seed, "question": question.text, "answer": question.answer,
               "stock": {label: answer(c) for label, c in {**configs, "hap": paper}.items()}}
        with hap.plant(model, SINKS.sink, (), SINKS.sink_tokens, SINKS.strength, SINKS.massive):
            row["planted"] = {label: answer(c) for label, c in configs.items()}
            traced = hap.run(model, processor, scene_.image, question.text, paper, max_new_tokens=3, trace=True)
        row["planted"]["hap"] = (traced.answer.split() or [""])[0].lower()
        group, answering = traced.groups[0], set(np.flatnonzero(question.target_mask).tolist())
        uniform = views.top_k(np.asarray(traced.maps.group_uniform[0], float), len(group.kept))
        row["answering"] = {"patches": len(answering), "uniform": len(uniform & answering),
                            "hap": len(set(group.kept) & answering)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    right = {label: sum(r["planted"][label] == r["answer"] for r in rows) for label in ("unpruned", "uniform", "hap")}
    print(f"{len(rows)} questions; right with the plan: {right}")
    return rows


if __name__ == "__main__":
    validate()
