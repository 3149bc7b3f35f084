"""The result on arrival (`app.arrival`): which example the page opens with, run once and kept, shown as the page's
outputs by name with the states the other tabs use; a failure said in the note, never raised; a hub checkpoint first
(the shipped model's result until it is loaded); its images pinned; the page as built (editor, prompt, galleries)."""

from __future__ import annotations

import base64
from pathlib import Path

import gradio as gr
import pytest
from app_model import SHIPPED, default_model

from app import images
from app.arrival import NOTE, PENDING, Arrival, Example, opening, stand_in
from app.settings import examples, knob_defaults

HUB = "llava-hf/llava-1.5-7b-hf"  # a hub checkpoint listed first, as on a GPU Space (never loaded here)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from app.layout import build_demo

    return build_demo([default_model(tmp_path_factory.mktemp("tiny-llava"))])


@pytest.fixture(scope="module")
def arrived(demo):
    """(the demo's Arrival, the outputs of its one run)."""
    arrival = demo.hap_arrival
    return arrival, arrival.compute()


def test_the_example_the_page_opens_with():
    scenes, photos = examples([HUB])
    scene = Example(*scenes[0][:2], SHIPPED)
    assert opening([SHIPPED]) == scene and stand_in([SHIPPED]) is None  # the shipped model: its first scene
    assert opening([HUB, SHIPPED]) == Example(*photos[0][:2], HUB)  # a hub checkpoint first: its first photograph,
    assert stand_in([HUB, SHIPPED]) == scene  #                       the shipped model's scene until it is loaded
    assert stand_in([HUB]) is None  # no shipped model offered: nothing until the checkpoint is loaded


def test_the_first_visit_asks_for_the_run_and_shows_the_picker():
    calls = []

    class Handler:
        def analyze(self, **request):
            calls.append(request)
            return {"unpruned": "#### Unpruned\n**yellow**"}

        def lab_pickers(self, model, plant, state, run):
            return "picker", None, ""

    arrival = Arrival(Handler(), [SHIPPED])
    first = arrival.shown()
    assert "unpruned" not in first and first[PENDING] and first["lab_heads"] == "picker" and not calls
    assert "**Analysing** scene 600000" in first[NOTE]
    assert arrival.compute()["unpruned"].endswith("yellow**") and len(calls) == 2  # a warm-up, then the one kept
    assert calls[0]["causal"] == "off" and {k: v for k, v in calls[0].items() if k != "causal"} == calls[1]
    assert calls[1]["image"]["path"].endswith("scene_600000.png") and calls[1]["model_name"] == SHIPPED
    again = arrival.shown()  # kept: at once, without asking for a run
    assert PENDING not in again and again["unpruned"].endswith("yellow**") and "**On arrival:**" in again[NOTE]
    arrival.compute()
    assert len(calls) == 2  # run once per server


def test_the_result_is_every_output_and_the_other_tabs_work_on_it(arrived):
    from app.handler import show_head
    from app.present import OUTPUTS
    from app.uploads import file_data

    arrival, out = arrived
    assert set(out) <= {*OUTPUTS, NOTE} and set(OUTPUTS) <= set(out)
    for card in ("unpruned", "pruned", "uniform"):
        assert "visual tokens" in out[card], out[card]
    assert out["history"] == [["what color is the square ?", out["turns"][0].answer]]
    assert out["ground_truth"].startswith("**Ground truth** for")  # the scene asked its own question
    assert "Layer 2, head 1" in show_head(out["state"], 2, 1)[1]  # the head inspector on the stored run
    scene = Path(arrival.opening.image)
    follow = arrival.handler.analyze(image=file_data(scene), prompt="what color is the dot ?", model_name=SHIPPED,
                                     history=out["history"], turns=out["turns"], **knob_defaults(SHIPPED))
    assert [t.question for t in follow["turns"]] == ["what color is the square ?", "what color is the dot ?"]
    shown = arrival.shown()
    assert PENDING not in shown and shown["unpruned"] == out["unpruned"]


