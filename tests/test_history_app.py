"""Follow-ups and edits through the app: `/analyze` with `history` over gradio_client, a plain upload as before,
malformed history refused by name, the page's turns, and an edited composite analysed like the same pixels
uploaded (the handler in-process, as the page's editor calls it)."""

from __future__ import annotations

import pytest
from app_model import default_model, free_port
from gradio_client import Client, handle_file
from test_edit import SCENE, editor, file, painted

from app import conversation as chat

PROMPT, FOLLOW_UP = "what color is the triangle ?", "what shape is it ?"
HISTORY = [[PROMPT, "purple"]]
FAST = dict(method="hap", retain=0.3, first_layers=0)


@pytest.fixture(scope="module")
def model_name(tmp_path_factory):
    return default_model(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def client(model_name):
    from app.app import build_demo, launch_options

    demo = build_demo([model_name])
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options())
    yield Client(url, verbose=False)
    demo.close()


def analyze(client: Client, model: str, prompt: str, **changes) -> dict:
    from app.present import OUTPUTS

    out = client.predict(image=handle_file(str(SCENE)), prompt=prompt, model_name=model, **FAST, **changes,
                         api_name="/analyze")
    return dict(zip(OUTPUTS, out))


def test_a_follow_up_answers_and_shows_the_whole_conversation_prompt(client, model_name):
    out = analyze(client, model_name, FOLLOW_UP, history=HISTORY)
    summary = out["summary"]
    assert summary["answer"] and summary["history"] == HISTORY
    assert f"{PROMPT} ASSISTANT: purple</s>USER: {FOLLOW_UP} ASSISTANT:" in summary["prompt_text"]
    assert out["history"] == [*HISTORY, [FOLLOW_UP, summary["answer"]]]
    texts = [m["content"][0]["text"] for m in out["conversation"]]
    assert texts[:2] == [f"turn 1: {PROMPT}", "**purple**\n\n(given as history, not run here)"]
    assert texts[2] == f"turn 2: {FOLLOW_UP}" and "kept tokens: group 0" in texts[3]
    assert "Follow-up after 1 earlier turn" in out["explanation"] and "the last prompt token" in out["explanation"]


def test_a_plain_upload_without_history_is_a_first_question(client, model_name):
    out = analyze(client, model_name, PROMPT)
    summary = out["summary"]
    assert summary["history"] == [] and summary["prompt_text"].count("USER:") == 1
    assert out["history"] == [[PROMPT, summary["answer"]]]
    assert summary["input"]["edited"] is False and "edit" not in summary and "Follow-up" not in out["explanation"]


@pytest.mark.parametrize("history, message", [
    ([["only a question"]], "history[0] must be a [question, answer] pair"),
    ({"q": "a"}, "history must be a list of [question, answer] pairs, not dict"),
    ([["q", "a"]] * 9, "the history has 9 turns; the limit is 8"),
    ([["q" * 1990, "a" * 1990]] * 3, "the conversation has 11958 characters; the limit is 8000"),
])
def test_a_malformed_or_oversized_history_is_refused_by_name(client, model_name, history, message):
    with pytest.raises(Exception) as err:  # noqa: PT011 (gradio_client's AppError carries the message)
        analyze(client, model_name, FOLLOW_UP, history=history)
    assert message in str(err.value)


def test_turns_continue_this_pages_conversation_and_pick_any_turn():
    first = chat.Turn(PROMPT, "purple", [[0, 1]], 4, {"summary": 1}, "scene", "tiny")
    assert chat.continued([first], [(PROMPT, "purple")], "scene", "tiny") == [first]
    assert chat.continued([first], [(PROMPT, "red")], "other", "tiny") == [chat.Turn(PROMPT, "red")]  # another one
    second = chat.Turn(FOLLOW_UP, "triangle", [[1, 2]], 4, {"summary": 2}, "scene", "tiny")
    assert chat.pick([first, second], "turn 2") is second
    assert "since turn 1: group 0 +1 −1" in chat.messages([first, second])[3]["content"]
    with pytest.raises(ValueError, match="turn 1 was given as history, not run on this page"):
        chat.pick([chat.Turn(PROMPT, "red"), second], "turn 1")


def test_a_follow_up_after_the_image_or_the_model_changed_is_refused(model_name):
    """The page's follow-up continues one image with one model: after either changed (another upload, an edit, another
    model) it is refused, before any run, and says so; "since turn 1" never compares two images' kept tokens."""
    import gradio as gr

    from app.handler import Handler
    from app.settings import Settings, knob_defaults

    stored = [chat.Turn(PROMPT, "purple", [[0, 1]], 4, {"summary": 1}, "scene", "tiny")]
    for image, model, changed in (("other", "tiny", "the image changed"), ("scene", "big", "the model changed"),
                                  ("other", "big", "the image and the model changed")):
        with pytest.raises(ValueError, match=rf"^{changed} since turn 1 of this conversation.*Press Run"):
            chat.continued(stored, [(PROMPT, "purple")], image, model)
    handler, knobs = Handler(Settings(models=[model_name])), {**knob_defaults(model_name), **FAST, "causal": "off"}
    first = handler.analyze(file(SCENE), PROMPT, model_name, **knobs)
    follow = dict(history=first["history"], turns=first["turns"])
    with pytest.raises(gr.Error, match=r"the image changed since turn 1 .*ask about this image\."):
        handler.analyze(file(SCENE.with_name("scene_600001.png")), FOLLOW_UP, model_name, **follow, **knobs)
    second = handler.analyze(file(SCENE), FOLLOW_UP, model_name, **follow, **knobs)  # the same image: it continues
    assert "; since turn 1: group 0" in second["conversation"][3]["content"]


def test_an_edited_composite_is_analysed_like_the_same_pixels_uploaded(model_name, uploads):
    from app.handler import Handler
    from app.settings import Settings, knob_defaults

    handler, knobs = Handler(Settings(models=[model_name])), {**knob_defaults(model_name), **FAST}
    composite = painted(uploads)
    edited = handler.analyze(editor(SCENE, composite), PROMPT, model_name, **knobs)
    uploaded = handler.analyze(file(composite), PROMPT, model_name, **knobs)
    same = ("answer", "groups", "head_class", "prompt_text")
    assert {k: edited["summary"][k] for k in same} == {k: uploaded["summary"][k] for k in same}
    assert edited["summary"]["input"]["edited"] and "edited in the editor" in edited["ground_truth"]
    edit = edited["summary"]["edit"]
    original = handler.analyze(file(SCENE), PROMPT, model_name, **knobs)["summary"]
    assert (edit["answer_original"], edit["answer_edited"]) == (original["answer"], edited["summary"]["answer"])
    kept = [(set(g["kept"]), set(o["kept"])) for g, o in zip(edited["summary"]["groups"], original["groups"])]
    assert [(sorted(o - e), sorted(e - o)) for e, o in kept] == [(k["only_original"], k["only_edited"])
                                                                 for k in edit["kept"]]
    assert "What" not in edited["edit_diff"] and "Answer on the original" in edited["edit_diff"]


def test_the_operator_sets_the_conversation_limits():
    from app.settings import Settings

    limits = Settings.from_env({"HAP_APP_MAX_TURNS": "2", "HAP_APP_MAX_CONVERSATION": "500"}).limits
    assert (limits.max_history_turns, limits.max_conversation_chars) == (2, 500)
    with pytest.raises(ValueError, match="HAP_APP_MAX_TURNS"):
        Settings.from_env({"HAP_APP_MAX_TURNS": "many"})
