"""Static head importance (docs/method.md §16): `hap.static_head_importance` against a plain loop over heads, the
file and its refusals, HAWK's kept set against its rule written here on tensors, and HAP's head_weight="static"."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import hap
from hap import causal
from hap.knobs import knob
from hap.pruners.hawk import hawk_scores
from hap.runs.run import template_tail
from hap.scoring import importance
from hap.scoring.capture import prompt_logits
from hap.scoring.fusion import select_top
from tests.tiny_models import noise_image, tiny_llava

QUESTIONS = ("what color is the square ?", "is there a red circle ?")


@pytest.fixture(scope="module")
def tiny():
    """A 4-layer LLaVA whose decoder has 4 query heads over 2 key/value heads (GQA)."""
    model, processor = tiny_llava(layers=4, kv_heads=2, seed=3)
    return model, processor


def weights_file(tmp_path, weights) -> str:
    path = tmp_path / "head_importance.json"
    importance.write(path, torch.as_tensor(weights, dtype=torch.float32), model="test")
    return str(path)


@torch.no_grad()
def test_static_importance_equals_a_plain_loop_over_heads(tiny):
    """Mean over items of max(0, log p(a) - log p(a | head zeroed)), rows normalised: the fast path (heads of a layer
    batched, the layers below skipped) gives what zeroing one head at a time in the whole model gives."""
    model, processor = tiny
    images = [noise_image(1), noise_image(2)]
    got = hap.static_head_importance(model, processor, images, list(QUESTIONS), batch_size=3)
    L, H = causal.head_layout(model)
    drops = torch.zeros(L, H, dtype=torch.float64)
    for image, question in zip(images, QUESTIONS):
        inputs = causal.prepare(model, processor, image, question)
        stock = causal.answer_log_probs(model, inputs, torch.ones(1, L, H))[0]
        answer = int(stock.argmax())
        for layer in range(L):
            for head in range(H):
                gates = torch.ones(1, L, H)
                gates[0, layer, head] = 0.0
                ablated = causal.answer_log_probs(model, inputs, gates)[0, answer]
                drops[layer, head] += max(0.0, float(stock[answer] - ablated))
    mean = drops / len(images)
    expected = torch.where(mean.sum(-1, keepdim=True) > 0, mean / mean.sum(-1, keepdim=True), mean)
    assert got.shape == (L, H)
    assert (got >= 0).all() and (got.sum(-1) > 0).any()
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-5, rtol=1e-4)
    assert [f.__name__ for f in [layer.forward for layer in causal.decoder_of(model).layers]] == ["forward"] * L


def test_static_importance_refuses_unequal_lists(tiny):
    with pytest.raises(ValueError, match="as many prompts as images"):
        hap.static_head_importance(*tiny, [noise_image(1)], [])


def test_row_normalised_keeps_a_row_of_zeros():
    got = importance.row_normalised(torch.tensor([[1.0, 3.0], [0.0, 0.0]]))
    assert torch.equal(got, torch.tensor([[0.25, 0.75], [0.0, 0.0]]))


def test_without_a_file_static_methods_refuse_naming_the_command(tiny):
    model, processor = tiny
    for config, who in ((hap.HAPConfig(method="hawk", retain=0.2), "method='hawk'"),
                        (hap.HAPConfig(head_weight="static", retain=0.2), "head_weight='static'")):
        with pytest.raises(ValueError, match="python -m analysis.head_importance") as err:
            hap.run(model, processor, noise_image(1), QUESTIONS[0], config)
        assert who in str(err.value)
    assert not hasattr(model, "_hap")  # the model is left unpatched


def test_a_bad_file_is_refused_by_name(tiny, tmp_path):
    model, processor = tiny
    wrong = weights_file(tmp_path, torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"3 layers x 4 heads; this model's decoder has 4 x 4"):
        hap.run(model, processor, noise_image(1), QUESTIONS[0], hap.HAPConfig(method="hawk", head_importance=wrong))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"weights": [[1, -1], [0, 1]]}))
    with pytest.raises(ValueError, match="finite number >= 0"):
        importance.read(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        importance.read(str(tmp_path / "missing.json"))


def test_the_knob_takes_an_empty_text_as_unset():
    assert knob("head_importance").check("") is None and knob("head_importance").check(None) is None
    assert hap.HAPConfig(head_importance=" ").head_importance is None


def test_a_model_folder_file_is_found(tmp_path):
    assert importance.model_file(str(tmp_path)) is None
    path = weights_file(tmp_path, torch.ones(2, 2))
    assert importance.model_file(str(tmp_path)) == path


def reference_hawk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, keep: int) -> list[int]:
    """HAWK's rule as its release writes it: q [1, H, P, d] of the question's rows, k [1, KV, V, d] of the visual
    tokens (pre-RoPE), grouped keys repeated to the query heads; q.k / sqrt(d) averaged over the rows, NaN -> 0,
    L2-normalised per head, summed with the weights over their sum; the top `keep` in their original order."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])).mean(2)
    scores = F.normalize(torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0), p=2, dim=-1)
    total = (scores * (weights / weights.sum()).view(1, -1, 1)).sum(1)[0]
    return sorted(torch.topk(total, keep).indices.tolist())


