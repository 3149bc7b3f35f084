"""hap.utility: head utility against an independent computation (attention maps from the stock model, the cut as a
key mask), the fan-out of one input into variants, keep-all = unpruned, layer subsets, NaN last row, JSON."""

import math

import numpy as np
import pytest
import torch

import hap
from hap import utility
from hap.utility import default_keep, one_cut
from tiny_models import CASES, noise_image, tiny_llava

PROMPT = "what color is it ?"


def masked_cut_probs(model, inputs: dict, cut: int, kept: torch.Tensor, answer: int) -> float:
    """p(answer) when layers `cut`.. see only the visual tokens at `kept` (indices into the visual tokens): the
    dropped ones masked out as keys, every position unchanged; no pruner code involved."""
    ids = inputs["input_ids"][0]
    visual = (ids == model.config.image_token_id).nonzero().flatten()
    T = ids.shape[0]
    mask = torch.full((T, T), -math.inf).triu(1)
    dropped = torch.ones(len(visual), dtype=torch.bool)
    dropped[kept] = False
    mask[:, visual[dropped]] = -math.inf
    mask.fill_diagonal_(0.0)  # a dropped token still sees itself (its own row is never read)

    def later(module, args, kwargs):
        kwargs["attention_mask"] = mask[None, None]
        return args, kwargs

    layers = model.model.language_model.layers
    handles = [layer.register_forward_pre_hook(later, with_kwargs=True) for layer in layers[cut:]]
    try:
        with torch.no_grad():
            probs = model(**inputs, use_cache=False).logits[0, -1].float().softmax(-1)
    finally:
        for h in handles:
            h.remove()
    return float(probs[answer])


def top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def test_matches_an_independent_computation():
    """Every head's utility and both reference lines equal p(answer) with the head's top-k kept as a key mask, the
    head's map read from the stock model's own attention probabilities (eager, output_attentions)."""
    model, processor = tiny_llava("eager", layers=4)
    u = utility.utility(model, processor, noise_image(1), PROMPT, keep=12, batch_size=4)  # 6 rows: 2 forwards each
    inputs = hap.causal.prepare(model, processor, noise_image(1), PROMPT)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, use_cache=False)
    assert u.answer_token == int(out.logits[0, -1].argmax())
    visual = inputs["input_ids"][0] == model.config.image_token_id
    L, H = u.values.shape
    for l in range(L - 1):
        rows = out.attentions[l][0, :, -1, visual].float()  # [H, N] the last prompt row of each head
        for h in range(H):
            expected = masked_cut_probs(model, inputs, l + 1, top(rows[h], 12), u.answer_token)
            assert u.values[l, h].item() == pytest.approx(expected, abs=2e-6)
        weights = torch.softmax(u.paq[l] / hap.HAPConfig().temperature, 0)
        for reference, fused in ((u.uniform, rows.mean(0)), (u.paq_weighted, weights @ rows)):
            expected = masked_cut_probs(model, inputs, l + 1, top(fused, 12), u.answer_token)
            assert reference[l].item() == pytest.approx(expected, abs=2e-6)
    assert torch.isnan(u.values[L - 1]).all() and math.isnan(u.uniform[L - 1]) and not u.keeps[L - 1].any()
    assert u.scored == list(range(L - 1))


def test_keep_all_is_the_unpruned_model_and_the_defaults():
    model, processor = tiny_llava(layers=3)
    u = utility.utility(model, processor, noise_image(2), PROMPT, keep=144)
    torch.testing.assert_close(u.values[:2], torch.full((2, 4), u.answer_prob), atol=1e-6, rtol=0)
    assert bool(u.keeps[:2].all()) and bool(u.uniform_keeps[:2].all()) and bool(u.paq_keeps[:2].all())
    values = hap.head_utility(model, processor, noise_image(2), PROMPT)
    assert values.shape == (3, 4) and values.dtype == torch.float32 and torch.isnan(values[2]).all()
    assert default_keep(144) == 16 and default_keep(576) == 64
    assert utility.utility(model, processor, noise_image(2), PROMPT).keep == 16
    with pytest.raises(ValueError, match="keep"):
        hap.head_utility(model, processor, noise_image(2), PROMPT, keep=145)
    with pytest.raises(ValueError, match="layers"):
        hap.head_utility(model, processor, noise_image(2), PROMPT, layers=[3])
    with hap.patched(model, hap.HAPConfig()), pytest.raises(ValueError, match="unpatch"):
        hap.head_utility(model, processor, noise_image(2), PROMPT)


