"""`sparsevlm` and `autoprune` keep, recycle and place the tokens their official code does (docs/method.md §7,
notes/autoprune-sparsevlm.md). The reference below is written out from the official loops (`Gumpest/SparseVLMs@v1.5`
`modelling_sparse_llama.py` / `score.py` / `utils.py`, `AutoLab-SAI-SJTU/AutoPrune@e4a99184` the same files),
independently of `hap`: stock decoder layers called by hand on eager attention (the layer's own probabilities, taken
from its attention module), the drop applied to the layer's output, the recycled cluster means inserted after the
kept visual tokens, positions renumbered; decoding replays the prefill's decisions with the generated tokens
appended (each layer's new token at its own sequence length). Run on a random LLaVA of LLaVA-1.5's 32 layers and
576 visual tokens, where the official schedules apply as published."""

import math

import pytest
import torch

import hap
from analysis.training.tiny_vlm import build_config, build_processor
from hap.pruners import recycle
from hap.pruners import autoprune, sparsevlm
from hap.planning.flops import DecoderShape
from hap.planning.budget import official_schedule, plan, smallest_retain
from hap.patch import refusal
from hap.runs.run import chat_prompt
from tiny_models import llava_case, llava_qwen2_case, noise_image, qwen_vl_case
from transformers import LlavaForConditionalGeneration

QUESTION = "what color is the circle on the left of the square ?"
STEPS = 3
SPARSE_LISTS = {64: [66, 30, 17], 128: [303, 110, 36], 192: [300, 200, 110]}  # v1.5 score.py:7-9
SPARSE_LAYERS = [2, 6, 15]  # v1.5 modelling_sparse_llama.py:69


@pytest.fixture(scope="module")
def llava32():
    """A random LLaVA with LLaVA-1.5's depth and token count: CLIP 336 px / 14 (576 tokens, 1 layer, 2 heads),
    Llama 32 layers x 4 heads x 64 wide; one noise image and QUESTION."""
    processor = build_processor(image_size=336)
    config = build_config(processor, text_layers=32, text_hidden=64, text_heads=4, text_mlp=128, vision_hidden=32,
                          vision_layers=1, vision_heads=2, image_size=336)
    config.text_config.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    inputs = processor(images=[noise_image(7, (336, 336))], text=[chat_prompt(processor, QUESTION)],
                       return_tensors="pt")
    return model, inputs