def test_hawk_scores_follow_the_released_rule_with_grouped_keys():
    torch.manual_seed(0)
    H, KV, P, V, d = 8, 2, 5, 30, 16
    q, k = torch.randn(1, H, P, d), torch.randn(1, KV, V, d)
    weights = torch.rand(H)
    logits = prompt_logits(q, k, torch.full((P,), V + 10), None, 1 / math.sqrt(d))  # every row sees every key
    got = select_top(hawk_scores(logits, torch.ones(1, P, dtype=torch.bool), (weights / weights.sum())[None]), 7)
    assert got[0].tolist() == reference_hawk(q, k, weights, 7)
    padded = torch.cat([logits, torch.full((1, H, 2, V), float("-inf"))], 2)  # rows that do not count
    valid = torch.tensor([[True] * P + [False] * 2])
    torch.testing.assert_close(hawk_scores(padded, valid, weights[None]),
                               hawk_scores(logits, valid[:, :P], weights[None]))


def test_hawk_keeps_what_its_rule_keeps_on_the_model(tiny, tmp_path):
    """Through the executor on a GQA decoder: layer 0's pre-RoPE q, k of the input embeddings, the question's rows
    (after the image, before the template's tail), layer 0's static weights; original positions kept."""
    model, processor = tiny
    torch.manual_seed(1)
    weights = torch.rand(4, 4)
    path = weights_file(tmp_path, importance.row_normalised(weights))
    result = hap.run(model, processor, noise_image(5), QUESTIONS[1],
                     hap.HAPConfig(method="hawk", retain=0.25, head_importance=path))
    taken = []
    decoder = causal.decoder_of(model)
    handle = decoder.register_forward_pre_hook(lambda m, a, kw: taken.append(kw["inputs_embeds"]), with_kwargs=True)
    inputs = causal.prepare(model, processor, noise_image(5), QUESTIONS[1])
    with torch.no_grad():
        model(**inputs)
        handle.remove()
        ids = inputs["input_ids"][0]
        visual = (ids == model.config.image_token_id).nonzero()[:, 0]
        rows = slice(int(visual[-1]) + 1, len(ids) - template_tail(processor))
        layer = decoder.layers[0]
        x = layer.input_layernorm(taken[0])
        attn, d = layer.self_attn, layer.self_attn.head_dim
        q = attn.q_proj(x[:, rows]).view(1, -1, 4, d).transpose(1, 2)
        k = attn.k_proj(x[:, visual]).view(1, -1, 2, d).transpose(1, 2)
    assert len(result.groups) == 1 and result.groups[0].layers == (0, 4)
    kept = result.groups[0].kept
    assert kept == reference_hawk(q, k, importance.read(path)[0], len(kept))
    torch.testing.assert_close(torch.tensor(result.groups[0].weights[0]), importance.read(path)[0])


