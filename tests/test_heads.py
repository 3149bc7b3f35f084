"""Planted sink / dispersed / focused heads: classification, PAQ order, and fusion vs averaging."""

import math

import torch

from hap.fusion import fusion_weights, group_map, head_fusion, layer_shares, select_top, token_scores
from hap.heads import head_stats, classify, sink_tokens

N, P = 64, 5
SINKS = [0, 1]  # two massive-activation tokens
REGION = [40, 41, 48, 49]  # the region the prompt asks about
DISTRACTOR = [10, 11, 12, 13, 18, 19, 20, 21]  # a salient region the prompt does not ask about


def _rows(weights: torch.Tensor, visual_share: float = 0.8) -> torch.Tensor:
    """[P, N] prompt rows with the given visual distribution and visual share (rest on text keys)."""
    w = weights / weights.sum()
    return (visual_share * w).expand(P, N).clone()


def planted_layer() -> tuple[torch.Tensor, torch.Tensor]:
    """attn [1, 4, P, N] with heads: sink, dispersed, focused, distracted; sink mask [1, N]."""
    sink = torch.full((N,), 0.02)
    sink[SINKS] = 10.0
    dispersed = torch.ones(N)
    focused = torch.full((N,), 0.01)
    focused[REGION] = 5.0
    distracted = torch.full((N,), 0.05)
    distracted[DISTRACTOR] = 1.0
    distracted[REGION] = 0.5
    attn = torch.stack([_rows(sink), _rows(dispersed), _rows(focused), _rows(distracted)])[None]
    mask = torch.zeros(1, N, dtype=torch.bool)
    mask[0, SINKS] = True
    return attn, mask


def test_sink_detector_finds_massive_activations():
    hidden = torch.randn(1, N, 32)
    hidden[0, SINKS] *= 100
    assert sink_tokens(hidden, rho=10.0)[0].nonzero().flatten().tolist() == SINKS


def test_planted_heads_are_classified_and_paq_orders_them():
    attn, sink = planted_layer()
    stats = head_stats(attn, torch.ones(1, P, dtype=torch.bool), sink)
    assert classify(stats, tau_sink=0.5, tau_disp=0.9)[0][:3] == ["sink", "dispersed", "optimal"]
    paq = stats.paq[0]
    assert paq[2] > paq[1] and paq[2] > paq[0]
    assert torch.allclose(stats.visual_share[0], torch.full((4,), 0.8))
    assert stats.sink_share[0, 0] > 0.9 and stats.dispersion[0, 1] > 0.99


def test_invalid_rows_do_not_count():
    attn, sink = planted_layer()
    attn[:, :, -1] = attn[:, 1:2, -1]  # make the last row of every head dispersed...
    valid = torch.ones(1, P, dtype=torch.bool)
    valid[0, -1] = False  # ...but it is padding
    stats = head_stats(attn, valid, sink)
    assert classify(stats, 0.5, 0.9)[0][:3] == ["sink", "dispersed", "optimal"]


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
