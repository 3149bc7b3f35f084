"""HAP+ knobs beyond the paper (docs/method.md §10): the paper preset, question rows, the consensus sink test,
the pre-RoPE first cut; each against an independent computation on a small random LLaVA."""

import math

import pytest
import torch

import hap
from hap.planning.flops import DecoderShape
from hap.scoring.heads import consensus_sinks, detect_sinks
from hap.knobs import KNOBS
from hap.patch.state import PruneState
from hap.runs.run import chat_prompt, template_tail
from tiny_models import llava_case, noise_image, tiny_llava

QUESTION = "what color is the circle ?"


def test_the_paper_preset_sets_every_knob_with_a_paper_value():
    paper = hap.HAPConfig.paper(retain=0.2, first_layers=1)
    assert (paper.method, paper.rows, paper.head_weight, paper.sink_ranking, paper.sink_detector, paper.first_cut,
            paper.temperature) == ("hap", "prompt", "paq", "keep", "norm", "attention", 0.1)
    assert (paper.retain, paper.first_layers) == (0.2, 1)
    assert hap.HAPConfig.paper(head_weight="paq_visual").head_weight == "paq_visual"  # overrides win
    for k in KNOBS:
        assert k.paper is None or k.check(k.paper) == k.paper
    assert {k.name for k in KNOBS if k.paper is not None} >= {"head_weight", "sink_ranking", "sink_detector",
                                                              "rows", "first_cut", "temperature"}


def test_template_tail_counts_the_tokens_after_the_question():
    _, processor = tiny_llava(layers=1)
    ids = processor.tokenizer(chat_prompt(processor, QUESTION)).input_ids
    tail = template_tail(processor)
    assert processor.tokenizer.decode(ids[-tail:]).replace(" ", "").lower() == "assistant:"


def test_question_rows_leave_out_the_template_tail_per_sample():
    """[prefix 1][visual 4][prompt], the last 2 prompt tokens the template's tail; sample 1 right-padded by 1."""
    visual = torch.zeros(2, 10, dtype=torch.bool)
    visual[:, 1:5] = True
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, -1] = 0
    shape = DecoderShape.mha(layers=2, hidden=8, intermediate=16)
    st = PruneState.start(hap.HAPConfig(retain=0.5, groups=1, rows="question"), visual, mask, shape, trace=False, tail=2)
    assert st.row_valid.tolist() == [[True, True, True], [False, True, True]]
    assert st.row_positions(10).tolist() == [[5, 6, 7], [4, 5, 6]]  # sample 1: rows 5, 6 (4 is invalid)
    with pytest.raises(ValueError, match=r"rows='question' needs the chat template's tail"):
        hap.patch(llava_case(layers=1)[0], hap.HAPConfig(rows="question"))


def test_consensus_sinks():
    dist = torch.zeros(4, 16)  # [heads, visual]: 16 tokens
    dist[0, :3] = torch.tensor([0.7, 0.2, 0.1])
    dist[1, :3] = torch.tensor([0.6, 0.3, 0.1])
    dist[2, :3] = torch.tensor([0.1, 0.1, 0.8])
    dist[3, :3] = torch.tensor([0.3, 0.3, 0.4])  # three top tokens (each >= 0.7 x 0.4) of 16: not parked on a few
    assert consensus_sinks(dist, 0.5, 0.5).tolist()[:4] == [True, False, False, False]  # token 0 parks 2 of 4 heads
    assert consensus_sinks(dist, 0.5, 0.25).tolist()[:4] == [True, False, True, False]
    assert consensus_sinks(dist[None].repeat(2, 1, 1), 0.5, 0.5).shape == (2, 16)  # batched
    split = torch.full((4, 32), 0.1 / 30)  # a sink split evenly over tokens 5 and 9 in two heads: found as a set
    split[:2, [5, 9]] = 0.45
    split[2:] = torch.softmax(torch.arange(32.0) / 2, -1)  # the other two: focused on token 31 (0.39), 30 next (0.24)
    assert consensus_sinks(split, 0.5, 0.5).nonzero()[:, 0].tolist() == [5, 9]
    assert not consensus_sinks(split, 0.5, 0.5, tokens=1).any()  # one token at most: the split sink is not seen
    few = torch.full((4, 8), 0.1 / 6)  # 2 of 8 tokens present hold 0.9 in every head: 3.6 x their even share, not 8
    few[:, [5, 6]] = 0.45
    assert not consensus_sinks(few, 0.5, 0.25).any()


