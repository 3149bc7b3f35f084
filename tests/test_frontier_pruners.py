"""The five 2025 pruners on the shared executor (docs/method.md §7): on a random LLaVA through `hap.run`, each method's
kept set is the official rule, written independently (`test_frontier_rules`' references: plain loops from the notes),
applied to cues captured here without the executor: the projected tokens from the model's own `get_image_features`,
the tower's attention by `output_attentions`, DART's keys and states recomputed from layer K-1 of a stock forward;
CDPruner with a random CLIP saved as a folder and loaded through `clip_model`; downsample's counts and pooled tokens;
each method's realised counts in the FLOPs accounting. The families run or refuse each method by name in
tests/test_zoo*.py (the zoo parametrises over every method); Qwen2-VL here."""

from __future__ import annotations

import math

import pytest
import torch
from test_frontier_rules import clip_folder as small_clip  # noqa: F401 (a fixture: the rules' tiny CLIP folder)
from test_frontier_rules import ref_cdpruner, ref_dart, ref_divprune, ref_grid, ref_pool, ref_relevance, ref_vispruner
from tiny_models import noise_image, qwen_vl_case, tiny_llava

import hap
from hap.planning.budget import plan
from hap.patch import decoder_of, refusal
from hap.patch.decoder import decoder_shape
from hap.pruners import pruner_class
from hap.runs.run import chat_prompt

torch.set_num_threads(1)
QUESTION = "what colour is the cube left of the red sphere ?"  # words of the tiny CLIP tokenizer
FIVE = ("divprune", "dart", "vispruner", "cdpruner", "downsample")


@pytest.fixture(scope="module")
def llava():
    """(model, processor, inputs): the tiny LLaVA (CLIP tower with [CLS], 144 visual tokens), eager attention so the
    tower returns its attention probabilities."""
    model, processor = tiny_llava("eager")
    inputs = processor(images=noise_image(), text=chat_prompt(processor, QUESTION), return_tensors="pt")
    return model, processor, inputs


@pytest.fixture(scope="module")
def tower(llava):
    """The vision tower's feature-layer cues and the projected tokens, from a stock pass."""
    model, _, inputs = llava
    cfg = model.config
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_attentions=True, output_hidden_states=True)
        feats = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                               vision_feature_layer=cfg.vision_feature_layer,
                                               vision_feature_select_strategy=cfg.vision_feature_select_strategy)
    layer = cfg.vision_feature_layer % len(out.hidden_states)
    return {"cls": out.attentions[layer - 1][0, :, 0, 1:].mean(0),  # [N] head mean of the [CLS] row
            "patches": out.hidden_states[layer][0, 1:],  # [N, Dv] the feature layer's patches, pre-projector
            "projected": feats.pooler_output[0]}  # [N, D] what the decoder receives


def run(llava, **knobs):
    model, processor, _ = llava
    return hap.run(model, processor, noise_image(), QUESTION, hap.HAPConfig(**knobs), max_new_tokens=2, trace=False)


def planned(llava, config: hap.HAPConfig) -> tuple[int, int]:
    """(the count the budget plans at the one cut, the count the rule keeps) of `config` on the tiny LLaVA."""
    model, _, inputs = llava
    N = int((inputs["input_ids"] == model.config.image_token_id).sum())
    s = plan(config, decoder_shape(model), N, inputs["input_ids"].shape[1] - N)
    return (s.planned or s.kept)[0], s.kept[0]


@pytest.mark.parametrize("retain", [0.25, 0.1])
def test_divprune_keeps_the_official_picks_of_the_projected_tokens(llava, tower, retain):
    r = run(llava, method="divprune", retain=retain)
    assert len(r.groups) == 1 and r.groups[0].layers[0] == 0  # one selection before the first decoder layer
    k = len(r.groups[0].kept)
    assert k == planned(llava, hap.HAPConfig(method="divprune", retain=retain))[1] == int(retain * 144)
    assert r.groups[0].kept == ref_divprune(tower["projected"], k)


@pytest.mark.parametrize("retain", [0.25, 0.4])
def test_vispruner_keeps_the_official_picks_of_the_tower_cues(llava, tower, retain):
    r = run(llava, method="vispruner", retain=retain)
    kept = r.groups[0].kept
    assert r.groups[0].layers[0] == 0 and kept == ref_vispruner(tower["cls"], tower["patches"], len(kept))


def save_clip(folder, source):
    """The random CLIP of `source` (test_frontier_rules' folder) with its vision tower as wide as the tiny LLaVA's
    (32), saved with the same tokenizer to `folder`."""
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    config = CLIPConfig.from_pretrained(source)
    config.vision_config.hidden_size = 32
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory, small_clip):
    return save_clip(tmp_path_factory.mktemp("clip"), small_clip)