# --- the official rules, written out ------------------------------------------------------------------------------
def mutual_information(attn_h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """AutoPrune's `mutual_information` (modelling_sparse_llama.py:1741): attn_h [num_text, num_vision]."""
    num_text = attn_h.shape[0]
    px = 1.0 / num_text
    p_xy = px * attn_h
    p_y = p_xy.sum(dim=0, keepdim=True)
    ratio = p_xy / (px * p_y + eps)
    return torch.sum(p_xy * torch.log2(torch.clamp(ratio, eps, None)))


def cluster_and_merge(x: torch.Tensor, cluster_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """utils.py:155-213 for one sample x [N, C] (the 1e-6 density noise left out): (merged [c, C], centres [c])."""
    N, C = x.shape
    dist_matrix = (x[:, None, :] - x[None, :, :]).norm(dim=-1, p=2) / (C ** 0.5)
    dist_nearest, _ = torch.topk(dist_matrix, k=cluster_num, dim=-1, largest=False)
    density = (-(dist_nearest ** 2).mean(dim=-1)).exp()
    mask = (density[None, :] > density[:, None]).type(x.dtype)
    dist_max = dist_matrix.max()
    dist, _ = (dist_matrix * mask + dist_max * (1 - mask)).min(dim=-1)
    _, index_down = torch.topk(dist * density, k=cluster_num, dim=-1)
    idx_cluster = dist_matrix[index_down].argmin(dim=0)
    idx_cluster[index_down] = torch.arange(cluster_num)
    all_weight = torch.zeros(cluster_num, 1).index_add_(0, idx_cluster, torch.ones(N, 1)) + 1e-6
    merged = torch.zeros(cluster_num, C).index_add_(0, idx_cluster, x / all_weight[idx_cluster])
    return merged, index_down


def autoprune_fractions(k: float, v_token_num: int, target: int, seq_len: int, x0: float = 14.9) -> list[float]:
    """`generate_keep_percent_abs` + `cal_sum_tokens_no_membership` (modelling_sparse_llama.py:1870-1961) for
    pruning_loc = 1..seq_len-1 (on 32 layers; the relative-depth carry-over is ours)."""
    keep_percent = [0.75 / (1 + math.exp(k * (pos - (x0 + k)))) for pos in range(1, seq_len)]
    token_sum, pre_pos, used = 0, 0, v_token_num
    for i, pos in enumerate(range(1, seq_len)):
        used = int(v_token_num * keep_percent[i])
        token_sum += used * (pos - pre_pos)
        pre_pos = pos
    token_sum += used * (seq_len - pre_pos)
    target_token_num = seq_len * target
    if abs(token_sum - target_token_num) < 1:
        return keep_percent

    def cal_sum(kp):
        kp = [min(1.0, float(x)) for x in kp]
        current = total = v_token_num
        for j in range(seq_len - 1):
            keep_target = min(math.ceil((v_token_num - 1) * kp[j]), min(int(target_token_num * 2.5), 576))
            diff = current - keep_target
            if diff == 0:
                cluster_num = 0
            else:
                stage1 = int(diff * 0.3) + 1
                cluster_num = min(stage1 // 10 + 1, stage1)
            current = keep_target + cluster_num
            total += current
        return total

    low, high, best, min_diff = 0.0, 20.0, 1, float("inf")
    for _ in range(200):
        mid = (low + high) / 2
        current_sum = cal_sum([p * mid for p in keep_percent])
        diff = abs(current_sum - target_token_num)
        if diff < min_diff:
            min_diff, best = diff, mid
            if min_diff < 0.01:
                break
        if current_sum < target_token_num:
            low = mid
        else:
            high = mid
    return [p * best for p in keep_percent]


class Decisions:
    """What the reference prefill decided at each cut, replayed by the decode passes."""

    def __init__(self):
        self.keep: list[torch.Tensor] = []  # sorted indices into the current visual block
        self.merge: list[tuple[torch.Tensor, int] | None] = []  # (candidates into the visual block, clusters)
        self.S = 0  # AutoPrune's layer-0 keep


@torch.no_grad()
def reference(model, inputs, method: str, budget: int, steps: int = STEPS):
    """The official loop of `method` at `budget` (one sample). Returns (per cut: original index of every visual token
    after it, recycled ones at their cluster centre's; per cut: bool recycled flags; generated tokens; logits;
    the MI_1 and counts AutoPrune chose, or None)."""
    model.set_attn_implementation("eager")
    lm = model.model.language_model
    embeds = model(**inputs, output_hidden_states=True).hidden_states[0]
    visual = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]
    v_start, n_image = int(visual[0]), len(visual)
    prior = None
    if method == "autoprune":
        tower = model.model.vision_tower
        tower.set_attn_implementation("eager")
        prior = tower(inputs["pixel_values"], output_attentions=True).attentions[-1][0, :, 0, 1:].mean(0)
    v_t, t_t = embeds[:, v_start:v_start + n_image], embeds[:, v_start + n_image:]
    m_v_t = (v_t @ t_t.transpose(1, 2)).softmax(2).mean(1)
    raters = torch.where(m_v_t > m_v_t.mean())[1]
    weights: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, k, out: weights.append(out[1]), with_kwargs=True)
             for layer in lm.layers]
    found = {"mi1": None, "fractions": None}

    def run(hidden: torch.Tensor, decisions: Decisions, replay: bool):
        ids, flags = torch.arange(n_image), torch.zeros(n_image, dtype=torch.bool)
        out_ids, out_flags = [], []
        v_num, S, cut = n_image, None, 0
        for l, layer in enumerate(lm.layers):
            T = hidden.shape[1]
            positions = torch.arange(T)[None]
            cos, sin = lm.rotary_emb(hidden, positions)
            causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
            weights.clear()
            out = layer(hidden, attention_mask=causal, position_embeddings=(cos, sin), position_ids=positions)
            prunes = l in SPARSE_LAYERS if method == "sparsevlm" else l < len(lm.layers) - 1
            if not prunes:
                hidden = out
                continue
            text_start = v_start + v_num
            attn = weights[0][0]  # [H, T, T]
            vis = slice(v_start, text_start)
            recycle = method == "sparsevlm" or l > 0
            if replay:
                keep = decisions.keep[cut]
            else:
                if method == "sparsevlm":
                    rel = attn.mean(0)[raters + text_start, vis].mean(0)
                    k = min(SPARSE_LISTS[budget][SPARSE_LAYERS.index(l)], v_num - 1)
                elif l == 0:
                    a = attn[:, text_start:, vis]
                    mi0 = sum(mutual_information(a[h]) / a.shape[1] for h in range(a.shape[0]))
                    rel = 0.3 * mi0 * attn.mean(0)[text_start:].mean(0)[vis] + prior
                    k = decisions.S = min(int(budget * 2.5), v_num)
                else:
                    S = decisions.S
                    if l == 1:
                        a = attn[:, text_start:, vis]
                        mi1 = float(sum(mutual_information(a[h]) for h in range(a.shape[0])))
                        found["mi1"] = mi1
                        found["fractions"] = autoprune_fractions(max(mi1 * -0.2 + 0.4, 0), S, budget, 32)
                    rel = attn.mean(0)[text_start:, vis].mean(0)
                    k = min(math.ceil(float(torch.tensor(S - 1) * found["fractions"][l - 1])), v_num)
                keep = rel.topk(k).indices.sort().values
                decisions.keep.append(keep)
                merge = None
                dropped = torch.ones(v_num, dtype=torch.bool)
                dropped[keep] = False
                if recycle and dropped.any():
                    pruned = dropped.nonzero()[:, 0]
                    cand = pruned[rel[pruned].topk(int(len(pruned) * 0.3) + 1).indices]
                    merge = (cand, int(len(cand) / 10) + 1)
                decisions.merge.append(merge)
            merge = decisions.merge[cut]
            block = out[:, vis]
            parts, new_ids, new_flags = [out[:, :v_start], block[:, keep]], [ids[keep]], [flags[keep]]
            if merge is not None:
                merged, centres = cluster_and_merge(block[0, merge[0]], merge[1])
                parts.append(merged[None])
                new_ids.append(ids[merge[0][centres]])
                new_flags.append(torch.ones(merge[1], dtype=torch.bool))
            hidden = torch.cat([*parts, out[:, text_start:]], 1)
            ids, flags = torch.cat(new_ids), torch.cat(new_flags)
            v_num = len(ids)
            out_ids.append(ids)
            out_flags.append(flags)
            cut += 1
        return out_ids, out_flags, model.lm_head(lm.norm(hidden))[:, -1]

    decisions = Decisions()
    try:
        ids, flags, first = run(embeds, decisions, replay=False)
        logits, tokens = [first], []
        for _ in range(steps - 1):
            tokens.append(int(logits[-1].argmax()))
            new = model.get_input_embeddings()(torch.tensor([tokens]))
            logits.append(run(torch.cat([embeds, new], 1), decisions, replay=True)[2])
        tokens.append(int(logits[-1].argmax()))
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation("sdpa")
        model.model.vision_tower.set_attn_implementation("sdpa")
    return ids, flags, torch.tensor(tokens), torch.cat(logits), found


