"""hap.runs.sweep: the budgets every method reaches on a decoder (no model), then a sweep on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from tiny_models import CASES, tiny_llava

import hap
from hap.runs.features import FeatureCache, reusing_features
from hap.runs.inputs import DEFAULT_LIMITS
from hap.runs.keeps import pruning
from hap.runs.run import prepare
from hap.runs.sweep import (AnswerEnd, answer_probability, budgets, grid_methods, keeps_everything, refused, short_answer,
                       smallest_retain, sweep)

LLAVA = hap.DecoderShape.mha(32, 4096, 11008)


def test_every_pruning_method_is_swept():
    assert pruning() == [m for m in hap.METHODS if m != "none"] and {"hap", "uniform", "fastv", "pdrop"} <= set(pruning())


@pytest.mark.parametrize(("first_layers", "floor"), [(2, 2 / 32), (0, 0.0)])
def test_the_smallest_budget_is_reached_by_every_method(first_layers, floor):
    low = smallest_retain(hap.HAPConfig(first_layers=first_layers), LLAVA, 576)
    assert floor < low < floor + 0.01  # the first K layers keep everything, the groups a token or so each
    for method in grid_methods():  # each one plans it, every group keeping at least one token
        assert min(hap.plan(hap.HAPConfig(method=method, first_layers=first_layers, retain=low), LLAVA, 576).kept) >= 1


def test_methods_a_model_refuses_are_named_and_leave_the_floor():
    """Qwen2-VL takes neither VisionZip nor AutoPrune (no [CLS] token) nor PyramidDrop and SparseVLM (renumbered M-RoPE
    positions): the sweep
    leaves them out with the adapter's reason, and its smallest budget is that of the methods it runs."""
    qwen, _ = CASES["qwen2-vl"]()
    assert set(refused(qwen, hap.HAPConfig())) == {"visionzip", "pdrop", "sparsevlm", "autoprune", "divprune",
                                                   "vispruner", "cdpruner", "scope", "holov", "prunesid", "hiprune",
                                                   "hawk"}  # hawk: these models carry no static head importance file
    assert not hasattr(qwen, "_hap")
    assert "[CLS]" in refused(qwen, hap.HAPConfig())["visionzip"]
    assert "python -m analysis.head_importance" in refused(qwen, hap.HAPConfig())["hawk"]
    assert set(refused(tiny_llava()[0], hap.HAPConfig())) == {"cdpruner", "hawk"}  # the default CLIP pairs with CLIP-L/336
    config, rest = hap.HAPConfig(first_layers=0), [m for m in grid_methods() if m != "visionzip"]
    assert smallest_retain(config, LLAVA, 576, rest) < smallest_retain(config, LLAVA, 576)  # VisionZip keeps 2


def test_official_schedules_leave_the_grid_and_are_out_of_reach_below_their_floor():
    """SparseVLM and AutoPrune cut after layer 0 at the earliest: on 32 layers their floor is above 1/32, so the grid
    goes lower without them and the sweep marks their lower budgets out of reach (None)."""
    config = hap.HAPConfig(first_layers=0)
    assert set(pruning()) - set(grid_methods()) == {"sparsevlm", "autoprune", "dart", "prunesid"}  # PruneSID: 4
    assert smallest_retain(config, LLAVA, 576) < 1 / 32 < smallest_retain(config, LLAVA, 576, ["sparsevlm"])
    model, processor = tiny_llava(layers=4)
    out = sweep(model, processor, Image.new("RGB", (64, 48), "teal"), "what color ?", config, 2, DEFAULT_LIMITS)
    for method in ("sparsevlm", "autoprune"):
        row = out["methods"][method]
        assert row["answers"][0] is not None and row["answers"][-1] is None and row["answer_prob"][-1] is None
    assert all(a is not None for a in out["methods"]["hap"]["answers"])