def test_sink_detectors_combine():
    hidden = torch.ones(1, 16, 4)
    hidden[0, 1] *= 100.0  # token 1: a massive activation
    attn = torch.full((1, 2, 1, 16), 0.1 / 15)
    attn[0, :, 0, 2] = 0.9  # every head on token 2
    valid = torch.ones(1, 1, dtype=torch.bool)
    found = {d: detect_sinks(d, hidden, attn, valid, 10.0, 0.5, 0.25)[0, :3].tolist()
             for d in ("norm", "consensus", "both")}
    assert found == {"norm": [False, True, False], "consensus": [False, False, True], "both": [False, True, True]}


@torch.no_grad()
def test_a_prerope_first_cut_keeps_the_top_tokens_of_layer0_qk_without_rotary_embedding():
    model, make_inputs = llava_case(layers=4)
    inputs = make_inputs([QUESTION], None)
    config = hap.HAPConfig.paper(retain=0.5, first_layers=0, groups=1, temperature=math.inf, first_cut="prerope")
    with hap.patched(model, config) as patch:
        model(**inputs)
    kept = patch.state.cuts[0].kept[0].tolist()
    # independent: layer 0's input, norm, q/k projections, no RoPE, causal softmax over all keys, mean over heads
    h = model(**inputs, output_hidden_states=True).hidden_states[0][0]  # [T, d]
    layer = model.model.language_model.layers[0]
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    ids = inputs["input_ids"][0]
    vis = (ids == model.config.image_token_id).nonzero().flatten()
    rows = torch.arange(int(vis[-1]) + 1, len(ids))
    H, kv = model.config.text_config.num_attention_heads, model.config.text_config.num_key_value_heads
    q = attn.q_proj(x[rows]).view(len(rows), H, -1).transpose(0, 1)  # [H, P, d]
    k = attn.k_proj(x).view(len(ids), kv, -1).transpose(0, 1).repeat_interleave(H // kv, 0)  # [H, T, d]
    logits = (q @ k.transpose(1, 2)) * attn.scaling
    logits = logits.masked_fill(torch.arange(len(ids))[None, None, :] > rows[None, :, None], -math.inf)
    A = logits.softmax(-1)[:, :, vis].mean(0)  # [P, N]
    scores = A.norm(dim=0)
    k_kept = patch.state.schedule.kept[0]
    top = scores.topk(k_kept + 1)
    assert top.values[k_kept - 1] - top.values[k_kept] > 1e-7, "a near-tie would make the check ambiguous"
    assert kept == sorted(top.indices[:k_kept].tolist())


@pytest.mark.parametrize("knobs", [dict(head_weight="paq_visual"), dict(sink_ranking="mask_keep_one"),
                                   dict(sink_detector="both"), dict(rows="question"), dict(first_cut="prerope"),
                                   dict(first_cut="vision"), dict(score_layers="last"), dict(merge="average"),
                                   dict(merge="proportional")])
def test_each_knob_runs_end_to_end_and_keeps_the_budget(knobs):
    model, processor = tiny_llava(layers=4)
    config = hap.HAPConfig(retain=0.2, first_layers=0, **knobs)
    result = hap.run(model, processor, noise_image(0), QUESTION, config, max_new_tokens=2)
    assert all(result.config[name] == value for name, value in knobs.items())
    assert all(len(g.kept) == result.visual_per_layer[g.layers[0]] for g in result.groups) and len(result.groups) == 3
    assert abs(result.retain - 0.2) < 0.01


@pytest.mark.parametrize("score_layers, scored", [("segment", [[0], [0, 1]]), ("last", [[0], [1]])])
@torch.no_grad()
def test_score_layers_picks_the_segments_layers_or_its_last(score_layers, scored):
    """Cuts at layers 0 and 2 of a 4-layer decoder: the first looks ahead at layer 0; the second is scored by
    layers 0-1 (segment) or by layer 1 alone (last, as PyramidDrop)."""
    model, make_inputs = llava_case(layers=4)
    config = hap.HAPConfig(retain=0.3, first_layers=0, groups=2, score_layers=score_layers)
    with hap.patched(model, config) as patch:
        model(**make_inputs([QUESTION], [0]))
    assert [c.layer for c in patch.state.cuts] == [0, 2]
    assert [c.scored_layers for c in patch.state.cuts] == scored
