"""HAP+'s relevance-diversity selection (`hap.diversity`, the `diversity` knob, docs/method.md §10): the budget kept
exactly, weight 0 = the relevance top-k, flat relevance = the greedy MAP of the DPP (by determinants), the gain of a
conditional DPP, detected sinks kept after every other token, the sink-ranking anchors, and the `hap` pruner reading the
hidden states entering its cut."""

import math

import pytest
import torch

import hap
from hap import diversity
from hap.scoring.fusion import select_top
from hap.pruners.hap import Hap
from tiny_models import llava_case

QUESTION = "what color is the circle ?"


def similarity(embeds: torch.Tensor) -> torch.Tensor:
    """The kernel S, cosine similarities [batch, N, N], computed independently in float64."""
    unit = embeds.double() / embeds.double().norm(dim=-1, keepdim=True)
    return unit @ unit.transpose(1, 2)


def _case(seed: int, batch: int = 3, n: int = 40, d: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, generator=g), torch.randn(batch, n, d, generator=g)


@pytest.mark.parametrize("k", [1, 7, 40])
@pytest.mark.parametrize("weight", [0.0, 0.5, 3.0])
def test_the_budget_is_kept_exactly_distinct_and_ascending(k, weight):
    scores, embeds = _case(0)
    scores[0, :5] = -math.inf  # masked sinks: still taken once the finite ones run out (k = 40)
    sink = torch.zeros(3, 40, dtype=torch.bool)
    sink[1, ::3] = True
    chosen = diversity.select(scores, embeds, k, weight, sink)
    assert chosen.shape == (3, k)
    for row in chosen.tolist():
        assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < 40
    with pytest.raises(ValueError, match=r"k=41 must be in \[1, 40\]"):
        diversity.select(scores, embeds, 41, weight)


def test_weight_zero_is_the_relevance_top_k_ties_by_position():
    scores, embeds = _case(1)
    scores[:, 10:20] = 0.25  # ten tied tokens straddle the cut at k = 12
    scores[2] = torch.linspace(1, 0, 40)
    for k in (3, 12, 25):
        assert torch.equal(diversity.select(scores, embeds, k, 0.0), select_top(scores, k))


def greedy_logdet(kernel: torch.Tensor, k: int, quality: torch.Tensor | None = None) -> list[int]:
    """Greedy MAP by determinants: each step adds the token maximising log det of L = diag(q) S diag(q) restricted to
    the picks (first maximum on ties)."""
    S = kernel.clone().fill_diagonal_(1.0)  # cos(h, h) = 1 exactly: the first step's tie is a true tie
    L = S if quality is None else quality[:, None] * S * quality[None, :]
    picks = []
    for _ in range(k):
        gains = [torch.logdet(L[picks + [j]][:, picks + [j]].double()) if j not in picks else -math.inf
                 for j in range(len(L))]
        picks.append(int(torch.tensor(gains).argmax()))
    return sorted(picks)


@pytest.mark.parametrize("weight", [0.3, 1.0])
def test_flat_relevance_is_the_greedy_map_of_the_similarity_dpp(weight):
    _, embeds = _case(2)
    flat = torch.full((3, 40), 0.7)
    chosen = diversity.select(flat, embeds, 9, weight)
    assert chosen.tolist() == [greedy_logdet(S, 9) for S in similarity(embeds)]
    assert not torch.equal(chosen, select_top(flat, 9))  # the diversity rule, not the positional tie order


def test_each_step_is_the_conditional_dpps_greedy_step():
    """r + w log d is, times 1 / w, the log-determinant gain of L = diag(q) S diag(q) with q = exp(r / 2w)."""
    scores, embeds = _case(5)
    for weight in (0.2, 1.0):
        quality = (diversity.rescaled(scores).double() / (2 * weight)).exp()
        assert diversity.select(scores, embeds, 8, weight).tolist() == [
            greedy_logdet(S, 8, q) for S, q in zip(similarity(embeds), quality)]


def test_diversity_keeps_the_outlier_that_relevance_ranks_low():
    """Tokens 0 and 1 point nearly the same way and are the most relevant; token 2 is orthogonal and less relevant."""
    embeds = torch.tensor([[[1.0, 0.0], [1.0, 0.05], [0.0, 1.0], [0.9, 0.1]]])
    scores = torch.tensor([[1.0, 0.9, 0.2, 0.0]])
    assert diversity.select(scores, embeds, 2, 0.0).tolist() == [[0, 1]]
    # beside token 0, r + w log d is 0.9 + w log 0.0025 for token 1, 0.2 + w log 1 for token 2: token 2 from w ~ 0.12
    assert diversity.select(scores, embeds, 2, 0.1).tolist() == [[0, 1]]
    assert diversity.select(scores, embeds, 2, 0.25).tolist() == [[0, 2]]