# --- the tests ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def _compare(model, inputs, method: str, budget: int):
    retain = official_schedule(method, budget, 576, 32).retain  # the processed share of the official budget
    with hap.patched(model, hap.HAPConfig(method=method, retain=retain)) as patch:
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    st = patch.state
    assert st.schedule.budget == budget
    ids, flags, tokens, logits, found = reference(model, inputs, method, budget)
    assert len(st.cuts) == len(ids)
    for cut, want, recycled in zip(st.cuts, ids, flags, strict=True):
        assert torch.equal(cut.kept[0], want)  # kept in order, then the recycled ones at their centres
        assert torch.equal(cut.recycled[0], recycled)
    torch.testing.assert_close(torch.cat(out.logits), logits, atol=1e-4, rtol=1e-4)  # values, places, positions
    assert torch.equal(out.sequences[0, inputs["input_ids"].shape[1]:], tokens)
    return st, found


@pytest.mark.parametrize("budget", [64, 192])
def test_sparsevlm_matches_the_official_loop(llava32, budget):
    model, inputs = llava32
    st, _ = _compare(model, inputs, "sparsevlm", budget)
    assert st.schedule.cuts == [3, 7, 16] and st.schedule.kept == SPARSE_LISTS[budget]
    assert st.row_valid.sum() < st.row_valid.numel()  # raters are a strict subset of the text rows


@pytest.mark.parametrize("budget", [64, 128])
def test_autoprune_matches_the_official_loop(llava32, budget):
    model, inputs = llava32
    st, found = _compare(model, inputs, "autoprune", budget)
    assert st.memo["curve"].mi1 == pytest.approx(found["mi1"], rel=1e-4, abs=1e-6)
    assert st.memo["curve"].fractions == pytest.approx(found["fractions"], rel=1e-6)
    assert st.schedule.kept[0] == min(int(2.5 * budget), 576) and len(st.cuts) == 31
    assert st.schedule.official_tokens == pytest.approx(budget, abs=1)  # the official accounting meets T


# --- the schedules against the note's tables (notes/autoprune-sparsevlm.md) ---------------------------------------
@pytest.mark.parametrize("budget, after, accounting, processed", [
    (64, [82, 32, 18], 64.81, 82.25), (128, [312, 117, 39], 128.62, 145.41), (192, [309, 204, 113], 192.03, 206.5)])