def test_cdpruner_keeps_the_official_picks_with_a_clip_loaded_from_a_folder(llava, tower, clip_folder):
    from transformers import AutoTokenizer, CLIPModel

    model, _, _ = llava
    r = run(llava, method="cdpruner", retain=0.25, clip_model=str(clip_folder))
    kept = r.groups[0].kept
    clip, tok = CLIPModel.from_pretrained(clip_folder).eval(), AutoTokenizer.from_pretrained(clip_folder)
    ids = tok(QUESTION)["input_ids"]  # the raw question, BOS/EOS, no chat template: 13 ids in rows of 8
    rows = [ids[i:i + 8] for i in range(0, len(ids), 8)]
    with torch.no_grad():
        text = torch.cat([clip.get_text_features(input_ids=torch.tensor([row + [0] * (8 - len(row))]),
                                                 attention_mask=torch.tensor([[1] * len(row) + [0] * (8 - len(row))]))
                          .pooler_output for row in rows])
        image = clip.visual_projection(model.model.vision_tower.post_layernorm(tower["patches"]))
    relevance = ref_relevance([image], text)[0]
    assert len(kept) == 36 and kept == ref_cdpruner(tower["projected"], relevance, len(kept))
    other = run(llava, method="cdpruner", retain=0.25, clip_model=str(clip_folder))  # the CLIP is loaded once
    assert other.groups[0].kept == kept


def test_cdpruner_refuses_a_clip_that_does_not_pair_with_the_tower(llava, tmp_path):
    model, _, _ = llava
    why = refusal(model, hap.HAPConfig(method="cdpruner"))  # the default CLIP-L/336, refused before loading
    assert "clip_model='openai/clip-vit-large-patch14-336'" in why and "CLIP-L/336" in why
    why = refusal(model, hap.HAPConfig(method="cdpruner", clip_model=str(tmp_path / "missing")))
    assert why.startswith("method='cdpruner' cannot load its CLIP") and "no such folder" in why
    with pytest.raises(ValueError, match="clip_model='' must be a non-empty text"):
        hap.HAPConfig(clip_model="")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama applies it (halves rotated), written out."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("first_layers, retain", [(2, 0.7), (1, 0.5)])
def test_dart_keeps_the_official_picks_from_layer_k_minus_1(llava, first_layers, retain):
    """Keys after k_proj and RoPE (kv heads concatenated) and the output of layer K-1 through the final norm, from a
    stock forward; pivots in the official set order over absolute positions, which here is neither ascending nor by
    L1 norm."""
    model, _, inputs = llava
    config = hap.HAPConfig(method="dart", retain=retain, first_layers=first_layers)
    r = run(llava, method="dart", retain=retain, first_layers=first_layers)
    budget, count = planned(llava, config)
    assert r.groups[0].layers[0] == first_layers and len(r.groups[0].kept) == count == 4 + 8 * (budget // 8)
    lm = decoder_of(model)
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True).hidden_states  # [embeddings, after layer 0, ...]
        layer = lm.layers[first_layers - 1]
        x = layer.input_layernorm(hidden[first_layers - 1])
        T = x.shape[1]
        cos, sin = lm.rotary_emb(x, torch.arange(T)[None])
        k = layer.self_attn.k_proj(x).view(1, T, -1, layer.self_attn.head_dim).transpose(1, 2)
        keys = rotate(k, cos[:, None], sin[:, None]).transpose(1, 2).reshape(T, -1)
        normed = lm.norm(hidden[first_layers])[0]
    visual = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]
    start, length = int(visual[0]), len(visual)
    assert r.groups[0].kept == ref_dart(keys, normed, start, length, budget // 8)
    l1 = keys.abs().sum(-1)
    image = sorted(visual.tolist(), key=lambda i: (-float(l1[i]), i))[:4]
    text = sorted(range(start + length, T), key=lambda i: (-float(l1[i]), i))[:4]
    assert list(set(image + text)) not in (sorted(image + text), image + text)  # the set order is its own


def test_downsample_writes_the_pooled_grid_and_keeps_its_windows_first_patches(llava, tower):
    """The decoder's first visual slots carry the 12 x 12 grid average-pooled to the budget (within one pooled row),
    each reported at the first patch of its window; the accounting counts what the decoder runs on."""
    model, _, inputs = llava
    seen = []
    hook = decoder_of(model).layers[0].input_layernorm.register_forward_pre_hook(  # inside layer 0: after the cut
        lambda module, args: seen.append(args[0].clone()))
    try:
        r = run(llava, method="downsample", retain=0.3)
    finally:
        hook.remove()
    budget, count = planned(llava, hap.HAPConfig(method="downsample", retain=0.3))
    rows, cols = ref_grid(12, 12, budget)
    assert count == rows * cols and budget - cols < count <= budget
    pooled, first = ref_pool(tower["projected"].view(12, 12, -1), rows, cols)
    assert r.groups[0].kept == first
    start = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0, 0])
    prompt = seen[0]  # the prefill's first layer: the prompt with the pooled block in the first visual slots
    assert prompt.shape[1] == inputs["input_ids"].shape[1] - 144 + count
    assert torch.allclose(prompt[0, start:start + count].double(), torch.tensor(pooled, dtype=torch.float64),
                          atol=1e-5)
    assert r.retained_tokens == pytest.approx(count)  # one cut before layer 0: every layer runs on the pooled grid


