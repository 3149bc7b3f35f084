"""`hap.patch.prefix.sharing_layers`: the feed-forward blocks before a run's first cut computed once for every run of one
input, with the same numbers as without the block, and the model as it was after it."""

from __future__ import annotations

import pytest
import torch

import hap
from hap.patch.prefix import BLOCKS, sharing_layers
from tiny_models import inputs_for, qwen_vl_case, tiny_llava

RUNS = [("none", None), ("hap", 0.6), ("uniform", 0.4), ("fastv", 0.5), ("divprune", 0.4), ("hap", 0.45)]


@pytest.fixture(scope="module")
def llava():
    model, processor = tiny_llava(layers=6)
    return model, inputs_for(processor, ["what color is the square ?"])


def logits(model, inputs: dict, method: str, retain: float | None) -> torch.Tensor:
    """The last position's logits of one pruned prefill (first_layers 2: the cut enters layer 2)."""
    config = hap.HAPConfig(method=method, retain=retain, first_layers=2)
    with hap.patched(model, config), torch.inference_mode():
        return model(**inputs, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("case", ["llava", "qwen2_vl"])
def test_runs_give_the_same_logits_with_the_layers_before_their_cut_computed_once(case, llava):
    model, inputs = llava if case == "llava" else qwen_vl_case(layers=6)
    if case == "qwen2_vl":
        inputs = inputs(["what color is the square ?"], [0])
    runs = [(m, r) for m, r in RUNS if not (case == "qwen2_vl" and m == "divprune")]  # divprune refuses M-RoPE
    alone = [logits(model, inputs, m, r) for m, r in runs]
    with sharing_layers(model) as memo:
        shared = [logits(model, inputs, m, r) for m, r in runs]
    for (method, _), a, s in zip(runs, alone, shared):
        assert torch.equal(a, s), method  # bit for bit: an output is reused only for an equal input
    # layers 0 and 1 of every run after the first that sees every token there (divprune cuts before layer 0, so the
    # run after it recomputes them once)
    after_cut0 = 1 if case == "llava" else 0
    assert memo.hits == len(BLOCKS) * 2 * (len(runs) - 1 - 2 * after_cut0)


def test_decode_steps_and_autograd_passes_are_not_memoised(llava):
    model, inputs = llava
    with sharing_layers(model) as memo:
        with torch.inference_mode():
            model(**inputs)
            model(**inputs)
        assert (memo.hits, memo.misses) == (30, 30)  # the second prefill reads all six layers' five blocks
        stored = dict(memo.entries)
        with torch.inference_mode():
            step = model.model.language_model(inputs_embeds=torch.randn(1, 1, 64))
        assert step.last_hidden_state.shape == (1, 1, 64)
        assert memo.entries == stored and (memo.hits, memo.misses) == (30, 30)  # one token: computed, not kept
        model(**inputs).logits.sum().backward()  # autograd on: computed every time
        assert (memo.hits, memo.misses) == (30, 30)
    model.zero_grad(set_to_none=True)


def test_the_model_is_as_before_after_the_block_even_on_error_and_blocks_do_not_nest(llava):
    model, inputs = llava
    layers = model.model.language_model.layers
    wrapped = layers[1].mlp.forward
    layers[1].mlp.forward = lambda hidden: wrapped(hidden)  # an instance-level wrapper, as accelerate's hooks add
    own = vars(layers[1].mlp)["forward"]
    try:
        with pytest.raises(RuntimeError, match="boom"), sharing_layers(model):
            with pytest.raises(RuntimeError, match="do not nest"), sharing_layers(model):
                pass
            raise RuntimeError("boom")
        assert "forward" not in vars(layers[0].mlp) and vars(layers[1].mlp)["forward"] is own
        with sharing_layers(model) as memo, torch.inference_mode():  # the wrapper is wrapped in turn, and runs
            model(**inputs)
        assert memo.misses == 30 and vars(layers[1].mlp)["forward"] is own
    finally:
        del layers[1].mlp.forward


def test_only_the_first_depth_layers_are_memoised(llava):
    model, inputs = llava
    with sharing_layers(model, depth=2) as memo, torch.inference_mode():
        model(**inputs)
        model(**inputs)
    assert {layer for layer, _ in memo.entries} == {0, 1} and memo.hits == 2 * len(BLOCKS)