def test_a_failed_run_is_said_never_raised():
    class Handler:
        def __init__(self, error):
            self.error = error

        def analyze(self, **request):
            raise self.error

        def lab_pickers(self, *args):
            raise gr.Error("no config")

    for error, said in ((gr.Error("cannot load the model"), "cannot load the model"),
                        (RuntimeError("a bug"), "RuntimeError: a bug")):
        arrival = Arrival(Handler(error), [SHIPPED])
        out = arrival.compute()
        assert set(out) == {NOTE} and f"could not be analysed ({said})" in out[NOTE], out
        assert PENDING not in arrival.shown()  # kept: not run again at every visit

    class Broken(Handler):
        def lab_pickers(self, *args):
            raise RuntimeError("a bug in the picker")

    shown = Arrival(Broken(None), [SHIPPED]).shown()  # whatever fails while showing, the page opens
    assert set(shown) == {NOTE} and "could not be shown (RuntimeError: a bug in the picker)" in shown[NOTE]


def test_a_hub_checkpoint_first_shows_the_shipped_model_until_it_is_loaded(monkeypatch):
    from app.models import LOADED

    class Handler:
        def analyze(self, *, image, prompt, model_name, **knobs):
            return {"unpruned": f"{model_name}: {Path(image['path']).name}"}

        def lab_pickers(self, *args):
            return None, None, ""

    monkeypatch.setattr(LOADED, "name", SHIPPED)
    arrival = Arrival(Handler(), [HUB, SHIPPED])
    assert arrival.todo() == arrival.stand_in  # the checkpoint is not loaded: never loaded for the arrival
    out = arrival.compute()
    assert out["unpruned"] == f"{SHIPPED}: scene_600000.png"
    assert f"shown until {HUB} is loaded" in out[NOTE] and arrival.todo() is None
    monkeypatch.setattr(LOADED, "name", HUB)  # a visitor's Run loaded it
    shown = arrival.shown()
    assert shown["unpruned"].startswith(SHIPPED) and shown[PENDING] and "**Analysing** chelsea" in shown[NOTE]
    out = arrival.compute()
    assert out["unpruned"] == f"{HUB}: chelsea.jpg" and "shown until" not in out[NOTE]


def test_its_images_are_pinned(arrived, monkeypatch):
    arrival, out = arrived
    pinned = [path for path in images.PINNED if path.is_file()]
    assert pinned
    monkeypatch.setattr(images, "KEEP", 1)
    for i in range(3):  # other runs' images: the least recent unpinned ones go
        images.image_url(images.PREFIX + base64.b64encode(f"image {i}".encode()).decode())
    assert all(path.is_file() for path in pinned)
    pinned[0].unlink()
    arrival.shown()
    assert pinned[0].is_file()  # written again from memory


def test_the_page_opens_on_the_example(demo):
    from app.editor_guard import HEAD
    from app.settings import launch_options

    config = demo.get_config_file()
    by_id = {c["props"].get("elem_id"): c for c in config["components"]}
    scene, question = examples([SHIPPED])[0][0][:2]
    editor = by_id["image-editor"]["props"]["value"]
    assert Path(editor["background"]["path"]).name == Path(scene).name  # its value as built: no update after load
    assert by_id["prompt"]["props"]["value"] == question
    cards = by_id["examples-scenes"]["props"]
    assert len(cards["samples"]) == len(examples([SHIPPED])[0]) and question in cards["samples"][0][0]
    assert "<img src=\"data:image/jpeg;base64," in cards["samples"][0][0]
    assert launch_options()["head"] == HEAD  # a file given to the editor while it starts is held (app.editor_guard)
    fill = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "fill")  # a card's click
    path, prompt, model = fill(1)
    assert Path(path).read_bytes() == Path(examples([SHIPPED])[0][1][0]).read_bytes()
    assert (prompt, model) == tuple(examples([SHIPPED])[0][1][1:])
