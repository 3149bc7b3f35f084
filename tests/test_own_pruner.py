"""A pruner of one's own, written outside the package (`tests/own_pruners.py`, the README's example) and registered with
`hap.pruners.register`: it runs on HAP's schedule through `hap.run`, the CLI (named in `HAP_PRUNERS`), `/analyze`, the
sweep and "what each method keeps", with no file of the package touched."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from app_model import ROOT, free_port
from gradio_client import Client, handle_file
from PIL import Image

import hap
from hap.runs.keeps import keeps, pruning
from hap.methods import unregister
from hap.patch.decoder import decoder_of, decoder_shape
from hap.pruners.base import Pruner
from hap.runs.run import chat_prompt
from hap.runs.sweep import sweep

SHIPPED = "assets/tiny-llava"
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the square ?"
NAME = "norm_test"


@pytest.fixture(scope="module")
def own():
    """`own_pruners` imported (which registers its pruner); unregistered afterwards so no other test sees it."""
    sys.path.insert(0, str(ROOT / "tests"))
    module = importlib.import_module("own_pruners")
    yield module
    unregister(NAME)
    sys.modules.pop("own_pruners", None)
    sys.path.remove(str(ROOT / "tests"))


@pytest.fixture(scope="module")
def shipped():
    return hap.load_model(str(ROOT / SHIPPED), device="cpu")


def test_register_is_a_class_decorator_that_checks_what_it_takes(own):
    assert NAME in hap.METHODS and NAME in pruning() and hap.METHODS[-1] == "none"
    assert hap.pruners.pruner_class(NAME) is own.Norm
    assert hap.pruners.register(own.Norm) is own.Norm  # again: the same class, no error
    with pytest.raises(ValueError, match="already registered"):
        hap.pruners.register(type("Other", (Pruner,), {"name": "hap"}))
    with pytest.raises(ValueError, match="lower-case identifier"):
        hap.pruners.register(type("Nameless", (Pruner,), {}))
    with pytest.raises(TypeError, match="subclass of hap.pruners.base.Pruner"):
        hap.pruners.register(object)
    with pytest.raises(ValueError, match="not registered from outside"):
        unregister("hap")
    with pytest.raises(ValueError, match="method='norm_tst' is not allowed"):
        hap.HAPConfig(method="norm_tst")


def test_it_keeps_the_longest_hidden_states_on_haps_schedule(own, shipped):
    """One cut before layer 0 keeping k: the k visual tokens whose input embeddings are longest (computed here from a
    hook of our own on layer 0), and the schedule and FLOPs accounting are HAP's."""
    model, processor = shipped
    entering = []
    hook = decoder_of(model).layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: entering.append((args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True)
    config = hap.HAPConfig(method=NAME, groups=1, first_layers=0, retain=0.1)
    try:
        with torch.no_grad():
            stock = hap.run(model, processor, Image.open(SCENE), PROMPT, hap.HAPConfig(method="none"), trace=False,
                            max_new_tokens=1)
            result = hap.run(model, processor, Image.open(SCENE), PROMPT, config, trace=True, max_new_tokens=4)
    finally:
        hook.remove()
    visual = processor(images=Image.open(SCENE), text=chat_prompt(processor, PROMPT),
                       return_tensors="pt")["input_ids"][0] == model.config.image_token_id
    norms = entering[0][0, visual].float().norm(dim=-1)  # the stock run's layer-0 input, visual rows
    planned = hap.plan(config, decoder_shape(model), int(visual.sum()), len(visual) - int(visual.sum()))
    assert result.method == NAME and stock.answer and result.num_visual == int(visual.sum())
    assert [len(g.kept) for g in result.groups] == planned.kept and result.retain == pytest.approx(planned.retain)
    assert sorted(result.groups[0].kept) == sorted(norms.topk(planned.kept[0]).indices.tolist())


def test_the_cli_offers_it_through_hap_pruners(own, tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "HAP_PRUNERS": "own_pruners",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "hap", "run", "--model", SHIPPED, "--image", str(SCENE), "--prompt",
                           PROMPT, "--method", NAME, "--first-layers", "0", "--retain", "0.2", "--max-new-tokens", "2",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["method"] == NAME
    env["HAP_PRUNERS"] = "no_such_module"
    bad = subprocess.run([sys.executable, "-m", "hap", "run", "--model", SHIPPED, "--image", str(SCENE), "--prompt",
                          PROMPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "HAP_PRUNERS='no_such_module': cannot import 'no_such_module'" in bad.stderr


def test_the_sweep_and_the_keeps_view_run_it(own, shipped):
    model, processor = shipped
    config = hap.HAPConfig(first_layers=0)
    out = sweep(model, processor, Image.open(SCENE), PROMPT, config, 2, hap.DEFAULT_LIMITS)
    assert NAME in out["methods"] and len(out["methods"][NAME]["answers"]) == len(out["retain"])
    every = keeps(model, processor, Image.open(SCENE), PROMPT, hap.HAPConfig(retain=0.2, first_layers=0),
                  max_new_tokens=2)
    ours = every.methods[NAME]
    assert NAME not in every.refused and ours.cut_layer == 0 and 0 < len(ours.kept) < 144


def test_analyze_offers_it(own):
    from app.app import build_demo, launch_options
    from app.present import OUTPUTS

    demo = build_demo([SHIPPED])
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options())
    try:
        out = Client(url, verbose=False).predict(image=handle_file(str(SCENE)), prompt=PROMPT, model_name=SHIPPED,
                                                 method=NAME, retain=0.2, first_layers=0, api_name="/analyze")
    finally:
        demo.close()
    summary = dict(zip(OUTPUTS, out))["summary"]
    assert summary["method"] == NAME and summary["runs"]["pruned"]["method"] == NAME
