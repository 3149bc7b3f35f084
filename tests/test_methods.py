"""Methods as pruners on one executor (docs/method.md §7): the registry, what each one scores with, and its scores."""

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hap import HAPConfig
from hap.scoring.fusion import fusion_weights, group_map, token_scores
from hap.knobs import knob
from hap.pruners import METHODS, pruner_class, pruner_for
from hap.pruners.base import Cut, rank_sinks
from hap.pruners.fastv import FastV
from hap.pruners.hap import Hap
from hap.pruners.none import NoPruning
from hap.pruners.pdrop import PDrop
from hap.pruners.pdrop_ours import PDropOurs
from hap.pruners.random import Random
from hap.pruners.uniform import Uniform


@pytest.mark.parametrize(
    "method, expected",
    [("hap", Hap(4, "last", False, 0.3, merge="proportional", diversity=knob("diversity").default)), ("uniform", Uniform(4, "last", True, math.inf)),
     ("pdrop", PDrop(4, "last")), ("fastv", FastV(1, "last")), ("pdrop_ours", PDropOurs(4, "last")),
     ("random", Random(4, "last")), ("none", NoPruning(0, "last"))],
)
def test_each_method_is_a_pruner(method, expected):
    assert pruner_for(HAPConfig(method=method, groups=4, rows="last", temperature=0.3)) == expected


def test_the_registry_names_each_module_and_feeds_the_method_knob():
    """One registry: the method knob's choices are its names, each name its module's, whose PRUNER carries it."""
    assert knob("method").choices == METHODS
    folder = Path(__file__).parent.parent / "hap" / "pruners"
    for method in METHODS:
        assert (folder / f"{method}.py").exists() and pruner_class(method).name == method
    with pytest.raises(ValueError, match="method='nope' is not allowed; choose one of hap, uniform"):
        pruner_class("nope")
    tree = ast.parse((folder / "__init__.py").read_text())  # the registry imports no pruner module
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module != "base"]


def test_prompt_rows_are_kept_for_hap_and_uniform_only():
    hap, uniform = (HAPConfig(method=m, rows="prompt") for m in ("hap", "uniform"))
    assert pruner_for(hap).rows == pruner_for(uniform).rows == "prompt"
    assert pruner_for(HAPConfig(method="pdrop", rows="prompt")).rows == "last"
    assert pruner_for(HAPConfig(method="fastv", rows="prompt")).rows == "last"


def test_scoring_layers():
    hap, pdrop, rnd = (pruner_for(HAPConfig.paper(method=m)) for m in ("hap", "pdrop", "random"))
    assert hap.scoring_layers((2, 5)) == [2, 3, 4] and pdrop.scoring_layers((2, 5)) == [5]  # the next layer
    assert pruner_for(HAPConfig(score_layers="last")).scoring_layers((2, 5)) == [4]
    assert hap.scoring_layers((0, 0)) == [0]  # a cut before layer 0 looks ahead at layer 0
    assert pruner_for(HAPConfig(first_cut="vision")).scoring_layers((0, 0)) == []  # the [CLS] attention scores it
    assert rnd.scoring_layers((2, 5)) == []


def _state(seed: int = 0, batch: int = 1, visual: int = 10, rows: int = 4):
    """What a pruner's `scores` reads of a prefill's state."""
    return SimpleNamespace(config=SimpleNamespace(seed=seed), row_valid=torch.ones(batch, rows, dtype=torch.bool),
                           visual_pos=torch.zeros(batch, visual, dtype=torch.long))


def test_cut_scores_fuse_with_the_pruner_temperature():
    torch.manual_seed(0)
    attn, paq = torch.rand(1, 2, 3, 4, 10), torch.rand(1, 2, 3)
    mu = torch.rand(1, 2, 3)
    for method, T in (("hap", 0.1), ("uniform", math.inf)):
        pruner = pruner_for(HAPConfig(method=method))
        sink = torch.zeros(1, 10, dtype=torch.bool)
        got = pruner.scores(_state(), Cut(0, attn=attn, weights=pruner.head_weights(paq, mu, [0, 1]), sink=sink))
        torch.testing.assert_close(got, token_scores(group_map(attn, paq, T), _state().row_valid))


def test_visual_share_head_weights_multiply_by_mu():
    """head_weight="paq_visual": w ~ mu exp(PAQ / T) over every (layer, head) of the cut (docs/method.md §10)."""
    paq, mu = torch.tensor([[[0.9, 0.5, 0.5]]]), torch.tensor([[[0.002, 0.3, 0.1]]])
    w = pruner_for(HAPConfig(head_weight="paq_visual", temperature=0.1)).head_weights(paq, mu, [0])
    expected = mu * torch.exp(paq / 0.1)
    torch.testing.assert_close(w, expected / expected.sum())
    assert w[0, 0, 0] < w[0, 0, 1]  # a sharp head that barely looks at the image no longer wins
    assert torch.equal(pruner_for(HAPConfig()).head_weights(paq, mu, [0]), fusion_weights(paq, 0.1))
    uniform = pruner_for(HAPConfig(method="uniform", head_weight="paq_visual"))  # HAP's knob
    assert torch.equal(uniform.head_weights(paq, mu, [0]), fusion_weights(paq, math.inf))


def test_rank_sinks():
    scores = torch.tensor([[0.5, 0.25, 0.75, 0.125], [0.5, 0.25, 0.75, 1.0]])
    sink = torch.tensor([[True, False, True, False], [False, False, False, False]])
    assert torch.equal(rank_sinks(scores, sink, "keep"), scores)
    masked = rank_sinks(scores, sink, "mask")
    assert masked[0].tolist() == [-math.inf, 0.25, -math.inf, 0.125] and torch.equal(masked[1], scores[1])
    one = rank_sinks(scores, sink, "mask_keep_one")
    assert one[0].tolist() == [-math.inf, 0.25, math.inf, 0.125] and torch.equal(one[1], scores[1])


def test_random_scores_depend_on_the_seed_and_the_cut_only():
    pruner = pruner_for(HAPConfig(method="random"))
    a = pruner.scores(_state(3, batch=2), Cut(1))
    assert a.shape == (2, 10) and torch.equal(a[0], a[1])
    assert torch.equal(a, pruner.scores(_state(3, batch=2), Cut(1)))
    assert not torch.equal(a, pruner.scores(_state(3, batch=2), Cut(2)))
    assert not torch.equal(a, pruner.scores(_state(4, batch=2), Cut(1)))