def test_budgets_run_from_everything_down_to_the_smallest():
    config = hap.HAPConfig(first_layers=2)
    retain = budgets(config, LLAVA, 576)
    assert len(retain) >= 6 and retain[0] == 1.0 and retain == sorted(retain, reverse=True)
    assert retain[-1] == pytest.approx(smallest_retain(config, LLAVA, 576))
    with pytest.raises(ValueError, match=r"first_layers=32 must be < the decoder's 32 layers"):
        budgets(hap.HAPConfig(first_layers=32), LLAVA, 576)


def test_answers_are_cut_at_their_end():
    assert short_answer("zero no no no no") == "zero no no" and short_answer("zero\nno no") == "zero"
    assert short_answer("  red. ") == "red." and short_answer("") == short_answer("\n") == ""
    assert short_answer("a b c d e", words=5) == "a b c d e"
    with pytest.raises(ValueError, match=r"words=0 must be at least 1"):
        short_answer("red", words=0)


def test_sweep_on_a_tiny_model_matches_direct_runs():
    model, processor = tiny_llava(layers=4)
    image = Image.new("RGB", (64, 48), "teal")
    config = hap.HAPConfig(first_layers=0, groups=2)
    out = sweep(model, processor, image, "what color ?", config, 3, DEFAULT_LIMITS)
    assert list(out["methods"]) == [m for m in pruning() if m not in out["refused"]] and len(out["retain"]) >= 6
    reference = hap.run(model, processor, image, "what color ?", hap.HAPConfig(method="none"), 3, trace=False)
    assert out["unpruned"]["answer"] == short_answer(reference.answer)
    ids = processor.tokenizer(short_answer(reference.answer), add_special_tokens=False).input_ids
    inputs = prepare(model, processor, image, "what color ?", 3, DEFAULT_LIMITS, ())
    for method in ("hap", "fastv"):
        cfg = hap.HAPConfig(method=method, first_layers=0, groups=2, retain=out["retain"][3])
        assert out["methods"][method]["answers"][3] == short_answer(hap.run(model, processor, image, "what color ?",
                                                                            cfg, 3, trace=False).answer)
        assert out["methods"][method]["answer_prob"][3] == pytest.approx(answer_probability(model, inputs, cfg, ids))
    assert answer_probability(model, inputs, config, []) is None


def test_every_probability_is_of_the_unpruned_answer(monkeypatch):
    """A planted bug scored each pruned run's own answer: the probability must be the unpruned answer's, whatever
    each pruned run answers (here every run answers something else)."""
    from hap.runs import sweep as sweep_module

    model, processor = tiny_llava(layers=4)
    real_run, forced = hap.run, []

    def run(model, processor, image, prompt, config, *args, **kwargs):
        result = real_run(model, processor, image, prompt, config, *args, **kwargs)
        result.answer = "red" if config.method == "none" else f"blue {config.method} {config.retain:.3f}"
        return result

    monkeypatch.setattr(hap, "run", run)
    monkeypatch.setattr(sweep_module, "answer_probability",
                        lambda model, p, config, answer_ids: forced.append(answer_ids) or 0.5)
    monkeypatch.setattr(sweep_module, "POINTS", 2)
    out = sweep(model, processor, Image.new("RGB", (64, 48), "teal"), "what color ?",
                hap.HAPConfig(first_layers=0, groups=2), 2, DEFAULT_LIMITS)
    red = processor.tokenizer("red", add_special_tokens=False).input_ids
    reached = sum(p is not None for m in out["methods"] for p in out["methods"][m]["answer_prob"])
    assert len(forced) == 1 + reached and all(ids == red for ids in forced)
    assert out["methods"]["hap"]["answers"][0].startswith("blue hap")


SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