def test_static_head_weight_with_one_hot_weights_keeps_that_heads_top_tokens(tiny, tmp_path):
    """head_weight="static" fuses the scoring layer's heads with its static weights: one-hot on head 2, the cut keeps
    the tokens head 2 alone ranks first (its map's L2 norm over the rows, as traced)."""
    model, processor = tiny
    one_hot = torch.zeros(4, 4)
    one_hot[:, 2] = 1.0
    path = weights_file(tmp_path, one_hot)
    config = hap.HAPConfig(head_weight="static", head_importance=path, first_layers=1, groups=1, retain=0.3,
                           diversity=0.0, merge="none", score_layers="last")
    result = hap.run(model, processor, noise_image(7), QUESTIONS[0], config)
    group = result.groups[0]
    assert group.scored_by == [0]
    assert group.weights == [[0.0, 0.0, 1.0, 0.0]]
    head = result.maps.head[0, 2]
    expected = sorted(torch.topk(head, len(group.kept)).indices.tolist())
    assert group.kept == expected
    paq = hap.run(model, processor, noise_image(7), QUESTIONS[0], hap.HAPConfig(**{**config.to_dict(), "head_weight": "paq"}))
    assert paq.groups[0].weights != group.weights  # PAQ weighs the same heads otherwise


def test_the_app_reads_a_given_file_only_where_local_files_are_allowed(tmp_path):
    """`head_importance` comes from the page too: unset (the model folder's file) always, a path only where the
    operator allows local files (HAP_APP_ALLOW_LOCAL)."""
    from app.settings import Settings, check_importance

    assert check_importance(None, Settings()) is None
    with pytest.raises(ValueError, match="reads only the model folder's own static head importance"):
        check_importance(str(tmp_path / "x.json"), Settings())
    assert check_importance(str(tmp_path / "x.json"), Settings(allow_local=True)) == str(tmp_path / "x.json")


def test_the_page_quotes_the_committed_held_out_run():
    """The figures "Static or per-image head weights?" quotes are results/static_heads/benchmark.json's, and its
    verdict follows them."""
    from app.causal import STATIC_HELD_OUT, held_out_line
    from app_model import ROOT

    h = STATIC_HELD_OUT
    run = json.loads((ROOT / "results" / "static_heads" / "benchmark.json").read_text())
    assert run["seeds"] == h["seeds"] and run["n_questions"] == h["questions"]
    assert run["unpruned_accuracy"] == pytest.approx(h["unpruned"], abs=5e-4)
    for key, row in (("static", "hap_static"), ("paq", "hap"), ("hawk", "hawk"), ("uniform", "uniform")):
        assert {r: pytest.approx(v, abs=5e-4) for r, v in run["accuracy"][row].items()} == h[key], key
    assert "level within a point" in held_out_line(h)
    ahead = held_out_line({**h, "paq": {"0.111": 0.90, "0.056": 0.88}})
    assert "PAQ ahead by 4.4, 3.2 points" in ahead


@torch.no_grad()
def test_skipping_the_layers_below_is_exact_with_deepstack_and_mrope():
    """Qwen3-VL adds DeepStack features after its first layers and positions by M-RoPE: the fast path (layers below
    each ablated head skipped, their output taken from the stock forward) still equals the whole-model ablation."""
    from tiny_zoo_recent import qwen3_vl

    model, processor = qwen3_vl()
    inputs = causal.prepare(model, processor, noise_image(1), "what is it ?")
    fast = causal.item_drops(model, inputs, batch_size=3)
    _, _, plain = causal.ablation(model, inputs)
    torch.testing.assert_close(fast.float(), plain, atol=1e-5, rtol=1e-4)
    assert plain.abs().max() > 1e-3  # some head matters


def test_the_fused_maps_are_titled_by_the_weights_the_run_used():
    """The traced group maps are fused with the run's own head weights, and the views say which."""
    from hap.views.data import head_weighting

    assert head_weighting(hap.HAPConfig().to_dict()) == "PAQ-weighted"
    assert head_weighting(hap.HAPConfig(head_weight="static").to_dict()) == "static-weighted"
    assert head_weighting(hap.HAPConfig(method="hawk").to_dict()) == "static-weighted"
    assert head_weighting(hap.HAPConfig(method="uniform").to_dict()) == "uniform (the method's)"
