"""Fusion and selection (docs/method.md §5, §6): PAQ-softmax weights, head and layer fusion, scores, top-k."""

import math

import pytest
import torch

from hap.scoring.fusion import fuse, fusion_weights, group_map, head_fusion, layer_shares, select_top, token_scores
from hap.scoring.heads import head_stats
from test_heads import N, P, REGION, planted_layer


def test_paq_fusion_ranks_the_planted_region_first_where_averaging_does_not():
    attn, sink = planted_layer()
    valid = torch.ones(1, P, dtype=torch.bool)
    paq = head_stats(attn, valid, sink).paq  # [1, 4]
    group = attn[:, None]  # one layer: [1, 1, 4, P, N]
    hap = token_scores(group_map(group, paq[:, None], temperature=0.1), valid)
    uniform = token_scores(group_map(group, paq[:, None], temperature=math.inf), valid)
    assert sorted(select_top(hap, len(REGION))[0].tolist()) == REGION
    assert set(select_top(uniform, len(REGION))[0].tolist()) != set(REGION)


def test_group_map_factors_into_head_then_layer_fusion():
    torch.manual_seed(0)
    attn = torch.rand(2, 3, 4, P, N)  # [batch, layers, heads, P, N]
    paq = torch.rand(2, 3, 4)
    T = 0.3
    direct = group_map(attn, paq, T)
    per_layer = head_fusion(attn, paq, T)  # [2, 3, P, N]
    beta = layer_shares(paq, T)  # [2, 3]
    assert torch.allclose(direct, (per_layer * beta[..., None, None]).sum(1), atol=1e-6)
    assert torch.allclose(fusion_weights(paq, T).sum((1, 2)), torch.ones(2))
    assert torch.allclose(group_map(attn, paq, math.inf), attn.mean((1, 2)), atol=1e-6)


def test_selection_breaks_ties_by_position_and_keeps_order():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]])
    assert select_top(scores, 3).tolist() == [[1, 2, 4]]
    assert select_top(scores, 4).tolist() == [[1, 2, 4, 5]]


def test_token_scores_are_the_l2_norm_over_the_valid_rows_only():
    fused = torch.tensor([[[3.0, 0.0], [4.0, 1.0], [100.0, 100.0]]])  # [1, P=3, V=2]
    valid = torch.tensor([[True, True, False]])
    assert token_scores(fused, valid).tolist() == [[5.0, 1.0]]


def test_fuse_is_the_weighted_sum_and_weights_sum_to_one_per_sample():
    attn = torch.arange(24.0).view(1, 2, 3, 2, 2)  # [batch, layers, heads, P, V]
    w = torch.tensor([[[0.5, 0.0, 0.0], [0.0, 0.0, 0.5]]])
    assert torch.equal(fuse(attn, w), 0.5 * attn[:, 0, 0] + 0.5 * attn[:, 1, 2])
    paq = torch.tensor([[[0.0, math.log(3.0) * 0.1]]])  # softmax(PAQ / 0.1) = [1/4, 3/4]
    assert torch.allclose(fusion_weights(paq, 0.1), torch.tensor([[[0.25, 0.75]]]))


@pytest.mark.parametrize("k", [0, 7])
def test_selection_refuses_a_k_out_of_range(k):
    with pytest.raises(ValueError, match=f"k={k} must be in"):
        select_top(torch.rand(1, 6), k)


def test_select_top_ranks_by_priority_then_score():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3, 0.7]])
    priority = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]])
    assert select_top(scores, 3, priority).tolist() == [[0, 1, 3]]  # both prioritised, then the best score
    assert select_top(scores, 1, priority).tolist() == [[3]]  # among equal priority: the higher score
    assert select_top(scores, 3, torch.zeros(1, 5)).tolist() == select_top(scores, 3).tolist()


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 5e-324])
def test_tiny_temperatures_weight_the_best_head_not_nan(temperature):
    """Review finding: PAQ / 1e-39 overflows float32, softmax gave NaN weights and select_top kept the first k by
    position. softmax(PAQ / T) -> 0 is one-hot on the best head; the scores follow that head."""
    paq = torch.tensor([[[0.2, 0.9, 0.5]]])
    w = fusion_weights(paq, temperature)
    assert torch.equal(w, torch.tensor([[[0.0, 1.0, 0.0]]]))
    attn = torch.zeros(1, 1, 3, 1, 6)
    attn[0, 0, 1, 0, 4] = attn[0, 0, 1, 0, 5] = 1.0  # the best head looks at the last two tokens
    chosen = select_top(token_scores(group_map(attn, paq, temperature), torch.ones(1, 1, dtype=torch.bool)), 2)
    assert chosen.tolist() == [[4, 5]]
    assert not head_fusion(attn, paq, temperature).isnan().any()