@pytest.mark.slow
def test_the_shared_sweep_gives_the_unshared_answers_and_probabilities():
    """HAP_APP_SHARE's sweep (answers stopped at their end, probabilities read from the answer's own logits, the
    full-budget runs of the stock model reused, one vision pass) against the plain one, on the shipped model and a
    scene asked its own question: the same answers, the same probabilities (to float rounding)."""
    model, processor = hap.load_model(str(SHIPPED), device="cpu")
    image = Image.open(SHIPPED.parent / "examples" / "scene_600004.png")
    config = hap.HAPConfig()
    plain = sweep(model, processor, image, "how many blue objects ?", config, 8, DEFAULT_LIMITS)
    with reusing_features(model, FeatureCache()) as cache:
        shared = sweep(model, processor, image, "how many blue objects ?", config, 8, DEFAULT_LIMITS, shared=True)
    assert cache.misses == 1 and cache.hits > 20  # the VisionZip and AutoPrune runs read the tower themselves
    assert shared["retain"] == plain["retain"] and shared["refused"] == plain["refused"]
    assert shared["unpruned"]["answer"] == plain["unpruned"]["answer"]
    assert shared["unpruned"]["answer_prob"] == pytest.approx(plain["unpruned"]["answer_prob"], rel=1e-5)
    for method, row in plain["methods"].items():
        assert shared["methods"][method]["answers"] == row["answers"], method
        for got, want in zip(shared["methods"][method]["answer_prob"], row["answer_prob"], strict=True):
            assert (got is None) == (want is None) and (want is None or got == pytest.approx(want, rel=1e-5)), method


def test_the_full_budget_is_the_stock_model_only_where_nothing_is_dropped():
    shape = hap.DecoderShape.mha(6, 128, 384)
    for method in ("hap", "uniform", "fastv", "pdrop", "pdrop_ours", "random"):
        assert keeps_everything(hap.HAPConfig(method=method, retain=1.0), shape, 144, 12), method
        assert not keeps_everything(hap.HAPConfig(method=method, retain=0.9), shape, 144, 12), method
    for method in ("visionzip", "sparsevlm", "autoprune"):
        assert not keeps_everything(hap.HAPConfig(method=method, retain=1.0), shape, 144, 12), method
    # downsample writes its pooled tokens, which at a budget of every token are the tokens themselves
    assert keeps_everything(hap.HAPConfig(method="downsample", retain=1.0), shape, 144, 12)
    assert not keeps_everything(hap.HAPConfig(method="downsample", retain=0.9), shape, 144, 12)
    assert keeps_everything(hap.HAPConfig(method="none"), shape, 144, 12)


@pytest.mark.parametrize(("text", "done"), [("yellow", False), ("two blue", False), ("a b c", False),
                                            ("a b c d", True), ("yes\nno", True), ("\n\nyes", False)])
def test_an_answer_ends_after_its_third_word_or_its_line(text, done):
    _, processor = tiny_llava(layers=1)
    tok = processor.tokenizer
    prompt = tok("user : what ?", return_tensors="pt").input_ids
    ids = torch.cat([prompt, torch.tensor([tok(text, add_special_tokens=False).input_ids])], 1)
    stop = AnswerEnd(_Splitter(tok, text), prompt.shape[1])
    assert stop(ids, None).tolist() == [done]
    assert short_answer(text) == short_answer(text.split("\n")[0] if done and "\n" in text else text)


class _Splitter:
    """The tokenizer's decode, returning `text` itself (the word-level tokenizer has no line breaks)."""

    def __init__(self, tokenizer, text: str) -> None:
        self.text = text

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.text


def test_the_runs_share_the_layers_before_their_first_drop_or_rewrite():
    """`full_layers`: at a high budget HAP's first group keeps every token, so its runs share the layers up to its
    second cut; FastV drops at its cut; the official schedules and the methods that write tokens change the tokens at
    their first cut even where the count stays; a cut before layer 0 shares nothing."""
    from hap.runs.sweep import full_layers

    shape = hap.DecoderShape(24, 896, 4864, 128)
    hap_high = hap.HAPConfig(method="hap", retain=0.61)
    assert hap.plan(hap_high, shape, 729, 20).kept[0] == 729 and full_layers(hap_high, shape, 729, 20) == 9
    assert full_layers(hap.HAPConfig(method="hap", retain=0.3), shape, 729, 20) == 2
    assert full_layers(hap.HAPConfig(method="fastv", retain=0.61), shape, 729, 20) == 2
    assert full_layers(hap.HAPConfig(method="sparsevlm", retain=1.0), shape, 729, 20) == 3
    assert full_layers(hap.HAPConfig(method="divprune", retain=0.61), shape, 729, 20) == 0