def test_a_layer_subset_equals_the_full_rows():
    model, processor = tiny_llava(layers=4)
    full = utility.utility(model, processor, noise_image(3), PROMPT, rows="prompt")
    part = utility.utility(model, processor, noise_image(3), PROMPT, rows="prompt", layers=[2, 0, 3], batch_size=1)
    assert part.scored == [0, 2]
    for l in (0, 2):
        torch.testing.assert_close(part.values[l], full.values[l], atol=1e-6, rtol=0)
        assert part.uniform[l] == pytest.approx(float(full.uniform[l]), abs=1e-6)
    assert torch.isnan(part.values[1]).all() and torch.isnan(part.values[3]).all()
    assert not torch.equal(full.values[0], full.values[1])  # the heads and layers do differ on random weights


@pytest.mark.parametrize("case", ["llava", "llava-qwen2", "qwen2-vl"])
def test_a_fanned_out_input_equals_one_run_per_variant(case):
    """A batch-1 input with a priority of several rows: each row's logits as if run alone."""
    model, make = CASES[case]()
    inputs = make([PROMPT])
    N = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    priority = torch.zeros(3, N).scatter_(1, torch.rand(3, N, generator=torch.Generator().manual_seed(0)).argsort(1)[
        :, :5], 1.0)
    cut = one_cut(2, 5, N, 4)
    with torch.no_grad():
        with hap.patched(model, cut, priority=priority) as patch:
            fanned = model(**inputs, logits_to_keep=1, use_cache=False).logits[:, -1]
        for row, logits in zip(priority, fanned):
            with hap.patched(model, cut, priority=row[None]):
                alone = model(**inputs, logits_to_keep=1, use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits, alone, atol=1e-5, rtol=0)
    assert patch.state.schedule.kept == [5]
    assert [sorted(c.tolist()) for c in patch.state.cuts[0].kept] == [sorted(r.nonzero().flatten().tolist())
                                                                       for r in priority]


def test_json_entry():
    model, processor = tiny_llava(layers=3)
    u = utility.utility(model, processor, noise_image(4), PROMPT, layers=[1])
    entry = utility.to_json(u)
    assert entry["keep"] == 16 and entry["values"][0] == [None] * 4 and entry["values"][2] == [None] * 4
    assert entry["values"][1] == pytest.approx(u.values[1].tolist())
    assert entry["uniform"][0] is None and entry["uniform"][1] == pytest.approx(float(u.uniform[1]))
    assert entry["paq_weighted"][1] == pytest.approx(float(u.paq_weighted[1]))
    assert entry["best_head"][1] == pytest.approx(max(u.values[1].tolist()))
    assert entry["answer_kept"] == {"best_head": int(u.keeps[1].any()), "uniform": int(u.uniform_keeps[1]),
                                    "paq_weighted": int(u.paq_keeps[1]), "cuts": 1}
    assert entry["spearman"] == pytest.approx(hap.causal.paq_spearman(u.paq, u.values))
    assert np.isfinite(entry["paq"][0]).all()  # PAQ of every layer; the utility of the scored ones
    assert entry["spearman_within_layers"] == pytest.approx(hap.causal.paq_spearman(u.paq[1], u.values[1]))


def test_within_layers_ranks_each_layers_heads_apart():
    """Utility rising with depth while PAQ ranks every layer's heads backwards: pooled Spearman positive, within
    layers -1; a layer with constant utility (saturated) or NaN (not scored) is left out."""
    paq = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [0.5, 0.5, 0.1]])
    values = np.array([[0.3, 0.2, 0.1], [0.6, 0.5, 0.4], [1.0, 1.0, 1.0], [np.nan] * 3])
    assert hap.causal.paq_spearman(paq, values) > 0.5
    assert utility.within_layers(paq, values) == pytest.approx(-1.0)
    assert utility.within_layers(paq[2:], values[2:]) is None



def test_auto_layers_all_on_a_small_model_else_before_the_cuts(monkeypatch):
    model, _ = tiny_llava(layers=4)
    assert utility.auto_layers(model, [2]) is None  # exact ablation is cheap: every layer
    monkeypatch.setattr(utility, "default_mode", lambda m: "attribution")  # as on a 7B model
    assert utility.auto_layers(model, [0, 2, 3]) == [1, 2]  # a cut before layer 0 has no layer before it
    assert utility.auto_layers(model, []) == [1]  # no cut (method none): the middle layer
