"""Methods as scoring policies (docs/method.md §7): what each one scores with, and its scores."""

import math

import pytest
import torch

from hap import HAPConfig
from hap.fusion import fusion_weights, group_map, token_scores
from hap.methods import Policy, cut_scores, head_weights, policy_for, rank_sinks, scoring_layers


@pytest.mark.parametrize(
    "method, expected",
    [("hap", Policy(4, "last", False, 0.3, merge="proportional")), ("uniform", Policy(4, "last", True, math.inf)),
     ("pdrop", Policy(4, "last", False, math.inf, lookahead=True, renumber=True)), ("fastv", Policy(1, "last", False, math.inf)),
     ("pdrop_ours", Policy(4, "last", False, math.inf)),
     ("random", Policy(4, "last", False, math.inf, random=True)), ("none", Policy(0, "last", True, math.inf))],
)
def test_each_method_is_a_policy(method, expected):
    assert policy_for(HAPConfig(method=method, groups=4, rows="last", temperature=0.3)) == expected


def test_prompt_rows_are_kept_for_hap_and_uniform_only():
    hap, uniform = (HAPConfig(method=m, rows="prompt") for m in ("hap", "uniform"))
    assert policy_for(hap).rows == policy_for(uniform).rows == "prompt"
    assert policy_for(HAPConfig(method="pdrop", rows="prompt")).rows == "last"
    assert policy_for(HAPConfig(method="fastv", rows="prompt")).rows == "last"


def test_scoring_layers():
    hap, pdrop, rnd = (policy_for(HAPConfig.paper(method=m)) for m in ("hap", "pdrop", "random"))
    assert scoring_layers(hap, (2, 5)) == [2, 3, 4] and scoring_layers(pdrop, (2, 5)) == [5]  # the next layer
    assert scoring_layers(policy_for(HAPConfig(score_layers="last")), (2, 5)) == [4]
    assert scoring_layers(hap, (0, 0)) == [0]  # a cut before layer 0 looks ahead at layer 0
    assert scoring_layers(rnd, (2, 5)) == []


def test_cut_scores_fuse_with_the_policy_temperature():
    torch.manual_seed(0)
    attn, paq, valid = torch.rand(1, 2, 3, 4, 10), torch.rand(1, 2, 3), torch.ones(1, 4, dtype=torch.bool)
    mu = torch.rand(1, 2, 3)
    for method, T in (("hap", 0.1), ("uniform", math.inf)):
        policy = policy_for(HAPConfig(method=method))
        got = cut_scores(policy, attn, head_weights(policy, paq, mu), valid, 10, seed=0, cut_index=0)
        torch.testing.assert_close(got, token_scores(group_map(attn, paq, T), valid))


def test_visual_share_head_weights_multiply_by_mu():
    """head_weight="paq_visual": w ~ mu exp(PAQ / T) over every (layer, head) of the cut (docs/method.md §10)."""
    paq, mu = torch.tensor([[[0.9, 0.5, 0.5]]]), torch.tensor([[[0.002, 0.3, 0.1]]])
    w = head_weights(policy_for(HAPConfig(head_weight="paq_visual", temperature=0.1)), paq, mu)
    expected = mu * torch.exp(paq / 0.1)
    torch.testing.assert_close(w, expected / expected.sum())
    assert w[0, 0, 0] < w[0, 0, 1]  # a sharp head that barely looks at the image no longer wins
    assert torch.equal(head_weights(policy_for(HAPConfig()), paq, mu), fusion_weights(paq, 0.1))
    assert not policy_for(HAPConfig(method="uniform", head_weight="paq_visual")).visual_weights  # HAP's knob


def test_rank_sinks():
    scores = torch.tensor([[0.5, 0.25, 0.75, 0.125], [0.5, 0.25, 0.75, 1.0]])
    sink = torch.tensor([[True, False, True, False], [False, False, False, False]])
    assert torch.equal(rank_sinks(scores, sink, "keep"), scores)
    masked = rank_sinks(scores, sink, "mask")
    assert masked[0].tolist() == [-math.inf, 0.25, -math.inf, 0.125] and torch.equal(masked[1], scores[1])
    one = rank_sinks(scores, sink, "mask_keep_one")
    assert one[0].tolist() == [-math.inf, 0.25, math.inf, 0.125] and torch.equal(one[1], scores[1])


def test_random_scores_depend_on_the_seed_and_the_cut_only():
    policy = policy_for(HAPConfig(method="random"))
    valid = torch.ones(2, 1, dtype=torch.bool)
    a = cut_scores(policy, None, None, valid, 10, seed=3, cut_index=1)
    assert a.shape == (2, 10) and torch.equal(a[0], a[1])
    assert torch.equal(a, cut_scores(policy, None, None, valid, 10, seed=3, cut_index=1))
    assert not torch.equal(a, cut_scores(policy, None, None, valid, 10, seed=3, cut_index=2))
    assert not torch.equal(a, cut_scores(policy, None, None, valid, 10, seed=4, cut_index=1))
