"""The guided lesson (`app.lesson`): its table of steps, texts written from a run's numbers, and every step run on the
shipped model with its text checked against that run (about 6 s a step on a CPU); the held-out figures each step
quotes checked against the committed runs they come from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from app_model import ROOT, default_model

from app import lesson
from app.lab import map_share
from app.present import CARDS
from hap import views

FAKE = lesson.Numbers(
    question="what color is the square ?", truth="yellow", strength=0.75, layers=[2, 3],
    answers={"unpruned": "yellow", "uniform averaging": "red", "HAP (the paper's)": "yellow"},
    classes={"sink": 7, "dispersed": 2, "optimal": 39},
    classifier={"sink": {"planted": 8, "found": [[0, 1]] * 7, "precision": 0.875},
                "dispersed": {"planted": 8, "found": [[0, 2]] * 5}},
    kept=13, visual=144, first_cut=0, sink_tokens=[9, 16, 66, 103], answering=4, uniform_sinks=3,
    uniform_answering=1, paq_sinks=0, paq_answering=4, uniform_share=0.49, paq_share=0.13, planted_weight=0.31,
    planted_paq=0.04)


def test_the_steps_are_a_small_table_and_each_text_says_its_numbers():
    assert [s.plan.empty for s in lesson.STEPS] == [True, False, False, False, False]
    assert lesson.STEPS[1].plan == lesson.STEPS[2].plan == lesson.STEPS[4].plan == lesson.SINKS
    assert lesson.STEPS[3].plan == lesson.DISPERSED
    assert [s.knobs for s in lesson.STEPS] == [{}] * 4 + [{"head_weight": "static"}]
    assert lesson.SINKS.sink_tokens == lesson.SINK_TOKENS and lesson.SINKS.massive
    texts = [step.say(FAKE) for step in lesson.STEPS]
    assert all("unpruned: **yellow**; uniform averaging: **red**" in t for t in texts)
    assert "0 sink, 2 dispersed" not in texts[0] and "7 sink, 2 dispersed, 39 optimal" in texts[0]
    assert "13 of 144 tokens" in texts[0] and "hold 1 and HAP's 4 of the 4 answering patches" in texts[0]
    assert "49% of its map" in texts[1] and "3 of the 4 sink tokens and 1 of the 4 answering patches" in texts[1]
    assert "(layers 2, 3; PLANTED on every view): they park 75% of their attention" in texts[1]
    assert "classed 7 of the 8 planted sink heads sink (precision 88%)" in texts[2]
    assert "13% of the PAQ-weighted map (uniform: 49%)" in texts[2]
    assert "On this run HAP keeps 3 more answering patches than uniform averaging" in texts[2]
    assert "classed 5 of them dispersed" in texts[3] and "heads (layers 2, 3) spread 75%" in texts[3]
    assert "planted sink heads hold 31% of the static weights" in texts[4] and "4% of this image's PAQ" in texts[4]
    assert "static weighting keeps 0 of the 4 sink tokens and 4 of the 4 answering patches" in texts[4]


def test_each_step_quotes_its_held_out_figure_and_says_where_the_scene_disagrees():
    texts = [step.say(FAKE) for step in lesson.STEPS[:4]]  # FAKE: the paper's HAP right, uniform averaging wrong
    for step, text in zip(lesson.STEPS, texts):
        held = step.held_out
        assert "**Held-out:** over 120 held-out questions" in text and held.command in text
        assert all(f"{v:.1%}" in text for v in (held.paper, held.uniform, held.plus, held.unpruned))
        assert held.paper < held.uniform  # the committed runs: below uniform at 5.6% with each plan
        assert "The scene and the held-out figure disagree" in text
    assert "the library's default is now 0.25" in texts[3] and "default is now" not in texts[2]
    both = lesson.Numbers(**{**FAKE.__dict__, "answers": {**FAKE.answers, "uniform averaging": "yellow"}})
    assert "so the scene cannot tell them apart" in lesson.STEPS[1].say(both)
    against = lesson.Numbers(**{**FAKE.__dict__, "answers": {**both.answers, "HAP (the paper's)": "red"}})
    assert "The scene goes the way of the held-out figure" in lesson.STEPS[1].say(against)


@pytest.mark.parametrize("name", sorted(lesson.HELD_OUT))
def test_the_held_out_figures_are_the_committed_runs(name):
    import json

    held = lesson.HELD_OUT[name]
    run = json.loads((ROOT / held.source).read_text())
    accuracy, retain = run["accuracy"][held.kind][str(held.share)], str(lesson.RETAIN)
    quoted = {"hap_paper": held.paper, "uniform": held.uniform, "hap": held.plus}
    assert all(accuracy[m][retain] == pytest.approx(v, abs=5e-4) for m, v in quoted.items()), (accuracy, quoted)
    assert run["unpruned"][held.kind][str(held.share)] == pytest.approx(held.unpruned, abs=5e-4)
    assert run["config"].get("diversity", 0.0) == held.diversity and run["n_questions"] == held.questions
    assert run["seeds"] == held.seeds and tuple(run["scoring_layers"]) == held.layers and run["strength"] == 0.9
    assert f"--out {str(Path(held.source).parent)}" in held.command and run["massive"]


def test_the_static_step_quotes_the_committed_lab_run():
    """Step 5's held-out figure: HAP with static weights, with PAQ, HAWK and uniform averaging under the same sink
    plan, at the lesson's settings (the paper's HAP), from the committed run its command writes."""
    import json

    held = lesson.STEPS[4].held_out
    run = json.loads((ROOT / held.source).read_text())
    accuracy, retain = run["accuracy"][held.kind][str(held.share)], str(lesson.RETAIN)
    quoted = {"hap_static": held.static, "hap": held.paq, "hawk": held.hawk, "uniform": held.uniform}
    assert all(accuracy[m][retain] == pytest.approx(v, abs=5e-4) for m, v in quoted.items()), (accuracy, quoted)
    assert run["unpruned"][held.kind][str(held.share)] == pytest.approx(held.unpruned, abs=5e-4)
    paper = {k.name: k.paper for k in lesson.KNOBS if k.paper is not None and k.name not in ("method", "sink_detector")}
    assert {k: run["config"][k] for k in paper} == paper  # the lesson's settings: the paper's HAP
    assert run["seeds"] == held.seeds and run["n_questions"] == held.questions and run["massive"]
    assert tuple(run["scoring_layers"]) == held.layers and run["sink_tokens"] == [lesson.SINK_TOKENS]
    assert f"--out {str(Path(held.source).parent)}" in held.command
    text = lesson.STEPS[4].say(FAKE)
    assert all(f"{v:.1%}" in text for v in quoted.values()) and held.command in text


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from app.handler import Handler
    from app.settings import Settings

    name = default_model(tmp_path_factory.mktemp("tiny-llava"))
    return Handler(Settings(models=[name])), name


@pytest.mark.parametrize("index", range(len(lesson.STEPS)))
def test_each_step_runs_on_the_shipped_model_and_its_text_is_that_runs(server, index):
    handler, name = server
    step = lesson.STEPS[index]
    out = handler.analyze(**lesson.request(name, step))
    numbers = lesson.Numbers.of(out)
    data, summary = out["state"], out["summary"]
    group = data.groups[0]
    assert data.truth is not None and numbers.truth == lesson.scene()["answer"]  # the scene's ground truth
    assert numbers.kept == len(group.kept) and numbers.answering == int(data.truth.patches.sum())
    answering = set(np.flatnonzero(data.truth.patches).tolist())
    assert numbers.paq_answering == len(set(group.kept) & answering)
    assert numbers.uniform_answering == len(views.top_k(data.group_uniform[0], len(group.kept)) & answering)
    assert summary["runs"]["pruned"]["method"] == "hap" and summary["config"]["sink_detector"] == "norm"
    if step.plan.sink:
        assert numbers.sink_tokens == sorted(summary["plant"]["sink_tokens_used"])
        assert len(numbers.sink_tokens) == lesson.SINK_TOKENS
        assert numbers.uniform_share == map_share(data.group_uniform[0], numbers.sink_tokens)
    text = handler.lesson_step(index, name)["lesson_text"]
    assert text == step.say(numbers)
    if not step.plan.empty:
        assert numbers.strength == step.plan.strength and numbers.layers == step.plan.layers
    shown = {card: out[card].splitlines()[1] for card in CARDS}  # "**answer**": the answer as its card shows it
    for key, label in lesson.ANSWERS.items():
        assert f"{label}: {shown[key]}" in text, (label, shown[key])
    assert "**Held-out:**" in text and step.held_out.verdict(numbers) in text


def test_an_answer_looping_to_the_token_limit_is_cut_and_marked_as_the_cards_show_it():
    """Under planted heads an answer may loop to the token limit ("blue purple purple ..."): the lesson shows it as the
    answer cards do (`hap.views.report.shown_answer`), cut after the loop's first time and marked; others unchanged."""
    from hap.views.report import shown_answer

    looped = "blue " + " ".join(["purple"] * 31)
    numbers = lesson.Numbers(**{**FAKE.__dict__, "answers": {**FAKE.answers, "uniform averaging": looped}})
    assert "uniform averaging: **blue purple … (\"purple\" 30 more times, to the end)**" in numbers.answers_line()
    assert "unpruned: **yellow**" in numbers.answers_line() and looped not in numbers.answers_line()
    assert shown_answer("a b a b a b") == 'a b … ("a b" 2 more times, to the end)'
    for plain in ("yellow", "red red", "the cat is on the mat", "x y z x y z x y z w", ""):
        assert shown_answer(plain) == plain