def test_a_detected_sink_is_kept_after_every_other_token():
    """Token 3 is a massive outlier (another direction, 100 x the norm)."""
    embeds = torch.tensor([[[1.0, 0, 0, 0], [1.0, 0.1, 0, 0], [0.9, 0.2, 0.1, 0], [0, 0, 0, 100.0]]])
    scores = torch.tensor([[1.0, 0.6, 0.5, 0.1]])
    assert diversity.select(scores, embeds, 2, 1.0).tolist() == [[0, 3]]
    sink = torch.tensor([[False, False, False, True]])
    assert diversity.select(scores, embeds, 2, 1.0, sink).tolist() == [[0, 2]]
    # even the most relevant: a sink is kept after every other token, unless the weight is 0
    assert diversity.select(scores.flip(-1), embeds, 3, 1.0, sink).tolist() == [[0, 1, 2]]
    assert diversity.select(scores.flip(-1), embeds, 4, 1.0, sink).tolist() == [[0, 1, 2, 3]]
    assert diversity.select(scores.flip(-1), embeds, 1, 0.0, sink).tolist() == [[3]]


def test_sink_ranking_anchors_come_first_and_masked_sinks_last():
    scores, embeds = _case(3, batch=1, n=10)
    anchored = scores.clone()
    anchored[0, 4] = math.inf  # mask_keep_one's anchor
    anchored[0, [0, 1, 2]] = -math.inf  # masked sinks
    assert 4 in diversity.select(anchored, embeds, 1, 5.0)[0].tolist()
    assert set(diversity.select(anchored, embeds, 7, 5.0)[0].tolist()) == set(range(3, 10))
    rescaled = diversity.rescaled(torch.tensor([[3.0, math.inf, -math.inf, 1.0, 2.0], [2.0, 2.0, 2.0, 2.0, 2.0]]))
    assert rescaled.tolist() == [[1.0, math.inf, -math.inf, 0.0, 0.5], [0.0] * 5]


def test_priority_ranks_first_as_in_select_top():
    scores, embeds = _case(4, batch=2, n=20)
    priority = torch.zeros(2, 20)
    priority[:, [3, 17]] = 1.0
    chosen = diversity.select(scores, embeds, 5, 1.0, priority=priority)
    assert all({3, 17} <= set(row) for row in chosen.tolist())
    assert torch.equal(diversity.select(scores, embeds, 5, 0.0, priority=priority),
                       select_top(scores, 5, priority))


def test_the_paper_preset_has_no_diversity_and_the_pruner_reads_embeds_only_with_it():
    assert hap.HAPConfig.paper().diversity == 0.0
    assert not Hap.from_config(hap.HAPConfig(diversity=0.0)).embeds
    assert Hap.from_config(hap.HAPConfig(diversity=0.5)).embeds
    with pytest.raises(ValueError, match="diversity"):
        hap.HAPConfig(diversity=-0.1)


@torch.no_grad()
def test_the_hap_pruner_selects_on_the_hidden_states_entering_its_cut(monkeypatch):
    """A cut before layer 0 with merge none (so only the diversity weight asks for the hidden states): it keeps what
    `hap.diversity.select` keeps on its relevance and the decoder's input embeddings of the visual tokens."""
    model, make_inputs = llava_case(layers=2)
    inputs = make_inputs([QUESTION], None)
    seen = []
    scores = Hap.scores
    monkeypatch.setattr(Hap, "scores", lambda self, state, cut: seen.append(scores(self, state, cut)) or seen[-1])
    config = hap.HAPConfig(retain=0.3, first_layers=0, groups=1, merge="none", diversity=1.0)
    with hap.patched(model, config) as patch:
        model(**inputs)
    kept = patch.state.cuts[0].kept[0].tolist()
    h = model(**inputs, output_hidden_states=True).hidden_states[0][0]  # [T, D] the decoder's input
    vis = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    k = patch.state.schedule.kept[0]
    expected = diversity.select(seen[0], h[vis][None], k, 1.0)[0].tolist()
    assert len(kept) == k and kept == expected
    assert kept != select_top(seen[0], k)[0].tolist()  # the diversity term changed the kept set


def test_the_cpu_selection_in_numpy_picks_as_the_batched_torch_one():
    """On a CPU `select` picks one sample at a time in numpy (`_picks`); an accelerator's tensors take the batched torch
    loop (`_picks_batched`). The same picks on random batches with +-inf relevance, detected sinks, a priority, tied
    relevance and near-duplicate hidden states."""
    torch.manual_seed(0)
    for trial in range(12):
        batch, n, d = (1, 3)[trial % 2], (40, 144)[trial % 3 == 0], 16
        relevance, embeds = torch.randn(batch, n), torch.randn(batch, n, d)
        if trial % 3 == 1:  # near-duplicates, ties
            embeds = torch.randn(batch, 6, d)[:, torch.randint(0, 6, (n,))] + 1e-5 * torch.randn(batch, n, d)
            relevance = relevance.round(decimals=1)
        relevance[:, 3], relevance[:, 5] = torch.inf, -torch.inf
        sink = torch.rand(batch, n) < 0.1
        priority = torch.randint(0, 2, (batch, n)).float() if trial % 4 == 0 else None
        r = diversity.rescaled(relevance)
        rank = torch.where(r.isfinite(), 2, torch.where(r > 0, 3, 0)).float()
        rank = torch.where(sink & r.isfinite(), 1.0, rank)
        unit = torch.nn.functional.normalize(embeds.double(), dim=-1)
        for k in (1, 7, n // 3):
            batched = diversity._picks_batched(r.nan_to_num(0.0, 0.0, 0.0), rank, unit, k, 0.25, priority)
            assert torch.equal(diversity.select(relevance, embeds, k, 0.25, sink, priority), batched.sort(-1).values)
