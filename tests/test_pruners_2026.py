"""The 2025-26 pre-LLM pruners (hap/pruners/{scope,holov,prunesid,hiprune}.py) on a tiny random LLaVA whose CLIP tower
has 24 layers and LLaVA-1.5's feature layer -2: through `hap.run` (the tower on SDPA), each kept set equals a reference
transcribed here from the official code (batch 1; kinredon/SCOPE `SCOPE`, obananas/HoloV `HoloV`, ZhengyaoFang/PruneSID
`CLIPVisionTower_PruneSID.forward`, Danielement321/HiPrune `encode_images`), run on what a stock eager pass returns
(`output_attentions`, `output_hidden_states`: HF `attentions[-2]`, `hidden_states[-2]`, `attentions[8]`); the
generic tower capture (`Pruner.tower`) under SDPA against eager attention; the refusals (SigLIP: no [CLS];
PruneSID on LLaVA-NeXT) and the per-crop runs on LLaVA-NeXT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import llava_qwen2_case, noise_image
from tiny_zoo import inputs as zoo_inputs
from tiny_zoo import llava_next
from transformers import LlavaForConditionalGeneration

import hap
from analysis.training.tiny_vlm import build_config, build_processor
from hap.patch import refusal
from hap.patch.decoder import decoder_shape
from hap.planning.budget import plan
from hap.pruners import holov, register, unregister
from hap.pruners.base import BeforeDecoder, Selection
from hap.pruners.cues import TowerRead
from hap.runs.run import chat_prompt

torch.set_num_threads(1)
QUESTION = "what colour is the cube left of the red sphere ?"
FOUR = ("scope", "holov", "prunesid", "hiprune")


@pytest.fixture(scope="module")
def llava24():
    """(model, processor, inputs): CLIP 32 wide, 2 heads, **24 layers**, feature layer -2; a 2-layer Llama; 144 visual
    tokens (12 x 12)."""
    processor = build_processor()
    config = build_config(processor, text_layers=2, text_hidden=64, text_heads=4, text_kv_heads=2, text_mlp=128,
                          vision_hidden=32, vision_layers=24, vision_heads=2)
    config.vision_feature_layer = -2
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.set_attn_implementation("sdpa")
    inputs = processor(images=noise_image(), text=chat_prompt(processor, QUESTION), return_tensors="pt")
    return model, processor, inputs


@pytest.fixture(scope="module")
def stock(llava24):
    """A stock pass of the tower with eager attention: its 24 attention maps [H, T, T] and 25 hidden states [T, Dv]
    ([CLS] first) of the image, and the projected visual tokens [N, D]."""
    model, _, inputs = llava24
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model.model.vision_tower(inputs["pixel_values"], output_attentions=True, output_hidden_states=True)
            projected = model.model.get_image_features(pixel_values=inputs["pixel_values"], vision_feature_layer=-2,
                                                       vision_feature_select_strategy="default").pooler_output[0]
    finally:
        model.set_attn_implementation("sdpa")
    return {"attentions": [a[0] for a in out.attentions], "hidden": [h[0] for h in out.hidden_states],
            "projected": projected}


# the official rules, transcribed (batch 1) -------------------------------------------------------------------------

def ref_scope(attn: torch.Tensor, hidden: torch.Tensor, k: int) -> list[int]:
    """kinredon/SCOPE `SCOPE(hidden_states[:, 1:], K, cls_attn)`, alpha 1 and "multi", on attentions[-2] [H, T, T] and
    hidden_states[-2] [T, Dv]; the kept mask in raster order."""
    cls_attn = attn[None, :, 0, 1:].sum(dim=1)
    vectors = hidden[None, 1:]
    norm_vectors = vectors / vectors.norm(dim=-1, keepdim=True)
    cosine_simi = torch.bmm(norm_vectors, norm_vectors.transpose(1, 2))
    B, N = vectors.shape[:2]
    selected = torch.zeros(B, N, dtype=torch.bool)
    selected_idx = torch.empty(B, k, dtype=torch.long)
    cur_max = torch.zeros(B, N)
    for i in range(k):
        unselected_mask = ~selected
        gains = torch.maximum(torch.zeros(1), cosine_simi.masked_fill(~unselected_mask.unsqueeze(1), 0)
                              - cur_max.unsqueeze(2)).sum(dim=1)
        gains = gains * cls_attn ** 1.0
        gains = gains.masked_fill(~unselected_mask, float("-inf"))
        best_idx = gains.argmax(dim=1)
        selected[torch.arange(B), best_idx] = True
        selected_idx[:, i] = best_idx
        cur_max = torch.maximum(cur_max, cosine_simi[torch.arange(B), best_idx])
    return sorted(selected_idx[0].tolist())


def ref_holov(tokens: torch.Tensor, attention: torch.Tensor, k: int, num_patches: int = 16) -> list[int]:
    """obananas/HoloV `HoloV` on one image (tokens [N, D] projected, attention [N] head mean), the kept tokens' indices
    in its output order; -1 for each zero vector it pads with."""
    esp, alpha, N = 1e-6, 0.09, tokens.shape[0]
    patch_size, remainder = N // num_patches, N % num_patches
    token_patches, attention_patches, index_patches, start = [], [], [], 0
    for p in range(num_patches):
        size = patch_size + (1 if p < remainder else 0)
        if size > 0:
            token_patches.append(tokens[start:start + size])
            attention_patches.append(attention[start:start + size])
            index_patches.append(torch.arange(start, start + size))
        start += size
    patch_scores = []
    for patch_tokens, patch_attn in zip(token_patches, attention_patches):
        n = len(patch_tokens)
        if n <= 1:
            patch_scores.append(patch_attn.mean())
            continue
        f = patch_tokens / (patch_tokens.norm(dim=1, keepdim=True) + esp)
        S = (f @ f.T) * (1 - torch.eye(n))
        mean_sim = S.sum(dim=1) / (n - 1)
        var_sim = ((S - mean_sim.unsqueeze(1)) ** 2).sum(dim=1) / (n - 1)
        scaled = patch_attn * 1e3
        var_scaled = var_sim * (torch.mean(torch.abs(scaled)) / (torch.mean(torch.abs(var_sim)) + esp))
        patch_scores.append((scaled + alpha * var_scaled).mean())
    patch_scores = torch.stack(patch_scores)
    weights = patch_scores / (patch_scores.sum() + esp)
    allocated = (weights * k).floor().long()
    remaining = k - allocated.sum()
    if remaining > 0:
        _, indices = torch.topk(weights, k=min(remaining.item(), len(weights)))
        for idx in indices[:remaining]:
            allocated[idx] += 1
    kept = []
    for i, (index, alloc) in enumerate(zip(index_patches, allocated)):
        if alloc <= 0:
            continue
        if alloc >= len(index):
            kept += index.tolist()
        else:
            kept += index[torch.topk(attention_patches[i], k=alloc.item())[1]].tolist()
    return (kept + [-1] * (k - len(kept)))[:k]


def ref_nms(similarity_matrix, scores, threshold):
    """PruneSID's `batch_similarity_nms`, verbatim."""
    new_scores = scores.clone()
    return_scores = new_scores.clone()
    given_score, keep = 1000, []
    batch_size, group, N, _ = similarity_matrix.shape
    threshold = threshold.unsqueeze(1).unsqueeze(2).expand(batch_size, group, N)
    batch_idx = torch.arange(batch_size).view(-1, 1, 1).expand(-1, group, N)
    group_idx = torch.arange(group).view(1, -1, 1).expand(batch_size, -1, N)
    col_idx = torch.arange(N).view(1, 1, -1).expand(batch_size, group, -1)
    while new_scores.sum() > 0:
        max_values, max_idx = new_scores.max(dim=1)
        row_idx = max_idx.unsqueeze(-1).expand(-1, -1, N)
        sim_row = similarity_matrix[batch_idx, group_idx, row_idx, col_idx]
        max_idx[max_values == 0] = -1
        i0, i2 = torch.where(max_idx != -1)
        i1 = max_idx[i0, i2]
        return_scores[i0, i1, i2] = given_score
        new_scores[i0, i1, i2] = 0
        given_score -= 1
        keep.append(max_idx.unsqueeze(-1))
        new_scores[(sim_row > threshold).transpose(1, 2)] = 0
        if new_scores.sum() == 0:
            break
    return torch.cat(keep, dim=-1), return_scores