def test_sparsevlm_schedule_is_the_official_list(budget, after, accounting, processed):
    s = official_schedule("sparsevlm", budget, 576, 32)
    assert s.cuts == [3, 7, 16] and s.kept == SPARSE_LISTS[budget]
    assert [k + r for k, r in zip(s.kept, s.recycled)] == after  # recycled tokens included
    assert s.official_tokens == pytest.approx(accounting, abs=0.005)  # what the paper calls the budget
    assert s.retained_tokens == pytest.approx(processed, abs=0.005)  # what the layers run on


@pytest.mark.parametrize("mi1, counts", [(0.0, [126, 125, 119, 100, 55, 18, 5, 2]),
                                         (1.0, [121, 115, 102, 83, 59, 36, 20, 7]),
                                         (2.5, [64, 61, 61, 61, 61, 61, 61, 61])])
def test_autoprune_curve_is_the_official_example(mi1, counts):
    """T = 64 on LLaVA-1.5 (S = 160): the counts after layers 1/4/8/12/16/20/24/31; MI_1 >= 2 flattens the curve."""
    c = autoprune.curve(64, 576, 32, mi1)
    assert c.first_keep == 160 and c.slope == pytest.approx(max(0.4 - 0.2 * mi1, 0))
    assert [c.counts[l] for l in (1, 4, 8, 12, 16, 20, 24, 31)] == counts
    assert sum(c.counts) / 32 == pytest.approx(64, abs=0.2)  # the official accounting, layer 0 at S (integer steps)


def test_autoprune_processed_tokens_exceed_the_official_budget():
    for budget, low, high in ((64, 80, 82.5), (128, 143, 146.5), (192, 204, 210.5)):
        assert low <= official_schedule("autoprune", budget, 576, 32).retained_tokens <= high


def test_mutual_information_of_independent_and_dependent_rows():
    uniform = torch.full((4, 8), 1 / 8)
    assert float(autoprune.mutual_information(uniform)) == pytest.approx(0.0, abs=1e-4)  # the 1e-6 in the ratio
    onehot = torch.eye(4, 8)  # each text row on its own visual token: log2(4) bits, less the 1e-6 in the ratio
    assert float(autoprune.mutual_information(onehot)) == pytest.approx(2.0, abs=1e-4)
    heads = torch.stack([uniform, onehot])
    assert autoprune.mutual_information(heads).tolist() == pytest.approx([0.0, 2.0], abs=1e-4)  # per head


def test_autoprune_first_cut_adds_the_mi_weighted_text_score_to_the_prior():
    prior = torch.tensor([0.5, 0.1, 0.2, 0.2])
    attn = torch.stack([torch.eye(4), torch.full((4, 4), 0.25)])  # [heads, text, visual]
    scores, mi0 = autoprune.first_cut_scores(prior, attn)
    assert float(mi0) == pytest.approx(2.0 / 4, abs=1e-4)  # (sum over heads) / text rows
    want = prior + 0.3 * mi0 * attn.mean(0).mean(0)
    torch.testing.assert_close(scores, want)


def test_sparsevlm_raters_are_the_text_rows_above_the_mean_relevance():
    visual = torch.tensor([[[1.0, 0.0], [1.0, 0.1]]])
    text = torch.tensor([[[3.0, 0.0], [0.0, 1.0], [2.0, 0.0], [9.0, 9.0]]])
    valid = torch.tensor([[True, True, True, False]])  # the last row is padding: out of the softmax and the mean
    chosen = sparsevlm.raters(visual, text, valid)
    assert chosen.tolist() == [[True, False, False, False]]