def test_the_accounting_counts_what_each_rule_keeps(llava):
    """DART's 4 + 8T and downsample's pooled grid replace the budget's count in the schedule, so retain and the
    FLOPs ratio are the realised ones (noted); the selections before layer 0 keep the budget's count."""
    model, _, inputs = llava
    shape = decoder_shape(model)
    T = inputs["input_ids"].shape[1]
    for method in FIVE:
        config = hap.HAPConfig(method=method, retain=0.3, first_layers=1)
        s = plan(config, shape, 144, T - 144)
        full = 0 if pruner_class(method).before_decoder else 1
        assert s.cuts == [full]
        assert s.retain == pytest.approx((full * 144 + (shape.layers - full) * s.kept[0]) / (shape.layers * 144))
        if method in ("dart", "downsample"):
            assert s.planned and s.kept != s.planned and any("realised retain" in n for n in s.notes)
        else:
            assert not s.planned and s.kept[0] == math.floor(0.3 * 144)
    assert plan(hap.HAPConfig(method="dart", retain=0.7), shape, 144, T - 144).cuts == [1]  # K >= 1 (reads K-1)
    with pytest.raises(ValueError, match="method='dart' cuts entering layer 1 at the earliest .* first_layers=0 says: "
                                         "retain=0.2 is unreachable"):
        plan(hap.HAPConfig(method="dart", retain=0.2, first_layers=0), shape, 144, T - 144)


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen2_vl_runs_dart_and_refuses_the_others_by_name(version):
    """Qwen2-VL / 2.5-VL: DART keeps the original M-RoPE ids; the selections before the decoder renumber positions
    (refused on M-RoPE), VisPruner and CDPruner need a [CLS] token; downsample resizes the image in `hap.run`
    (tests/test_downsample_resized.py)."""
    model, make = qwen_vl_case(version=version)
    for method in FIVE:
        why = refusal(model, hap.HAPConfig(method=method, retain=0.5))
        if method in ("dart", "downsample"):
            assert why is None
            continue
        assert f"method={method!r}" in why and type(model).__name__ in why
    batch = make(["what is it ?"])
    with hap.patched(model, hap.HAPConfig(method="dart", retain=0.6, first_layers=2)) as patch, torch.no_grad():
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert patch.state.cuts[0].layer == 2 and patch.state.cuts[0].kept.shape[1] == patch.state.schedule.kept[0]


def test_the_app_loads_the_default_clip_or_an_allowed_local_folder_only(tmp_path):
    """`clip_model` comes from the page too: no hub id beyond the default (a download), local folders only where the
    operator allows them (HAP_APP_ALLOW_LOCAL)."""
    from app.settings import Settings, check_clip

    default = hap.HAPConfig().clip_model
    assert check_clip(default, Settings()) == default
    with pytest.raises(ValueError, match=r"clip_model='someone/clip': this server loads only 'openai/clip-vit"):
        check_clip("someone/clip", Settings(allow_local=True))
    with pytest.raises(ValueError, match="loads only"):
        check_clip(str(tmp_path), Settings())
    assert check_clip(str(tmp_path), Settings(allow_local=True)) == str(tmp_path)


@pytest.mark.parametrize("method", ["divprune", "dart", "vispruner", "downsample"])
def test_a_padded_batch_keeps_what_each_prompt_keeps_alone(method):
    """Two prompts of different lengths (left-padded) and images: each sample's kept set is its own alone (`generate`
    counts each sample's positions from its first real token, as DART's rotated keys need; its pivot order follows
    positions counted so too)."""
    from tiny_models import inputs_for

    model, processor = tiny_llava()
    config = hap.HAPConfig(method=method, retain=0.5, first_layers=1)
    questions = ["what colour is the cube ?", "is there a red sphere left of the big green cube in the picture ?"]
    with hap.patched(model, config) as patch, torch.no_grad():
        model.generate(**inputs_for(processor, questions, [0, 1]), max_new_tokens=1)
        together = patch.state.cuts[0].kept
    for b in range(2):
        with hap.patched(model, config) as patch, torch.no_grad():
            model.generate(**inputs_for(processor, questions[b:b + 1], [b]), max_new_tokens=1)
        assert torch.equal(together[b], patch.state.cuts[0].kept[0]), b
