"""The page's head lab: `/analyze` takes a plan as `plant`, marks every view of the planted run, reports the
classifier's precision / recall on the plan and the lab's answers; the CLI's `--plant FILE` does the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
from app_model import ROOT, default_model, free_port
from gradio_client import Client, handle_file

import hap
from app.lab import NO_PLAN, PLANTED_LABEL, TEACHING_PLAN, plan_from_share
from hap import views
from hap.lab.plan import Plan, classifier_report

SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the square ?"
MARK = PLANTED_LABEL
PLAN = {"sink": [[0, 1], [0, 2], [1, 0], [1, 5]], "dispersed": [[3, 2]], "strength": 0.9}


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


def analyze(client, model, **changes) -> dict:
    from app.present import OUTPUTS

    out = client.predict(image=handle_file(str(SCENE)), prompt=PROMPT, model_name=model, causal="off",
                         **changes, api_name="/analyze")
    return dict(zip(OUTPUTS, out))


@pytest.mark.slow
def test_a_planted_run_is_marked_on_every_view_and_reports_the_classifier(client, model_name):
    # diversity=0: HAP+'s diversity drops the sink tokens at the cut, and the heads then have none to park on (below)
    out = analyze(client, model_name, plant=json.dumps(PLAN), sink_detector="consensus", diversity=0.0)
    plant = out["summary"]["plant"]
    assert plant["sink"] == PLAN["sink"] and plant["strength"] == 0.9 and len(plant["sink_tokens_used"]) == 1
    assert plant["classifier"]["sink"]["recall"] == 1.0  # the consensus detector sees 2 planted of 8 heads
    assert set(plant["answers"]) == {"unpruned", "uniform", "HAP (paper)", "HAP+"}
    assert out["lab"].startswith("**PLANTED heads, not the model's own.**") and "recall 100%" in out["lab"]
    for name in ("head_classes", "paq", "uniform_vs_paq", "kept_masks", "group_maps"):
        assert out[name]["plot"] and MARK in json.dumps(out[name]), name
    assert all(out[card].startswith("#### PLANTED heads") for card in ("unpruned", "pruned", "uniform"))
    # the lab's results side by side: the same (marked) views, the four answers, the pickers on this run
    for name in ("head_classes", "uniform_vs_paq", "kept_masks"):  # the same views, drawn for half the page
        lab = out[f"lab_{name}"]
        assert lab["visible"] and MARK in lab["value"]["plot"], name
        assert json.loads(lab["value"]["plot"])["data"] == json.loads(out[name]["plot"])["data"], name
    marks = {t["name"] for t in json.loads(out["lab_head_classes"]["value"]["plot"])["data"] if t.get("name")}
    assert "planted sink, found by the classifier" in marks and "planted sink, missed by the classifier" not in marks
    assert all(f"- {label}: **{answer or '(empty)'}**" in out["lab_answers"] for label, answer in plant["answers"].items())
    assert out["lab_answers"].startswith("#### PLANTED heads") and out["lab_heads"] and out["lab_tokens"]
    stock = analyze(client, model_name, plant="")  # empty = none: the model's own heads, nothing marked
    assert stock["summary"]["plant"] is None and stock["lab"] == NO_PLAN
    assert stock["lab_head_classes"]["value"] is None and stock["lab_head_classes"]["visible"] is False
    assert MARK not in json.dumps(stock["head_classes"])


@pytest.mark.parametrize("plant, message", [
    ({"sink": [[6, 0]]}, "sink: layer 6 of \\[6, 0\\] is out of range; the model's layers are 0..5"),
    ({"dispersed": [[0, 8]]}, "head 8 of \\[0, 8\\] is out of range"),
    ({"strength": 2}, "strength=2 must be a number in \\[0, 1\\]"),
    ({"sink": [[0, 0]], "sink_tokens": []}, "sink_tokens must name at least one visual token"),
    ({"sink": [[0, 0]], "sink_tokens": [500]}, "sink_tokens \\[500\\] are out of range"),
])
def test_a_bad_plan_is_a_clear_error_and_the_server_keeps_answering(client, model_name, plant, message):
    with pytest.raises(Exception, match=message):
        analyze(client, model_name, plant=json.dumps(plant))


DEEP = "[" * 5000 + "]" * 5000  # nested 5,000 deep: json.loads and repr would recurse past Python's limit
MALFORMED = [  # (plant, the field its message names)
    ("{oops", "plant is not valid JSON"), ("[1, 2]", "plant must be a JSON object"), ('"sink"', "plant must be"),
    ("7", "plant must be"), ('{"sinks": []}', "plant: unknown keys sinks"), ('{"sink": 3}', "sink must be a list"),
    ('{"sink": [[0, 1, 2]]}', "sink: each entry"), ('{"dispersed": [["a", 1]]}', "dispersed: each entry"),
    ('{"strength": true}', "strength=True"), ('{"sink_tokens": "0"}', "sink_tokens must be a list"),
    (DEEP, "plant nests 5000 levels deep"), ('{"sink": ' + DEEP + "}", "plant nests 5001 levels deep"),
]


@pytest.mark.parametrize("plant, message", MALFORMED)
def test_every_malformed_plan_is_refused_naming_its_field(plant, message):
    from app.lab import read_plan

    with pytest.raises(ValueError, match="^" + message.replace("[", "\\[")):
        read_plan(plant)


def test_a_plan_nested_thousands_deep_is_measured_without_recursion_and_refused_by_the_server(client, model_name):
    from app.lab import nesting, read_plan

    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert nesting(deep) == 5001 and nesting({"sink": [[0, 1]]}) == 3 and nesting('{"a": "[[[[", "b": [1]}') == 2
    with pytest.raises(ValueError, match="plant nests 5002 levels deep"):
        read_plan({"sink": deep})
    assert read_plan(json.dumps(PLAN)) == Plan.from_json(PLAN)
    with pytest.raises(Exception, match="plant nests 5000 levels deep") as error:
        analyze(client, model_name, plant=DEEP)
    assert "RecursionError" not in str(error.value)


def test_the_share_helper_and_the_teaching_plan():
    plan = plan_from_share("dispersed", 50, "1-2", 0, 0.8, "3, 4", (6, 8))
    assert len(plan["dispersed"]) == 8 and {l for l, _ in plan["dispersed"]} == {1, 2}
    assert plan["sink_tokens"] == [3, 4] and plan["strength"] == 0.8
    for args, message in ((("sink", 50, "4-9", 0, 0.9, "", (6, 8)), "layers='4-9' must lie in 0..5"),
                          (("sink", 150, "0", 0, 0.9, "", (6, 8)), "share=150"),
                          (("sink", 50, "x", 0, 0.9, "", (6, 8)), "layers='x'"),
                          (("sink", 50, "0", 0, 0.9, "a", (6, 8)), "sink tokens 'a'")):
        with pytest.raises(ValueError, match=message):
            plan_from_share(*args)
    assert len(TEACHING_PLAN.sink) == 12


def test_the_lab_says_why_hap_plus_finds_no_planted_sink_head(client, model_name):
    """Under HAP+'s default diversity the cut keeps none of the sink tokens; the lab text says why the classifier,
    reading the pruned run, then finds no planted sink head."""
    out = analyze(client, model_name, plant=json.dumps(PLAN), sink_detector="consensus")
    plant = out["summary"]["plant"]
    assert plant["classifier"]["sink"]["recall"] == 0.0 and "0 of 1 sink tokens were kept" in out["lab"]
    assert "HAP+'s diversity (diversity=0.25) keeps detected sink tokens last" in out["lab"]


def test_the_cli_plants_a_plan_file(tmp_path, capsys):
    from hap.__main__ import main

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    out = tmp_path / "out.json"
    assert main(["run", "--image", str(SCENE), "--prompt", PROMPT, "--plant", str(plan), "--sink-detector",
                 "consensus", "--diversity", "0", "--max-new-tokens", "2", "--json", str(out)]) == 0
    assert "PLANTED heads (hap.plant, not the model's own): 4 sink, 1 dispersed" in capsys.readouterr().out
    report = json.loads(out.read_text())["plant"]
    assert report["classifier"]["sink"]["recall"] == 1.0 and report["dispersed"] == [[3, 2]]
    plan.write_text('{"sink": [[0, 99]]}')
    assert main(["run", "--image", str(SCENE), "--prompt", PROMPT, "--plant", str(plan)]) == 2
    assert "error: sink: head 99 of [0, 99] is out of range; each layer has query heads 0..7" in capsys.readouterr().err


# --- a random Qwen2-VL saved to a folder with its offline processor (no torchvision) -------------------------------
QWEN_PLAN = {"sink": [[0, 1], [1, 2]], "dispersed": [[2, 0]], "strength": 0.9,
             "massive": False}  # a random model: a massive sink token draws every head, planted or not


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    from tiny_models import qwen_vl_folder

    return str(qwen_vl_folder(tmp_path_factory.mktemp("qwen2-vl")))


def test_analyze_plants_a_plan_on_a_random_qwen2_vl(qwen_folder):
    from app.handler import Handler
    from app.settings import Settings
    from hap.knobs import KNOBS

    server = Handler(Settings(models=[qwen_folder], allow_local=True))
    upload = {"path": str(SCENE), "orig_name": SCENE.name, "meta": {"_type": "gradio.FileData"}}
    # diversity=0: the classifier finds a planted sink head only where its sink tokens survive the cut before layer 0,
    # which HAP+'s diversity drops as duplicates (docs/method.md §10; `test_the_default_drops_the_planted_sink_tokens`)
    knobs = {**{k.name: k.resolve(4) for k in KNOBS}, "sink_detector": "consensus", "diversity": 0.0}
    out = server.analyze(upload, PROMPT, qwen_folder, causal="off", plant=json.dumps(QWEN_PLAN), **knobs)
    plant = out["summary"]["plant"]
    assert out["state"].grid == (6, 6) and plant["sink"] == QWEN_PLAN["sink"]
    assert plant["classifier"]["sink"]["found"] == QWEN_PLAN["sink"] and plant["classifier"]["sink"]["recall"] == 1.0
    assert plant["classifier"]["dispersed"]["recall"] == 1.0 and set(plant["answers"]) == {
        "unpruned", "uniform", "HAP (paper)", "HAP+"}
    assert MARK in out["head_classes"].layout.title.text and out["lab"].startswith("**PLANTED heads")


def test_the_cli_plants_a_plan_file_on_a_random_qwen2_vl(qwen_folder, tmp_path, capsys):
    from hap.__main__ import main

    plan, out = tmp_path / "plan.json", tmp_path / "out.json"
    plan.write_text(json.dumps(QWEN_PLAN))
    assert main(["run", "--model", qwen_folder, "--image", str(SCENE), "--prompt", PROMPT, "--plant", str(plan),
                 "--sink-detector", "consensus", "--diversity", "0", "--max-new-tokens", "2", "--json", str(out)]) == 0
    assert "PLANTED heads (hap.plant, not the model's own): 2 sink, 1 dispersed" in capsys.readouterr().out
    report = json.loads(out.read_text())["plant"]
    assert report["classifier"]["sink"]["found"] == QWEN_PLAN["sink"] and report["dispersed"] == [[2, 0]]
    assert report["classifier"]["sink"]["precision"] == 1.0 and len(report["sink_tokens_used"]) == 1


def test_the_default_drops_the_planted_sink_tokens(qwen_folder):
    """HAP+'s diversity counts the detected sink tokens as duplicates: the cut before layer 0 keeps none of them, so
    no later head can park on them and the classifier finds no planted sink head; relevance top-k keeps them."""
    model, processor = hap.load_model(qwen_folder, device="cpu")
    with hap.plant(model, **{k: QWEN_PLAN[k] for k in ("sink", "dispersed", "strength", "massive")}):
        runs = {w: hap.run(model, processor, str(SCENE), PROMPT, hap.HAPConfig(sink_detector="consensus", diversity=w),
                           max_new_tokens=2) for w in (hap.knobs.knob("diversity").default, 0.0)}
    for w, result in runs.items():
        sinks, kept = set(result.plant["sink_tokens_used"]), set(result.groups[0].kept)
        assert result.groups[0].layers[0] == 0 and sinks
        assert (sinks & kept == set()) if w else (sinks <= kept), w
    assert runs[hap.knobs.knob("diversity").default].plant["classifier"]["sink"]["found"] == []


# --- picking by clicking: the pictures and their inverses --------------------------------------------------------
def test_a_click_on_the_head_picker_maps_to_the_cell_drawn_there():
    from app.lab_pick import MARGIN, cell_px, head_at, head_picker

    shape = (6, 8)
    picture = head_picker(shape, Plan.of(sink=[(2, 5)]))
    cell = cell_px(shape)
    assert picture.shape == (MARGIN + 6 * cell + 1, MARGIN + 8 * cell + 1, 3)
    for layer, head in ((0, 0), (2, 5), (5, 7)):
        x, y = MARGIN + head * cell + cell // 2, MARGIN + layer * cell + cell // 2
        assert head_at(x, y, shape) == (layer, head)
    assert head_at(MARGIN - 1, MARGIN + 1, shape) is None and head_at(MARGIN + 8 * cell + 1, MARGIN, shape) is None
    assert tuple(picture[MARGIN + 2 * cell + cell // 2, MARGIN + 5 * cell + cell // 2]) == (0, 0, 0)  # the x's centre


def test_the_head_picker_marks_missed_heads_apart_from_found_ones():
    from PIL import ImageColor

    from app.lab_pick import MARGIN, MISSED, cell_px, head_picker

    shape, plan = (2, 2), Plan.of(sink=[(0, 0), (1, 1)])
    classes = [["sink", "optimal"], ["optimal", "optimal"]]
    picture = head_picker(shape, plan, classes, classifier_report(plan, classes))
    cell = cell_px(shape)
    centre = lambda l, h: tuple(picture[MARGIN + l * cell + cell // 2, MARGIN + h * cell + cell // 2])  # noqa: E731
    assert centre(0, 0) == (0, 0, 0) and centre(1, 1) == ImageColor.getrgb(MISSED)
    assert centre(0, 1) == ImageColor.getrgb(views.CLASS_COLORS[3])  # an unplanted optimal head: its class colour


def test_a_click_on_the_image_maps_to_the_token_under_it():
    from app.lab_pick import token_at, token_picker

    assert token_at(0, 0, (336, 336), (12, 12), 144) == 0
    assert token_at(335, 335, (336, 336), (12, 12), 144) == 143
    assert token_at(30, 0, (336, 336), (12, 12), 144) == 1 and token_at(0, 28, (336, 336), (12, 12), 144) == 12
    assert token_at(100, 50, (300, 100), (2, 3), 6) == 4  # a non-square grid: row 1, column 1
    with pytest.raises(ValueError, match="do not map to a 12 x 12 grid"):
        token_at(0, 0, (336, 336), (12, 12), 145)
    view = np.full((336, 336, 3), 200, np.uint8)
    picture = token_picker(view, (12, 12), (13,))
    assert tuple(picture[42, 42]) == (207, 100, 100) and tuple(picture[10, 10]) == (200, 200, 200)


def test_clicks_toggle_the_plan_and_keep_the_rest():
    from app.lab_pick import toggle_head, toggle_token

    plan = Plan.of(sink=[(0, 1)], sink_tokens=[3], strength=0.7)
    plan = toggle_head(plan, (1, 2), "dispersed")
    assert plan.dispersed == ((1, 2),) and plan.sink == ((0, 1),) and plan.strength == 0.7
    assert toggle_head(plan, (0, 1), "sink").sink == ()  # clicked again: unplanted
    assert toggle_head(plan, (0, 1), "dispersed").dispersed == ((0, 1), (1, 2))  # the other kind: switched
    assert toggle_token(plan, 5).sink_tokens == (3, 5) and toggle_token(plan, 3).sink_tokens is None


def test_click_events_through_the_handler_edit_the_plan_box(model_name):
    from gradio import SelectData

    from app.handler import Handler
    from app.lab_pick import MARGIN, cell_px
    from app.settings import Settings

    server = Handler(Settings(models=[model_name]))
    cell = cell_px((6, 8))
    click = SelectData(None, {"index": [MARGIN + 3 * cell + 1, MARGIN + 2 * cell + 1], "value": None})
    plan = json.loads(server.click_head("", "dispersed", model_name, None, click))
    assert plan["dispersed"] == [[2, 3]] and plan["sink"] == []
    heads, tokens, text = server.lab_pickers(model_name, json.dumps(plan), None, None)
    assert heads.shape[:2] == (MARGIN + 6 * cell + 1, MARGIN + 8 * cell + 1) and tokens is None and text == ""
    with pytest.raises(Exception, match="press Run first"):
        server.click_token(json.dumps(plan), None, click)
    with pytest.raises(Exception, match="plant is not valid JSON"):
        server.click_head("{oops", "sink", model_name, None, click)