def test_recycling_counts_and_clusters():
    assert [recycle.cluster_count(n) for n in (0, 1, 29, 30, 510)] == [0, 1, 1, 2, 16]
    groups = [torch.zeros(6, 3), torch.full((6, 3), 10.0), torch.full((6, 3), -10.0)]
    x = torch.cat(groups) + torch.randn(18, 3, generator=torch.Generator().manual_seed(0))
    centres, assign = recycle.dpc_knn(x, 3)  # a centre in each group, every token with its group's
    assert sorted(int(c) // 6 for c in centres) == [0, 1, 2]
    assert all(assign[g * 6:(g + 1) * 6].unique().numel() == 1 for g in range(3))
    assert assign[[0, 6, 12]].unique().numel() == 3
    means = recycle.cluster_means(x, assign, 3)
    for g in range(3):
        torch.testing.assert_close(means[assign[g * 6]], x[g * 6:(g + 1) * 6].mean(0), atol=1e-5, rtol=1e-5)
    tokens, centre = recycle.recycle(x[None, :10], torch.arange(10.0)[None], torch.tensor([[9]]))
    assert tokens.shape == (1, 1, 3)  # 9 dropped -> the top int(2.7) + 1 = 3 by score (6, 7, 8), one cluster
    torch.testing.assert_close(tokens[0, 0], x[6:9].mean(0), atol=1e-5, rtol=1e-5)


# --- carrying the schedules to other decoders ------------------------------------------------------------------
@pytest.mark.parametrize("layers, cuts", [(32, [3, 7, 16]), (6, [1, 2, 4]), (4, [1, 2, 3]), (28, [3, 6, 14])])
def test_sparsevlm_layers_keep_their_relative_depth(layers, cuts):
    assert [l + 1 for l in sparsevlm.prune_layers(layers)] == cuts
    with pytest.raises(ValueError, match="at least 4 layers"):
        sparsevlm.prune_layers(3)


def test_sparsevlm_counts_scale_with_the_token_share():
    assert sparsevlm.stage_keeps(16, 144) == [16, 8, 4]  # 64/576 of 144 tokens: the 64 list's shares
    assert sparsevlm.stage_keeps(729, 729) == [729] * 3
    assert sparsevlm.stage_keeps(32, 576) == [33, 15, 8]  # below 64: the 64 list halved (8.5 rounds to even)
    assert sparsevlm.stage_keeps(96, 576) == [184, 70, 26]  # halfway between the 64 and 128 lists


@pytest.mark.parametrize("method", ["sparsevlm", "autoprune"])
@pytest.mark.parametrize("layers, tokens", [(6, 144), (28, 729), (32, 576)])
def test_solved_budget_stays_within_the_target(method, layers, tokens):
    shape = DecoderShape.mha(layers, 64, 128)
    for retain in (0.056, 0.111, 0.3):
        if retain < smallest_retain(hap.HAPConfig(method=method), shape, tokens):
            continue
        s = plan(hap.HAPConfig(method=method, retain=retain), shape, tokens)
        assert s.retain <= retain + 1e-9
        bigger = official_schedule(method, s.budget + 1, tokens, layers)
        assert bigger.retain > retain  # the largest budget that fits
    assert plan(hap.HAPConfig(method=method, flops_ratio=0.4), shape, tokens, 40).flops_ratio(40, shape) <= 0.4
    with pytest.raises(ValueError, match=f"retain=0.01 is unreachable for method='{method}'"):
        plan(hap.HAPConfig(method=method, retain=0.01), shape, tokens)


def test_autoprune_curve_carries_over_by_relative_depth():
    assert autoprune.logistic(32, 0.4) == pytest.approx(autoprune.logistic(64, 0.4)[1::2])  # layer 2l of 64 = l of 32


# --- refusals, batches ----------------------------------------------------------------------------------------------
def test_models_that_cannot_take_a_rule_are_refused():
    qwen, _ = qwen_vl_case()
    siglip, _ = llava_qwen2_case()
    assert "no [CLS] token" in refusal(siglip, hap.HAPConfig(method="autoprune"))
    assert "no [CLS] token" in refusal(qwen, hap.HAPConfig(method="autoprune"))
    why = refusal(qwen, hap.HAPConfig(method="sparsevlm"))
    assert "Qwen2VLForConditionalGeneration" in why and "M-RoPE" in why
    assert refusal(siglip, hap.HAPConfig(method="sparsevlm")) is None  # raters and recycling need no [CLS]


@torch.no_grad()
def test_autoprune_refuses_a_batch_and_sparsevlm_batches_like_single_prompts():
    model, make_inputs = llava_case(layers=6)
    batch = make_inputs(["what color is the circle ?", "is there a red square on the left ?"], [1, 2])
    with pytest.raises(ValueError, match="one prompt at a time"), hap.patched(model, hap.HAPConfig(method="autoprune")):
        model(**batch)
    config = hap.HAPConfig(method="sparsevlm", retain=0.3)
    with hap.patched(model, config) as patch:
        together = model(**batch).logits[:, -1]
    kept = [c.kept for c in patch.state.cuts]
    for b, (question, seed) in enumerate([("what color is the circle ?", 1), ("is there a red square on the left ?", 2)]):
        with hap.patched(model, config) as alone:
            logits = model(**make_inputs([question], [seed])).logits[:, -1]
        torch.testing.assert_close(together[b:b + 1], logits, atol=1e-4, rtol=1e-4)
        assert all(torch.equal(k[b], c.kept[0]) for k, c in zip(kept, alone.state.cuts))
