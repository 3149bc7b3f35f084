"""The baselines named after papers keep the tokens their official code keeps (docs/method.md §7,
notes/baselines-official.md). Each test writes the official rule out independently (stock layers called by hand,
eager attention) and compares it with `hap.patched` on a tiny LLaVA at two budgets."""

import math
from dataclasses import replace

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import hap
from hap.pruners.visionzip import split_budget
from hap.planning.flops import DecoderShape
from hap.planning.budget import plan
from tiny_models import llava_case

QUESTION = "what color is the circle ?"  # several prompt tokens after the image: the last one must score


def _visual(model, inputs) -> torch.Tensor:
    """long [N] positions of the image tokens (one sample)."""
    return (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]


def _last_row_scores(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, span: slice) -> torch.Tensor:
    """The layer's input norm, q/k projections and RoPE on `hidden`; the last token's fp32 softmax attention, mean
    over heads, over the image `span` -> [span length] (one sample; the last row sees every key, no mask)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    q = attn.q_proj(x[:, -1:]).view(1, 1, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(1, x.shape[1], -1, attn.head_dim).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    k = repeat_kv(k, attn.num_key_value_groups)
    probs = (q @ k.transpose(2, 3) / math.sqrt(attn.head_dim)).softmax(-1, dtype=torch.float32)
    return probs.mean(1)[0, 0, span]


STEPS = 3  # generated tokens compared with the reference (the prefill's logits, then two decode steps)


def _pyramid_pass(model, hidden: torch.Tensor, start: int, n_image: int, cuts: list[int], renumber: bool,
                  pick) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One cache-free pass of the decoder over `hidden` [1, T, D] (an image span [start, start + n_image)), the image
    tokens cut before each layer of `cuts` to `pick(g, layer, hidden, cos, sin, span, previous)` (ascending indices
    into the current span; `previous`: the last token's scores of the layer that just ran); positions renumbered
    0..T'-1 after a cut when `renumber`, else the originals kept. Returns (original image indices kept at each cut,
    the last token's logits)."""
    lm = model.model.language_model
    image, positions = torch.arange(n_image), torch.arange(hidden.shape[1])[None]
    out, previous = [], None
    for i, layer in enumerate(lm.layers):
        cos, sin = lm.rotary_emb(hidden, positions)
        if i in cuts:
            top = pick(cuts.index(i), layer, hidden, cos, sin, slice(start, start + len(image)), previous)
            keep = torch.cat([torch.arange(start), start + top, torch.arange(start + len(image), hidden.shape[1])])
            hidden, image = hidden[:, keep], image[top]
            out.append(image)
            positions = torch.arange(hidden.shape[1])[None] if renumber else positions[:, keep]
            cos, sin = lm.rotary_emb(hidden, positions)
        previous = _last_row_scores(layer, hidden, cos, sin, slice(start, start + len(image)))
        hidden = layer(hidden, position_embeddings=(cos, sin), position_ids=positions)
    return out, model.lm_head(lm.norm(hidden))[:, -1]


