"""The app served on a free local port and driven through `/analyze` with gradio_client, checked against `hap.run`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from app_model import ROOT, default_model, free_port
from gradio_client import Client, handle_file
from PIL import Image

import hap
from hap import views
from hap.causal import spearman
from hap.scoring import importance
from hap.views.ground_truth import head_grounding, kept_recall, patch_mask, read_metadata, scene_truth
from hap.knobs import KNOBS

UNREACHABLE = "hap-test/no-such-model"  # allow-listed, but neither a folder nor reachable offline
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the square ?"  # the question saved with scene_600000 (assets/examples/scenes.json)
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
    from app.present import OUTPUTS

    out = client.predict(image=handle_file(str(image)), prompt=prompt, model_name=model, **{**SETTINGS, **changes},
                         api_name="/analyze")
    assert len(out) == len(OUTPUTS) - 3  # the states (the run's, its plan report, the turns) stay on the server
    return dict(zip(OUTPUTS, out))


def test_every_knob_is_an_analyze_parameter_with_the_registry_default(client, model_name):
    from app.settings import knob_defaults
    from hap.options import OPTIONS

    info = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/analyze"]
    params = {p["parameter_name"]: p for p in info["parameters"]}
    assert list(params) == ["image", "prompt", "model_name", *(k.name for k in KNOBS), "history", "causal", "plant",
                            "keeps", *(o.name for o in OPTIONS)]
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
        assert out[label].startswith(f"#### {title}") and " s without the app's figures: image " in out[label]
        assert card_facts(out[label]) == (r.answer, f"{r.retained_tokens:.1f} of {r.num_visual} visual tokens "
                                          f"({r.retain:.1%}", f"{r.flops_ratio:.1%}"), label
    data = out["summary"]
    for label, run in data["runs"].items():  # each card: its run's latency, the one vision pass counted in each
        assert f"latency {run['latency_s']:.2f} s" in out[label] and "(one vision pass, in each card)" in out[label]
    t = data["timings"]  # the pruned card's run: the untraced one, decoded with the others (a replay is not decoded)
    assert t["decode_batch"] == 3 and t["vision_s"] > 0
    assert data["runs"]["pruned"]["latency_s"] == pytest.approx(t["prepare_s"] + t["vision_s"] + t["generate_s"])
    assert out["pruned"].endswith(f" · the figures' traced run {data['tracing_s']:.2f} s more")
    assert [g["kept"] for g in data["groups"]] == [g.kept for g in pruned.groups]
    assert data["head_class"] == pruned.head_class and data["config"]["temperature"] == config.temperature
    assert {k: v["answer"] for k, v in data["runs"].items()} == {k: r.answer for k, r in runs.items()}
    assert {k: v["traced"] for k, v in data["runs"].items()} == {"unpruned": False, "pruned": False, "uniform": False}
    assert data["shared"] is True
    counts = views.class_counts(pruned.head_class)
    captured = sum(1 for row in pruned.head_class if any(row))
    text = out["explanation"]
    assert (f"- {counts['optimal']} optimal, {counts['dispersed']} dispersed and {counts['sink']} sink heads over "
            f"{captured} captured layers") in text
    assert ("- Cuts scored by every prompt row of the last layer of each segment; dropped tokens folded into "
            "their most similar kept token, which draws their attention") in text  # the HAP+ knobs in words
    for g, u in zip(pruned.groups, runs["uniform"].groups):
        shared = len(set(g.kept) & set(u.kept))
        assert (f"- Group {g.index} (layers {g.layers[0]}-{g.layers[1] - 1}) keeps {len(g.kept)} tokens; "
                f"{shared} of them are also kept by the uniform-averaging run") in text
    expected = views.ViewData.from_result(pruned, Image.open(SCENE))
    expected = replace(expected, truth=scene_truth(read_metadata(Image.open(SCENE))["question"], expected))
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


def test_show_layer_redraws_the_per_head_maps_and_the_inspector(model_name, loaded):
    from app.handler import show_head, show_layer

    result = hap.run(*loaded, Image.open(SCENE), PROMPT, hap.HAPConfig(**SETTINGS), max_new_tokens=1)
    data = views.ViewData.from_result(result, Image.open(SCENE))
    fig, inspector, text = show_layer(data, 3, 1)
    assert fig.layout.title.text == "Per-head maps of layer 3, before fusion"
    assert inspector.layout.title.text == "Head inspector: layer 3, head 1"
    assert text.startswith(f"**Layer 3, head 1: {result.head_class[3][1]}**")
    with pytest.raises(Exception, match=r"layer=6 is outside the decoder's layers 0..5"):
        show_layer(data, 6, 0)
    with pytest.raises(Exception, match=rf"head={result.num_heads} is outside the layer's heads"):
        show_head(data, 3, result.num_heads)
    with pytest.raises(Exception, match=r"press Run first"):
        show_head(None, 0, 0)


def test_a_scene_returns_its_ground_truth_as_analysis_computes_it(client, model_name, loaded):
    out = analyze(client, model_name)
    truth = out["summary"]["ground_truth"]
    assert set(truth) == {"queried", "head_grounding", "spearman", "kept_recall"}
    question = read_metadata(Image.open(SCENE))["question"]
    assert question["text"] == PROMPT and truth["queried"] == question["answering_patches"]
    result = hap.run(*loaded, Image.open(SCENE), PROMPT, hap.HAPConfig(**SETTINGS))  # the traced run, directly
    target = patch_mask(question["answering_patches"])
    expected = head_grounding(result.maps.head_attention.numpy(), target)
    paq = result.paq.numpy()
    scored = ~np.isnan(paq)
    got = np.array([[np.nan if v is None else v for v in row] for row in truth["head_grounding"]])
    np.testing.assert_allclose(got[scored], expected[scored], rtol=1e-5)
    assert np.isnan(got[~scored]).all()  # heads not scored have no grounding
    assert truth["spearman"] == pytest.approx(spearman(paq[scored], expected[scored]), abs=1e-6)
    assert truth["kept_recall"] == [kept_recall(g.kept, target) for g in result.groups]
    assert f'**Ground truth** for "{PROMPT}": {len(truth["queried"])} answering patches' in out["ground_truth"]
    assert f"Spearman rank correlation of PAQ and grounding over the scored heads: {truth['spearman']:.2f}" in \
        out["ground_truth"]
    figure = json.loads(out["grounding"]["plot"])
    assert figure["layout"]["title"]["text"].endswith(f"Spearman with PAQ {truth['spearman']:.2f}")
    for name in ("kept_masks", "head_maps", "layer_maps", "group_maps", "uniform_vs_paq", "inspector"):
        figure = json.loads(out[name]["plot"])
        assert sum(t["type"] == "scatter" for t in figure["data"]) == len(figure["layout"]["images"]), name


def test_no_ground_truth_without_metadata_or_for_another_question(client, model_name, tmp_path):
    plain = tmp_path / "plain.png"
    Image.open(SCENE).convert("RGB").save(plain)  # the same pixels, no text chunk
    out = analyze(client, model_name, image=plain)
    assert "ground_truth" not in out["summary"]
    assert out["ground_truth"].startswith("**Ground truth.** None for this run: this image carries no scene "
                                          "description")
    assert json.loads(out["grounding"]["plot"])["layout"]["title"]["text"].endswith(views.NO_TRUTH)
    assert not [t for t in json.loads(out["head_maps"]["plot"])["data"] if t["type"] == "scatter"]  # no outline
    other = analyze(client, model_name, prompt="what shape is the purple object ?")
    assert "ground_truth" not in other["summary"]
    assert f'the ground truth of this scene is for "{PROMPT}"' in other["ground_truth"]


def test_inspect_shows_one_head_of_the_last_run_without_running_the_model(client, model_name):
    data = analyze(client, model_name)["summary"]
    figure, text = client.predict(layer=2, head=1, api_name="/inspect")
    assert text.startswith(f"**Layer 2, head 1: {data['head_class'][2][1]}**")
    assert f"| PAQ | {data['paq'][2][1]:.3f} |" in text
    assert f"| grounding | {data['ground_truth']['head_grounding'][2][1]:.3f} |" in text
    assert json.loads(figure["plot"])["layout"]["title"]["text"] == "Head inspector: layer 2, head 1"


def sweep(client: Client, model: str, image=SCENE, prompt: str = PROMPT, **changes):
    knobs = {k: v for k, v in {**SETTINGS, **changes}.items() if k not in ("method", "retain", "flops_ratio")}
    return client.predict(image=handle_file(str(image)), prompt=prompt, model_name=model, **knobs, api_name="/sweep")


def test_sweep_runs_every_method_over_the_budgets_as_direct_runs_do(client, model_name, loaded, monkeypatch):
    from app import handler
    from app.handler import SWEPT
    from hap.runs.sweep import own_floor
    from hap.options import OPTIONS

    info = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/sweep"]
    assert [p["parameter_name"] for p in info["parameters"]] == [
        "image", "prompt", "model_name", *(k.name for k in KNOBS if k.name not in SWEPT), *(o.name for o in OPTIONS)]
    figure, data = sweep(client, model_name)
    retain = data["retain"]
    assert len(retain) >= 6 and retain[0] == 1.0 and retain == sorted(retain, reverse=True)
    assert retain[-1] * 144 <= 2  # first_layers=0: down to a token or so per group
    assert list(data["methods"]) == [m for m in hap.METHODS if m not in ("none", *data["refused"])]
    assert set(data["refused"]) == {"cdpruner"}  # the default CLIP pairs with CLIP-L/336 towers
    for method, runs in data["methods"].items():
        assert len(runs["answers"]) == len(runs["answer_prob"]) == len(retain), method
        reached = [p for p in runs["answer_prob"] if p is not None]  # None: below an official schedule's floor
        assert all(0.0 <= p <= 1.0 for p in reached) and len(reached) >= (2 if own_floor(method) else len(retain))
    unpruned = hap.run(*loaded, Image.open(SCENE), PROMPT, hap.HAPConfig(**{**SETTINGS, "method": "none"}),
                       trace=False)
    assert data["unpruned"]["answer"] == unpruned.answer
    for method, i in (("hap", len(retain) - 1), ("fastv", 2), ("random", 3)):
        config = hap.HAPConfig(**{**SETTINGS, "method": method, "retain": retain[i]})
        assert data["methods"][method]["answers"][i] == hap.run(*loaded, Image.open(SCENE), PROMPT, config,
                                                               trace=False).answer, method
    assert data["methods"]["hap"]["answer_prob"][0] == pytest.approx(data["unpruned"]["answer_prob"], abs=1e-4)
    traces = json.loads(figure["plot"])["data"]
    assert [t.get("name") for t in traces] == [*data["methods"], None]  # a line per method, then the answer grid
    assert traces[-1]["type"] == "heatmap" and traces[-1]["y"] == list(data["methods"])
    runs, run_sweep = [], handler.run_sweep
    monkeypatch.setattr(handler, "run_sweep", lambda *args, **kwargs: runs.append(args) or run_sweep(*args, **kwargs))
    assert sweep(client, model_name)[1] == data and runs == []  # cached: the same input is not run again


def test_an_offline_hub_id_fails_within_5_seconds(client, model_name, monkeypatch):
    import inspect

    import huggingface_hub

    from app.handler import Handler

    for endpoint in (Handler.analyze, Handler.sweep):  # online, a hub download's tqdm bars show on the page
        assert inspect.signature(endpoint).parameters["progress"].default.track_tqdm

    for offline in (True, False):  # HF_HUB_OFFLINE=1, then "online" with no network: the hub does not answer
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
        start = time.perf_counter()
        with pytest.raises(Exception, match=r"cannot load hub id 'hap-test/no-such-model': it is not a local model "
                                            r"folder and the hub copy is unknown or unreachable \(offline\?\)"):
            analyze(client, UNREACHABLE)
        assert time.perf_counter() - start < 5, offline


def test_causal_keys_on_a_photo_and_off(client, model_name, loaded):
    """`/analyze` on an uploaded photo carries the causal analysis and head utility (binding keys), with numbers that
    match the run and the library."""
    from hap.causal import kept_importance, paq_spearman

    photo = ROOT / "assets" / "examples" / "photos" / "coffee.jpg"
    out = analyze(client, model_name, prompt="what color is the cup ?", image=photo)
    report = out["summary"]
    found = report["causal"]
    assert {"mode", "answer_token", "head_importance", "paq_spearman", "token_importance",
            "kept_importance"} <= set(found)
    assert found["mode"] == "ablation"  # "auto" on a small model
    paq = np.array([[np.nan if v is None else v for v in row] for row in report["paq"]])
    assert np.array(found["head_importance"]).shape == paq.shape
    assert found["paq_spearman"] == pytest.approx(paq_spearman(paq, found["head_importance"]))
    assert len(found["token_importance"]) == report["num_visual"]
    assert found["kept_importance"] == pytest.approx(
        kept_importance(found["token_importance"], [g["kept"] for g in report["groups"]]))
    assert "ablation" in out["causal_text"]
    found = report["head_utility"]  # binding keys; every layer but the last scored on a small model
    values = np.array([[np.nan if v is None else v for v in row] for row in found["values"]])
    assert values.shape == paq.shape and np.isnan(values[-1]).all() and np.isfinite(values[:-1]).all()
    assert found["keep"] == -(-report["num_visual"] // 9)
    assert found["uniform"][-1] is None and found["paq_weighted"][-1] is None and None not in found["uniform"][:-1]
    assert found["spearman"] == pytest.approx(paq_spearman(found["paq"], values))
    model, processor = loaded
    library = hap.head_utility(model, processor, photo, "what color is the cup ?", rows=SETTINGS["rows"])
    np.testing.assert_allclose(values, library.numpy(), atol=1e-5)
    assert "Head utility" in out["utility_text"]
    heads = report["head_weights"]  # the shipped model's static importance beside this image's PAQ weights, utility
    static = importance.read(str(ROOT / model_name / importance.FILE)).numpy()
    assert heads["layers"] == sorted({layer for g in report["groups"] for layer in g["scored_by"]})
    np.testing.assert_allclose(heads["static"], static[heads["layers"]], atol=1e-6)
    np.testing.assert_allclose(np.sum(heads["paq_weight"], 1), 1.0, atol=1e-6)
    np.testing.assert_allclose(heads["utility"], values[heads["layers"]], atol=1e-6)
    rho = heads["spearman"]["static importance ~ PAQ weight (this image)"]
    assert rho == pytest.approx(paq_spearman(heads["static"], heads["paq_weight"]))
    assert f"{rho:+.2f}" in out["heads_text"] and out["heads_weights"] is not None
    off = analyze(client, model_name, prompt="what color is the cup ?", image=photo, causal="off")
    assert "causal" not in off["summary"] and "head_utility" not in off["summary"] and "off" in off["causal_text"]
    assert off["summary"]["head_weights"]["utility"] is None and off["heads_weights"] is not None  # no causal: 2 rows
