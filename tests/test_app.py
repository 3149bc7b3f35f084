"""The app served on a free local port and driven through `/analyze` with gradio_client."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from app_model import ROOT, default_model, free_port
from gradio_client import Client, handle_file
from PIL import Image

import hap

UNREACHABLE = "hap-test/no-such-model"  # allow-listed, but neither a folder nor reachable offline
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the triangle ?"
SETTINGS = dict(method="hap", retain=0.2, groups=3, first_layers=0, decay=0.5, temperature=0.1, tau_sink=0.5,
                tau_disp=0.9, sink_rho=10.0, rows="prompt")
PLOTS = range(3, 11)  # output positions of the figures (and the layer slider at 6)


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


def analyze(client: Client, model: str, prompt: str = PROMPT, image=SCENE, **changes):
    settings = {**SETTINGS, **changes}
    return client.predict(handle_file(str(image)), prompt, model, *settings.values(), api_name="/analyze")


def test_api_signature(client):
    info = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/analyze"]
    assert [p["parameter_name"] for p in info["parameters"]] == [
        "image", "prompt", "model_name", *SETTINGS]
    assert len(info["returns"]) == 13


def test_analyze_matches_hap_run(client, model_name):
    out = analyze(client, model_name)
    cards, data = out[:3], out[12]
    model, processor = hap.load_model(str(ROOT / model_name) if not model_name.startswith("/") else model_name,
                                      device="cpu")
    config = hap.HAPConfig(**SETTINGS)
    expected = hap.run(model, processor, Image.open(SCENE), PROMPT, config)
    assert [g["kept"] for g in data["groups"]] == [g.kept for g in expected.groups]
    assert data["head_class"] == expected.head_class
    assert data["runs"]["pruned"]["answer"] == expected.answer
    for card, label in zip(cards, ["Unpruned", "Pruned (hap)", "Uniform averaging"]):
        assert card.startswith(f"#### {label}") and "visual tokens" in card and "latency" in card
    for i in PLOTS:
        if i == 6:
            assert out[i]["maximum"] == expected.num_layers - 1
            continue
        assert out[i]["type"] == "plotly"
        assert json.loads(out[i]["plot"])["data"], f"output {i} is an empty figure"
    assert "PAQ" in out[11]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(prompt="   "), "prompt is empty"),
        (dict(model=UNREACHABLE), "cannot load hub id"),
        (dict(retain=0.01, first_layers=2), "unreachable"),
        (dict(groups=2.5), "whole number"),
        (dict(temperature=-1), r"temperature=-1(\.0)? must be a number > 0"),
        (dict(tau_disp=1.5), "greater than maximum"),
        (dict(image=ROOT / "pytest.ini"), r"image .pytest.ini.: not a readable image"),
    ],
)
def test_bad_request_is_a_clear_error_and_the_server_keeps_answering(client, model_name, changes, message):
    model = changes.pop("model", model_name)
    with pytest.raises(Exception, match=message) as err:
        analyze(client, model, **changes)
    assert "Traceback" not in str(err.value)
    assert analyze(client, model_name)[1].startswith("#### Pruned (hap)")


def test_module_demo_and_space_entry_point():
    """`app/app.py` run as a file from elsewhere (a Space's app_file) finds the repo and builds `demo`."""
    code = f"import runpy; print(type(runpy.run_path({str(ROOT / 'app' / 'app.py')!r})['demo']).__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("Blocks"), out.stderr[-2000:]
    from app.app import demo

    assert "analyze" in {fn.api_name for fn in demo.fns.values()}


def test_defaults_follow_the_model_depth(model_name):
    from app.app import Defaults

    assert Defaults.for_model(model_name) == Defaults(first_layers=0, retain=0.25)  # 6 layers: cut before layer 0
    assert Defaults.for_model("llava-hf/llava-1.5-7b-hf") == Defaults(first_layers=2, retain=0.111)


def test_show_layer_redraws_the_per_head_maps(model_name):
    from analysis.figures import model_view
    from app.app import LOADED, show_layer

    model, processor = LOADED.get(model_name)
    result = hap.run(model, processor, Image.open(SCENE), PROMPT, hap.HAPConfig(**SETTINGS), max_new_tokens=1)
    fig = show_layer((result, model_view(Image.open(SCENE))), 3)
    assert fig.layout.title.text.startswith("Per-head maps of layer 3")