def ref_prunesid(attn: torch.Tensor, hidden: torch.Tensor, need_token_num: int) -> list[int]:
    """ZhengyaoFang/PruneSID `CLIPVisionTower_PruneSID.forward` on attentions[-2] [H, T, T] and hidden_states[-2]
    [T, Dv], transcribed; `torch.pca_lowrank` replaced by the exact decomposition and the `argsort`s made stable (the
    module's documented departures). Returns the kept indices into the T tokens, in the official order."""
    hidden_states, attn_weights = hidden[None], attn[None]
    q = int(need_token_num / 4)
    standard = torch.sigmoid(hidden_states.float()).transpose(2, 1)[:, :, 1:]
    standard = standard - standard.mean(dim=-2, keepdim=True)  # pca_lowrank's centring
    projector_lengths = torch.linalg.svd(standard, full_matrices=False).Vh[:, :q].transpose(1, 2).abs()
    belong_components = projector_lengths.argmax(dim=-1)
    cls_attention_sum = attn_weights[:, :, 0, 1:].sum(dim=1)
    projector_scores = cls_attention_sum.unsqueeze(-1).repeat(1, 1, q).to(projector_lengths.dtype)
    projector_mask = belong_components.unsqueeze(-1).repeat(1, 1, q)
    index_map = torch.arange(q).unsqueeze(0).unsqueeze(0).repeat(1, projector_lengths.shape[1], 1)
    weights_mask = torch.where(projector_mask != index_map)
    projector_lengths[weights_mask] = 0
    projector_scores[weights_mask] = 0
    normalized_states = F.normalize(hidden_states[:, 1:, :], p=2, dim=-1)
    similarity = torch.bmm(normalized_states, normalized_states.transpose(2, 1)).to(torch.float32)
    triu_mask = torch.triu(torch.ones_like(similarity), diagonal=1).bool()
    sim_mean = (similarity * triu_mask).sum(-1).sum(-1) / triu_mask.sum(-1).sum(-1)
    ratio = need_token_num / 32
    group_similarity = similarity.clone().unsqueeze(1).repeat(1, q, 1, 1)
    masks = torch.zeros_like(group_similarity)
    group_index = torch.arange(q).unsqueeze(0).unsqueeze(-1).repeat(1, 1, group_similarity.shape[-2])
    group_belong = belong_components.unsqueeze(1).repeat(1, q, 1)
    masks[group_index == group_belong] = 1
    masks[torch.where(masks.transpose(3, 2) == 1)] = 1
    group_similarity[masks != 1] = 0
    group_ids, projector_scores = ref_nms(group_similarity, projector_scores, ratio * sim_mean)
    keep_nms_counts = (group_ids != -1).sum(dim=-1)
    group_counts = (projector_mask == index_map).sum(dim=1)
    lower = torch.min(torch.cat([torch.ones_like(group_counts)[None], group_counts[None]]), dim=0)[0]
    upper = torch.ones_like(group_counts) * 5 * -(-need_token_num // 64)
    upper = torch.min(torch.cat([upper[None], group_counts[None]]), dim=0)[0]
    upper = torch.min(torch.cat([upper[None], keep_nms_counts[None]]), dim=0)[0]
    while torch.any(upper.sum(-1) < need_token_num):
        upper[torch.where(upper.sum(-1) < need_token_num)] += 1
        upper = torch.min(torch.cat([upper[None], group_counts[None]]), dim=0)[0]
    other = need_token_num - lower.sum(-1) - 1
    other[other < 0] = 0
    cumulative_sum = torch.cumsum(keep_nms_counts / keep_nms_counts.sum(-1, keepdim=True), dim=-1)
    other_d = (cumulative_sum * other.unsqueeze(-1).expand(-1, q)).round().int()
    other_d = other_d - torch.cat([torch.zeros((1, 1)), other_d[:, :-1]], dim=-1)
    token_d = torch.min(torch.cat([(other_d + lower)[None], upper[None]]), dim=0)[0]
    sort_index = torch.argsort(keep_nms_counts, dim=-1, descending=True, stable=True)
    filling = torch.zeros(1).int()
    while torch.any(token_d.sum(-1) < other + lower.sum(-1)):
        b = torch.where(token_d.sum(-1) < other + lower.sum(-1))[0]
        g = sort_index[b, filling[b]]
        fill = torch.min(torch.stack([upper[b, g] - token_d[b, g], other[b] + lower[b].sum(-1) - token_d[b].sum(-1)]),
                         dim=0)[0]
        token_d[b, g] += fill
        filling[b] += 1
    order = torch.argsort(projector_scores, dim=1, descending=True, stable=True).transpose(1, 2).reshape(q, -1)
    picks = [order[i][:int(token_d.reshape(-1)[i])] for i in range(q)]
    return [0] + (torch.cat(picks) + 1).tolist()


def ref_hiprune(shallow_map: torch.Tensor, deep_map: torch.Tensor, k: int, side: int) -> list[int]:
    """Danielement321/HiPrune `encode_images` (batch 1): object layer attentions[8], deep attentions[-2] [H, T, T];
    24 -> `side`, 575 -> N - 1; alpha 0.1."""
    deep = deep_map.mean(dim=0).mean(dim=0)[None, 1:].clone()
    shallow = shallow_map.mean(dim=0).mean(dim=0)[None, 1:]
    N = shallow.shape[1]
    t = round(k * 0.1 / 5)
    s = torch.topk(shallow, k=t, dim=1)[1]
    s = torch.cat([s, s - 1, s + 1, s - side, s + side], dim=1).clamp(0, N - 1)
    s = torch.unique(s, sorted=False).unsqueeze(0)
    available = torch.zeros(1, N, dtype=torch.bool).scatter_(1, s, 1)
    deep[0] -= available.int().squeeze()
    d = torch.topk(deep, k=k - s.shape[1], dim=1)[1]
    return sorted(torch.cat([s, d], dim=1)[0].tolist())


# the rules on the model --------------------------------------------------------------------------------------------

def planned(model, inputs, config: hap.HAPConfig) -> int:
    n = int((inputs["input_ids"] == model.config.image_token_id).sum())
    return plan(config, decoder_shape(model), n, inputs["input_ids"].shape[1] - n).kept[0]


@pytest.mark.parametrize("retain", [0.111, 0.25])
@pytest.mark.parametrize("method", FOUR)
def test_each_method_keeps_the_official_picks_at_the_budget(llava24, stock, method, retain):
    model, processor, inputs = llava24
    config = hap.HAPConfig(method=method, retain=retain)
    r = hap.run(model, processor, noise_image(), QUESTION, config, max_new_tokens=1, trace=False)
    k = planned(model, inputs, config)
    assert model.model.vision_tower.config._attn_implementation == "sdpa"
    assert len(r.groups) == 1 and r.groups[0].layers[0] == 0 and r.retained_tokens == k
    kept = list(r.groups[0].kept)
    attn, hidden = stock["attentions"][-2], stock["hidden"][-2]
    if method == "scope":
        assert kept == ref_scope(attn, hidden, k)
    elif method == "holov":
        reference = ref_holov(stock["projected"], attn[:, 0, 1:].mean(0), k)
        assert -1 not in reference and kept == reference  # the official order: chunk by chunk
    elif method == "prunesid":
        assert [0] + [i + 1 for i in kept] == ref_prunesid(attn, hidden, k)  # [CLS] first, one of the k slots
    else:
        assert kept == ref_hiprune(stock["attentions"][8], attn, k, 12)


def test_holov_gives_a_chunks_surplus_to_the_next_chunks_where_the_official_pads():
    """A chunk of 2 tokens allotted 4 keeps its 2; its 2 surplus slots go to the next chunk (the official code pads 2
    zero vectors), and past the last chunk round to the first: the budget is kept."""
    scores = torch.tensor([10.0, 1.0, 1.0])
    assert holov.allocate(scores, [2, 5, 5], 6) == [2, 4, 0]  # floor 5 / 0 / 0, remainder 1 -> chunk 0: 6 -> 2 + 4
    assert holov.allocate(torch.tensor([1.0, 1.0, 10.0]), [5, 5, 2], 6) == [4, 0, 2]  # wraps round
    tokens = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    attention = torch.rand(12, generator=torch.Generator().manual_seed(1))
    for k in range(13):
        picks = holov.holistic_select(tokens, attention, k, chunks=5)
        assert len(picks) == k == len(set(picks.tolist()))


class TowerProbe(BeforeDecoder):
    """A pruner of the tests that reads three tower layers the generic way and keeps the first k patches."""

    name = "tower_probe_test"
    tower = (TowerRead(9 / 24, "map"), TowerRead(-3, "cls", hidden=True), TowerRead(None, "map", hidden=True))

    def select(self, state, cut):
        k = state.kept_count(cut.index)
        return Selection(torch.arange(k).expand(state.visual_pos.shape[0], -1))


def test_the_tower_capture_under_sdpa_equals_eager_attention(llava24, stock):
    """What a pruner's `tower` reads is captured while the tower runs SDPA, from each layer's q and k: the full maps,
    the [CLS] rows and the hidden states equal a stock eager pass's `attentions[i]` and `hidden_states[i + 1]`."""
    model, _, inputs = llava24
    register(TowerProbe)
    try:
        with hap.patched(model, hap.HAPConfig(method=TowerProbe.name, retain=0.5)) as patch, torch.no_grad():
            model(**inputs)
            layers = patch.state.vision.layers
    finally:
        unregister(TowerProbe.name)
    assert model.model.vision_tower.config._attn_implementation == "sdpa"
    att, hid = stock["attentions"], stock["hidden"]
    torch.testing.assert_close(layers[9 / 24].attention[0], att[8], atol=1e-6, rtol=1e-5)  # the 9th of 24
    torch.testing.assert_close(layers[-3].attention[0], att[21][:, 0], atol=1e-6, rtol=1e-5)  # the [CLS] row
    torch.testing.assert_close(layers[-3].hidden[0], hid[22], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layers[None].attention[0], att[22], atol=1e-6, rtol=1e-5)  # the feature layer: -2
    torch.testing.assert_close(layers[None].hidden[0], hid[-2], atol=1e-6, rtol=1e-5)
    assert layers[9 / 24].hidden is None and layers[-3].attention.shape == (1, 2, 145)


@pytest.mark.parametrize("method", FOUR)
def test_a_tower_without_cls_is_refused_by_name(method):
    model, _ = llava_qwen2_case()  # SigLIP, "full" strategy
    why = refusal(model, hap.HAPConfig(method=method))
    assert why is not None and f"method={method!r}" in why and "[CLS]" in why and type(model).__name__ in why


@pytest.mark.slow
def test_llava_next_runs_three_per_crop_and_refuses_prunesid_by_reason():
    """On LLaVA-NeXT (a 2-layer CLIP tower: feature layer -2 is a layer's output) SCOPE and HiPrune keep budget // crops
    per crop (less the picks the unpadding cuts), HoloV the budget over the whole image; PruneSID is refused."""
    model, processor = llava_next(vision_layers=2)
    why = refusal(model, hap.HAPConfig(method="prunesid"))
    assert why is not None and "K tokens per crop" in why and type(model).__name__ in why
    batch = zoo_inputs(processor, [QUESTION], [(112, 112)])
    for method in ("scope", "holov", "hiprune"):
        config = hap.HAPConfig(method=method, retain=0.5)
        with hap.patched(model, config) as patch, torch.no_grad():
            model(**batch)
        crops = len(patch.state.vision.places[0])
        kept, budget = patch.state.kept_orig.shape[1], patch.state.schedule.kept[0]
        assert (kept == budget) if method == "holov" else (0 < kept <= crops * (budget // crops))
