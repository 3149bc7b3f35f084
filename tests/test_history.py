"""Follow-up questions (hap.run `history`): the conversation's prompt is the processor's own chat template, the
pruner scores with the new question's rows only, and a malformed or oversized history is refused by name."""

import json
from pathlib import Path

import pytest
import torch

import hap
from hap.__main__ import main
from hap.runs.inputs import InputLimits, check_history, clean_conversation
from hap.patch.state import PruneState
from hap.runs.run import build_inputs, chat_prompt, question_lead, template_tail
from tiny_models import noise_image, tiny_llava

FIRST, ANSWER, FOLLOW_UP = "what color is the triangle ?", "purple", "what shape is it ?"
HISTORY = [(FIRST, ANSWER)]
SCENE = Path(__file__).resolve().parent.parent / "assets" / "examples" / "scene_600000.png"


@pytest.fixture(scope="module")
def tiny():
    return tiny_llava(layers=2)


def test_a_two_turn_prompt_is_the_processors_chat_template_over_the_same_messages(tiny):
    _, processor = tiny
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": FIRST}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
        {"role": "user", "content": [{"type": "text", "text": FOLLOW_UP}]},
    ]
    expected = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert chat_prompt(processor, FOLLOW_UP, HISTORY) == expected
    _, text, notes = build_inputs(processor, noise_image(), FOLLOW_UP, InputLimits(), [list(HISTORY[0])])
    assert (text, notes) == (expected, [])
    assert text.count(processor.image_token) == 1 and text.index(processor.image_token) < text.index(FIRST)


def test_without_history_the_prompt_and_rows_are_as_before(tiny):
    _, processor = tiny
    assert chat_prompt(processor, FIRST, []) == chat_prompt(processor, FIRST)
    assert question_lead(processor, []) == 0


def _rows(processor, history, rows: str) -> str:
    """The tokens the pruner takes its prompt rows from, for `rows`, decoded."""
    inputs, _, _ = build_inputs(processor, noise_image(), FOLLOW_UP, InputLimits(), history)
    ids = inputs["input_ids"]
    shape = hap.planning.flops.DecoderShape.mha(layers=2, hidden=8, intermediate=16)
    st = PruneState.start(hap.HAPConfig(retain=0.5, groups=1, rows=rows), ids == processor.tokenizer.convert_tokens_to_ids(
        processor.image_token), None, shape, trace=False, tail=template_tail(processor),
        lead=question_lead(processor, history))
    positions = st.row_positions(ids.shape[1])[st.row_valid]
    return processor.tokenizer.decode(ids[0, positions]).replace(" ", "").lower()


@pytest.mark.parametrize("rows, expected", [("prompt", "whatshapeisit?assistant:"), ("question", "whatshapeisit?"),
                                            ("last", ":")])
def test_a_follow_up_is_scored_by_its_own_question_rows_only(tiny, rows, expected):
    _, processor = tiny
    assert _rows(processor, HISTORY, rows) == expected


def test_the_second_turn_keeps_the_tokens_its_own_question_scores(tiny):
    """The follow-up's kept tokens come from its own question's attention: they differ from a run asking the first
    question again, after the same history, where the attention differs."""
    model, processor = tiny
    config = hap.HAPConfig(retain=0.3, first_layers=0, groups=1, rows="question", merge="none")
    image = noise_image(3)

    def kept(question: str) -> tuple[list[int], torch.Tensor]:
        r = hap.run(model, processor, image, question, config, max_new_tokens=1, history=HISTORY)
        return r.groups[0].kept, r.maps.group[0]

    follow_up, again = kept(FOLLOW_UP), kept(FIRST)
    assert not torch.allclose(follow_up[1], again[1])  # the attention differs ...
    assert follow_up[0] != again[0]  # ... and so do the kept tokens
    result = hap.run(model, processor, image, FOLLOW_UP, config, max_new_tokens=1, history=HISTORY)
    assert result.history == [list(HISTORY[0])] and result.prompt_text == chat_prompt(processor, FOLLOW_UP, HISTORY)
    assert result.to_json()["history"] == [[FIRST, ANSWER]]


@pytest.mark.parametrize("history, message", [
    ({"q": "a"}, r"history must be a list of \[question, answer\] pairs, not dict"),
    ("[[1, 2", r"history is not valid JSON"),
    ([["only a question"]], r"history\[0\] must be a \[question, answer\] pair"),
    ([["q", "a"], "qa"], r"history\[1\] must be a \[question, answer\] pair, not 'qa'"),
    ([["q", 3]], r"history\[0\] must hold two strings \(question, answer\), not str, int"),
    ([["  ", "a"]], r"history\[0\]: the question is empty"),
    ([["q", "a"]] * 9, r"the history has 9 turns; the limit is 8"),
])
def test_a_malformed_history_is_refused_naming_the_problem(history, message):
    with pytest.raises(ValueError, match=message):
        check_history(history)


def test_history_as_json_text_and_none_are_accepted():
    assert check_history('[["what ?", "red"]]') == [("what ?", "red")]
    assert check_history(None) == check_history("") == check_history([]) == []


def test_the_conversation_length_is_bounded_and_its_texts_cleaned():
    limits = InputLimits(max_conversation_chars=30)
    with pytest.raises(ValueError, match="the conversation has 36 characters; the limit is 30"):
        clean_conversation("what shape ?", [("what color is it ?", "purple")], set(), limits)
    prompt, history, notes = clean_conversation("what ?", [("is it <image> red ?", "yes<image>")], {"<image>"})
    assert (prompt, history) == ("what ?", [("is it   red ?", "yes")])
    assert notes == ["history[0]: removed the special token '<image>' from the prompt"] * 2
    with pytest.raises(ValueError, match=r"history\[0\]: the prompt is empty"):
        clean_conversation("what ?", [("<image>", "yes")], {"<image>"})


def test_a_run_refuses_a_malformed_history_before_the_model(tiny):
    model, processor = tiny
    with pytest.raises(ValueError, match=r"history\[0\] must be a \[question, answer\] pair"):
        hap.run(model, processor, noise_image(), FOLLOW_UP, history=[["q"]])


def test_the_cli_takes_a_history_file(tmp_path, capsys):
    history = tmp_path / "history.json"
    history.write_text(json.dumps([[FIRST, ANSWER]]))
    out = tmp_path / "out.json"
    code = main(["run", "--image", str(SCENE), "--prompt", FOLLOW_UP, "--history", str(history), "--json", str(out),
                 "--max-new-tokens", "2"])
    printed = capsys.readouterr().out
    assert code == 0 and f"turn 1: {FIRST} -> {ANSWER}" in printed and "answer: " in printed
    data = json.loads(out.read_text())
    assert data["history"] == [[FIRST, ANSWER]] and f"{FIRST} ASSISTANT: {ANSWER}</s>USER: {FOLLOW_UP}" in data[
        "prompt_text"]
    history.write_text('[["what color ?"]]')
    assert main(["run", "--image", str(SCENE), "--prompt", FOLLOW_UP, "--history", str(history)]) == 2
    assert f"error: --history {history}: history[0] must be a [question, answer] pair" in capsys.readouterr().err
