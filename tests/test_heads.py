"""Planted sink / dispersed / focused heads: the sink detector, head statistics, classification and PAQ order."""

import pytest
import torch

from hap.scoring.heads import head_stats, classify, sink_tokens

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


def test_head_stats_do_not_depend_on_how_little_a_head_looks_at_the_image():
    """A row holding 1e-20 of its head's attention on the image is scored by its shape, like the same row at 0.5."""
    torch.manual_seed(0)
    row = torch.rand(1, 2, 3, 8)
    row = row / row.sum(-1, keepdim=True)
    valid, sink = torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 8, dtype=torch.bool)
    sink[0, 2] = True
    big, tiny = head_stats(0.5 * row, valid, sink), head_stats(1e-20 * row, valid, sink)
    torch.testing.assert_close(tiny.dispersion, big.dispersion)
    torch.testing.assert_close(tiny.sink_share, big.sink_share)
    torch.testing.assert_close(tiny.sink_share, row[..., 2].mean(-1))


@pytest.mark.parametrize("tiny", [1e-31, 1e-40, 1e-45])
def test_a_row_with_almost_no_visual_mass_does_not_make_a_dispersed_head_focused(tiny):
    """Review finding: a row of per-token mass 1e-31 got an entropy near -69 (a 1e-30 floor on its mass), which
    dragged the head's dispersion below 0: a uniform head scored PAQ 1."""
    attn = torch.full((1, 1, 2, 8), 1 / 8)
    attn[0, 0, 1] = tiny  # the second row: uniform, with almost no mass on the image
    stats = head_stats(attn, torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 8, dtype=torch.bool))
    assert stats.dispersion.item() >= 0.5 and stats.paq.item() <= 0.5
    if tiny >= 1e-38:  # a normal float32: its row is exactly as dispersed as the first
        torch.testing.assert_close(stats.dispersion, torch.ones(1, 1))