def _greedy(embed, first: torch.Tensor, step, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding written out without a cache: `first` [1, vocab] the prefill's logits, `step(tokens)` the
    last token's logits of the prompt followed by the generated `tokens` (their embeddings by `embed`). Returns
    (tokens long [steps], logits [steps, vocab])."""
    logits, tokens = [first], []
    for _ in range(steps - 1):
        tokens.append(int(logits[-1].argmax()))
        logits.append(step(embed(torch.tensor([tokens]))))
    tokens.append(int(logits[-1].argmax()))
    return torch.tensor(tokens), torch.cat(logits)


@torch.no_grad()
def _pyramid_reference(model, inputs, cuts: list[int], kept: list[int], official: bool = True,
                       renumber: bool | None = None, steps: int = 1) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                               torch.Tensor]:
    """A pyramid of cuts written out by hand (one sample). `official`: PyramidDrop as its official loop runs, before
    layer `cuts[g]` that layer's `_last_row_scores` on the tokens about to enter it, positions renumbered 0..T'-1;
    else our earlier variant (`pdrop_ours`): the scores of the layer that just ran (on its own input), original
    positions kept. The top `kept[g]` image tokens stay in order. `renumber` overrides the positions' rule.
    Decoding keeps the prefill's cuts: each generated token follows the group's own sequence (with renumbering, the
    position after the group's renumbered prompt: the official code lowers the decode positions by the tokens
    dropped). Returns (original image indices kept at each cut, generated tokens [steps], their logits [steps,
    vocab])."""
    renumber = official if renumber is None else renumber
    prompt = model(**inputs, output_hidden_states=True).hidden_states[0]  # the decoder's input embeddings
    visual = _visual(model, inputs)
    start, n_image = int(visual[0]), len(visual)
    tops: list[torch.Tensor] = []

    def rank(g, layer, hidden, cos, sin, span, previous):
        score = _last_row_scores(layer, hidden, cos, sin, span) if official else previous
        tops.append(score.topk(kept[g]).indices.sort().values)
        return tops[-1]

    def decode(generated: torch.Tensor) -> torch.Tensor:  # the prefill's cuts, the generated tokens appended
        return _pyramid_pass(model, torch.cat([prompt, generated], 1), start, n_image, cuts, renumber,
                             lambda g, *_: tops[g])[1]

    out, first = _pyramid_pass(model, prompt, start, n_image, cuts, renumber, rank)
    return out, *_greedy(model.get_input_embeddings(), first, decode, steps)


def _generated(model, inputs, config: hap.HAPConfig, steps: int = STEPS):
    """`hap.patched` greedy generation: (the patch, tokens long [steps], each step's logits [steps, vocab])."""
    with hap.patched(model, config) as patch:
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return patch, out.sequences[0, inputs["input_ids"].shape[1]:], torch.cat(out.logits)


@torch.no_grad()
def _pyramid_run(method: str, retain: float):
    """`method` on a 4-layer tiny LLaVA (first_layers=1, three cuts), checked against `_pyramid_reference` (official
    for `pdrop`): the same kept tokens at every cut, the same prefill logits and the same decode steps. Returns
    (model, inputs, the patch, the prefill's logits)."""
    model, make_inputs = llava_case(layers=4)
    inputs = make_inputs([QUESTION], [3])
    patch, tokens, logits = _generated(model, inputs, hap.HAPConfig(method=method, retain=retain, first_layers=1,
                                                                    groups=3))
    schedule = patch.state.schedule
    expected, ref_tokens, ref_logits = _pyramid_reference(model, inputs, schedule.cuts, schedule.kept,
                                                          method == "pdrop", steps=STEPS)
    assert schedule.cuts == [1, 2, 3] and len(set(schedule.kept)) > 1
    for cut, want in zip(patch.state.cuts, expected, strict=True):
        assert torch.equal(cut.kept[0], want)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)  # the positions downstream, decode too
    assert torch.equal(tokens, ref_tokens)
    return model, inputs, patch, logits[:1]


@pytest.mark.parametrize("retain", [0.3, 0.6])
def test_pdrop_keeps_what_the_official_rule_keeps(retain):
    _pyramid_run("pdrop", retain)  # renumbered positions


@pytest.mark.parametrize("retain", [0.3, 0.6])
@torch.no_grad()
def test_pdrop_ours_keeps_original_positions_and_differs_from_pdrop(retain):
    """Our earlier PyramidDrop (`pdrop_ours`): each cut scored by the layer that just ran, original positions kept
    (logits equal the hand-written loop at original positions, not at renumbered ones); its kept tokens differ from
    the official rule's."""
    model, inputs, ours, logits = _pyramid_run("pdrop_ours", retain)
    schedule = ours.state.schedule
    _, _, renumbered = _pyramid_reference(model, inputs, schedule.cuts, schedule.kept, official=False, renumber=True)
    assert not torch.allclose(logits, renumbered, atol=1e-3)  # positions matter here: renumbering would show
    with hap.patched(model, replace(ours.config, method="pdrop")) as official:
        model(**inputs)
    assert any(not torch.equal(a.kept[0], b.kept[0]) for a, b in zip(ours.state.cuts, official.state.cuts))


def test_pdrop_scores_with_the_last_prompt_row_not_the_first():
    """A planted bug read the first prompt row: only the last token's row may score a cut."""
    from hap.pruners import pruner_for
    from hap.patch.state import _prompt_rows

    assert pruner_for(hap.HAPConfig(method="pdrop", rows="prompt")).rows == "last"
    valid, gap = _prompt_rows("last", torch.tensor([5]), None, 12)
    assert valid.tolist() == [[True]] and gap.tolist() == [0]  # the row ending at position 11, the last token


def test_the_pyramiddrop_paper_schedule_is_reachable():
    """[8, 16, 24] at ratio 0.5 on 32 layers: int(576 * 0.5^g) tokens kept, 288 / 144 / 72."""
    shape = DecoderShape(32, 4096, 11008, 4096)
    config = hap.HAPConfig(method="pdrop", first_layers=8, groups=3, decay=0.5, retain=0.46875)
    schedule = plan(config, shape, 576)
    assert schedule.cuts == [8, 16, 24] and schedule.kept == [288, 144, 72]


@pytest.mark.parametrize("retain", [0.4, 0.7])
@torch.no_grad()
def test_fastv_keeps_what_the_official_rule_keeps(retain):
    """FastV: layer K-1's attention probabilities, mean over heads, the last token's row, the image span, top-k;
    kept tokens keep their original positions (logits equal a stock run on the kept tokens at those positions)."""
    model, make_inputs = llava_case("eager", layers=4)
    inputs = make_inputs([QUESTION], [4])
    with hap.patched(model, hap.HAPConfig(method="fastv", retain=retain, first_layers=1)) as patch:
        model(**inputs)
    k = patch.state.schedule.kept[0]
    attn = model(**inputs, output_attentions=True).attentions[0]  # layer K-1 = 0
    want = attn.mean(1)[0, -1, _visual(model, inputs)].topk(k).indices.sort().values
    assert torch.equal(patch.state.cuts[0].kept[0], want)


@torch.no_grad()
def _visionzip_reference(model, inputs, k: int, dominant: int,
                         steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VisionZip as its official code runs (one sample): the tower's eager attention and hidden states; [CLS] plus
    the top `dominant - 1` patches by [CLS] attention summed over heads, in order; of the R others, targets
    arange(0, R, max(1, R // c))[:c]; each other token joins its most similar target (keys averaged over heads,
    normalised); contextual = target + mean of members; [dominant, contextual] projected and handed to the decoder
    as one block at consecutive positions; the decoder sees the shorter sequence, so each generated token follows it.
    Returns (the patch indices kept, the generated tokens [steps], their logits [steps, vocab])."""
    tower = model.model.vision_tower
    tower.set_attn_implementation("eager")
    vision = tower(inputs["pixel_values"], output_attentions=True, output_hidden_states=True)
    layer = tower.encoder.layers[-1]  # the tiny model's feature layer is -1
    hidden = vision.hidden_states[-1][0]  # [1 + N, Dv]
    x = layer.layer_norm1(vision.hidden_states[-2])
    metric = layer.self_attn.k_proj(x).view(x.shape[1], -1, layer.self_attn.head_dim).mean(1)  # [1 + N, d]
    top = vision.attentions[-1][0, :, 0, 1:].sum(0).topk(dominant - 1).indices + 1
    mask = torch.ones(hidden.shape[0], dtype=torch.bool)
    mask[torch.cat([torch.zeros(1, dtype=torch.long), top])] = False
    dominant_tokens, rest, rest_metric = hidden[~mask], hidden[mask], metric[mask]
    rest_metric = rest_metric / rest_metric.norm(dim=-1, keepdim=True)
    c = k - dominant
    targets = torch.arange(0, rest.shape[0], max(1, rest.shape[0] // c))[:c]
    others = ~torch.isin(torch.arange(rest.shape[0]), targets)
    sim = rest_metric[others] @ rest_metric[targets].T
    one_hot = torch.zeros(int(others.sum()), c).scatter_(1, sim.argmax(1, keepdim=True), 1.0)
    mean = one_hot.T @ rest[others] / one_hot.sum(0).clamp(min=1)[:, None]
    block = model.model.multi_modal_projector(torch.cat([dominant_tokens, rest[targets] + mean])[None])
    patch_index = torch.arange(hidden.shape[0])[mask][targets] - 1
    kept = torch.cat([top.sort().values - 1, patch_index])
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    visual = _visual(model, inputs)
    sequence = torch.cat([embeds[:, :visual[0]], block, embeds[:, visual[-1] + 1:]], 1)
    lm = model.model.language_model

    def last(embeds: torch.Tensor) -> torch.Tensor:
        return model.lm_head(lm(inputs_embeds=embeds, use_cache=False).last_hidden_state)[:, -1]

    first = last(sequence)
    return kept, *_greedy(model.get_input_embeddings(), first, lambda new: last(torch.cat([sequence, new], 1)), steps)


@pytest.mark.parametrize("retain", [0.1, 0.25])
@torch.no_grad()
def test_visionzip_keeps_and_merges_what_the_official_rule_does(retain):
    model, make_inputs = llava_case(layers=4)
    inputs = make_inputs([QUESTION], [5])
    patch, tokens, logits = _generated(model, inputs, hap.HAPConfig(method="visionzip", retain=retain))
    k = patch.state.schedule.kept[0]
    dominant = split_budget(k)[0]
    kept, ref_tokens, ref_logits = _visionzip_reference(model, inputs, k, dominant)
    assert torch.equal(patch.state.cuts[0].kept[0], kept)  # dominant patches ascending, then the targets
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)  # values, order and positions, decode too
    assert torch.equal(tokens, ref_tokens)
