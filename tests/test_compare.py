"""hap.runs.compare: the stock model, the chosen method (traced) and uniform averaging at the same budget."""

import pytest
import torch

import hap
from hap.runs.compare import compare
from tiny_models import noise_image, tiny_llava

PROMPT = "what color is the circle ?"


@pytest.fixture(scope="module")
def model():
    return tiny_llava(layers=4)


def test_three_runs_at_one_budget(model):
    stages = []
    c = compare(*model, noise_image(), PROMPT, hap.HAPConfig(retain=0.3), max_new_tokens=2,
                on_stage=lambda fraction, text: stages.append(fraction))
    assert stages == [0.15, 0.45, 0.65]
    assert [(label, r.method) for label, r in c.items()] == [("unpruned", "none"), ("pruned", "hap"),
                                                             ("uniform", "uniform")]
    assert c.unpruned.flops_ratio == 1.0 and c.unpruned.groups == []
    assert c.uniform.visual_per_layer == c.pruned.visual_per_layer and c.pruned.retain < 0.31
    assert not torch.isnan(c.pruned.paq).any()  # traced: every layer captured
    assert torch.isnan(c.uniform.maps.layer).all()  # the references are not traced


@pytest.mark.parametrize("method, same", [("none", "unpruned"), ("uniform", "uniform")])
def test_a_run_the_method_already_is_is_not_repeated(model, method, same):
    c = compare(*model, noise_image(), PROMPT, hap.HAPConfig(method=method, retain=0.3), max_new_tokens=1)
    assert getattr(c, same) is c.pruned
