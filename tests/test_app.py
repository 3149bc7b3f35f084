"""The app served on a free local port and driven through `/analyze` with gradio_client, checked against `hap.run`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from app_model import ROOT, default_model, free_port
from gradio_client import Client, handle_file
from PIL import Image

import hap
from hap import views
from hap.knobs import KNOBS

UNREACHABLE = "hap-test/no-such-model"  # allow-listed, but neither a folder nor reachable offline
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the triangle ?"
SETTINGS = dict(method="hap", retain=0.2, groups=3, first_layers=0, decay=0.5, temperature=0.1, tau_sink=0.5,
                tau_disp=0.9, sink_rho=10.0, rows="prompt")


@pytest.fixture(scope="module")
def model_name(tmp_path_factory):
    return default_model(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def client(model_name):
    from app.app import build_demo, launch_options

    demo = build_demo([model_name, UNREACHABLE])
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options())
    yield Client(url, verbose=False)
    demo.close()


@pytest.fixture(scope="module")
def loaded(model_name):
    from app.settings import resolve

    return hap.load_model(resolve(model_name), device="cpu")


def analyze(client: Client, model: str, prompt: str = PROMPT, image=SCENE, **changes) -> dict:
    """`/analyze` called by keyword, as a script would; its outputs by name."""
    from app.handler import OUTPUTS

    out = client.predict(image=handle_file(str(image)), prompt=prompt, model_name=model, **{**SETTINGS, **changes},
                         api_name="/analyze")
    assert len(out) == len(OUTPUTS) - 1  # the state stays on the server
    return dict(zip(OUTPUTS, out))


def test_every_knob_is_an_analyze_parameter_with_the_registry_default(client, model_name):
    from app.settings import knob_defaults

    info = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/analyze"]
    params = {p["parameter_name"]: p for p in info["parameters"]}
    assert list(params) == ["image", "prompt", "model_name", *(k.name for k in KNOBS)]
    assert {k.name for k in KNOBS} <= set(params) and "seed" not in params
    defaults = knob_defaults(model_name)  # per-model rules applied to the 6-layer default model
    assert (defaults["first_layers"], defaults["retain"]) == (0, 0.25)
    for k in KNOBS:
        assert params[k.name]["parameter_has_default"], k.name
        assert params[k.name]["parameter_default"] == defaults[k.name], k.name


def card_facts(card: str) -> tuple[str, str, str]:
    """(answer, retained tokens, FLOPs) as an answer card prints them."""
    answer = re.search(r"\*\*(.*)\*\*", card).group(1)
    tokens = re.search(r"([\d.]+ of \d+ visual tokens \([\d.]+%)", card).group(1)
    return answer, tokens, re.search(r"prefill FLOPs ([\d.]+%)", card).group(1)


def test_analyze_matches_direct_runs(client, model_name, loaded):
    out = analyze(client, model_name)
    config = hap.HAPConfig(**SETTINGS)
    runs = {label: hap.run(*loaded, Image.open(SCENE), PROMPT, hap.HAPConfig(**{**SETTINGS, "method": method}))
            for label, method in (("unpruned", "none"), ("pruned", "hap"), ("uniform", "uniform"))}
    pruned = runs["pruned"]
    for label, title in zip(runs, ["Unpruned", "Pruned (hap)", "Uniform averaging"]):
        r = runs[label]
        assert out[label].startswith(f"#### {title}")
        assert card_facts(out[label]) == (r.answer, f"{r.retained_tokens:.1f} of {r.num_visual} visual tokens "
                                          f"({r.retain:.1%}", f"{r.flops_ratio:.1%}"), label
    data = out["summary"]
    assert [g["kept"] for g in data["groups"]] == [g.kept for g in pruned.groups]
    assert data["head_class"] == pruned.head_class and data["config"]["temperature"] == config.temperature
    assert {k: v["answer"] for k, v in data["runs"].items()} == {k: r.answer for k, r in runs.items()}
    counts = views.class_counts(pruned.head_class)
    captured = sum(1 for row in pruned.head_class if any(row))
    text = out["explanation"]
    assert (f"- {counts['optimal']} optimal, {counts['dispersed']} dispersed and {counts['sink']} sink heads over "
            f"{captured} captured layers") in text
    for g, u in zip(pruned.groups, runs["uniform"].groups):
        shared = len(set(g.kept) & set(u.kept))
        assert (f"- Group {g.index} (layers {g.layers[0]}-{g.layers[1] - 1}) keeps {len(g.kept)} tokens; "
                f"{shared} of them are also kept by the uniform-averaging run") in text
    expected = views.ViewData.from_result(pruned, Image.open(SCENE))
    assert out["layer"]["value"] == expected.layer and out["layer"]["maximum"] == pruned.num_layers - 1
    for view in views.VIEWS:
        figure = json.loads(out[view.name]["plot"])
        assert figure["layout"]["title"]["text"] == view.title_for(expected), view.name
        assert figure["data"], f"{view.name} is an empty figure"
    masks = [t["text"] for t in json.loads(out["kept_masks"]["plot"])["data"] if t["type"] == "heatmap"]
    assert [sum(row.count("kept") for row in m) for m in masks] == [len(g.kept) for g in pruned.groups]


def test_flops_ratio_is_a_budget_of_its_own(client, model_name):
    data = analyze(client, model_name, flops_ratio=0.4)["summary"]
    assert data["config"]["flops_ratio"] == 0.4 and data["config"]["retain"] is None  # it replaces the retain sent
    assert data["target_flops_ratio"] == 0.4 and abs(data["flops_ratio"] - 0.4) < 0.1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(prompt="   "), "prompt is empty"),
        (dict(model=UNREACHABLE), "cannot load hub id"),
        (dict(retain=0.01, first_layers=2), "unreachable"),
        (dict(groups=2.5), r"groups=2.5 must be an integer >= 1"),
        (dict(temperature=-1), r"temperature=-1(\.0)? must be a number > 0"),
        (dict(tau_disp=1.5), r"tau_disp=1.5 must be a number in \[0, 1\]"),
        (dict(flops_ratio=1.5), r"flops_ratio=1.5 must be a number in \(0, 1\]"),
        (dict(image=ROOT / "pytest.ini"), r"image .pytest.ini.: not a readable image"),
    ],
)
def test_bad_request_is_a_clear_error_and_the_server_keeps_answering(client, model_name, changes, message):
    model = changes.pop("model", model_name)
    with pytest.raises(Exception, match=message) as err:
        analyze(client, model, **changes)
    assert "Traceback" not in str(err.value)
    assert analyze(client, model_name)["pruned"].startswith("#### Pruned (hap)")


def test_module_demo_and_space_entry_point():
    """`app/app.py` run as a file from elsewhere (a Space's app_file) finds the repo and builds `demo`."""
    code = f"import runpy; print(type(runpy.run_path({str(ROOT / 'app' / 'app.py')!r})['demo']).__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("Blocks"), out.stderr[-2000:]
    from app.app import demo

    assert "analyze" in {fn.api_name for fn in demo.fns.values()}


def test_defaults_follow_the_model_depth(model_name):
    from app.layout import RULED, model_defaults

    assert RULED == ["retain", "first_layers"]
    assert [u["value"] for u in model_defaults(model_name)] == [0.25, 0]  # 6 layers: cut before layer 0
    assert [u["value"] for u in model_defaults("llava-hf/llava-1.5-7b-hf")] == [0.111, 2]


def test_show_layer_redraws_the_per_head_maps(model_name, loaded):
    from app.handler import show_layer

    result = hap.run(*loaded, Image.open(SCENE), PROMPT, hap.HAPConfig(**SETTINGS), max_new_tokens=1)
    data = views.ViewData.from_result(result, Image.open(SCENE))
    fig = show_layer(data, 3)
    assert fig.layout.title.text == "Per-head maps of layer 3, before fusion"
    with pytest.raises(Exception, match=r"layer=6 is outside the decoder's layers 0..5"):
        show_layer(data, 6)
