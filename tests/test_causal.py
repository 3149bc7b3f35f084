"""hap.causal: exact head ablation against a plain loop, planted heads and tokens found, attribution vs ablation."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import hap
from hap import causal
from hap.causal import spearman
from hap.patch import attention_outputs, decoder_of
from tiny_models import CASES, noise_image, tiny_llava

PROMPT = "what color is it ?"
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-llava"


def loop_ablation(model, inputs: dict, answer: int | None = None) -> torch.Tensor:
    """`[layers, heads]`: log p drop of `answer` (None: the stock answer) with one head's o_proj input slice zeroed, one
    forward each."""
    L, H = causal.head_layout(model)
    with torch.no_grad():
        base = model(**inputs).logits[0, -1].log_softmax(-1)
        answer = int(base.argmax()) if answer is None else answer
        out = torch.zeros(L, H)
        for layer, proj in enumerate(attention_outputs(model)):
            for head in range(H):
                def zero(module, args, head=head):
                    x = args[0].clone()
                    d = x.shape[-1] // H
                    x[..., head * d : (head + 1) * d] = 0
                    return (x,)

                handle = proj.register_forward_pre_hook(zero)
                out[layer, head] = base[answer] - model(**inputs).logits[0, -1].log_softmax(-1)[answer]
                handle.remove()
    return out


def hooks(model) -> int:
    """Forward hooks on the model's modules (transformers adds its own at the first forward: count after one)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("case", ["llava", "llava-qwen2", "qwen2-vl"])
def test_ablation_equals_a_plain_loop(case):
    model, make = CASES[case]()
    inputs = make([PROMPT])
    stock = int(model(**inputs).logits[0, -1].argmax())
    before = hooks(model)
    answer, _, batched = causal.ablation(model, inputs, batch_size=5)
    assert answer == stock
    torch.testing.assert_close(batched, loop_ablation(model, inputs), atol=1e-5, rtol=0)
    assert hooks(model) == before


def test_ablation_keeps_no_kv_cache():
    """Each batched forward of the ablation runs without a cache (16 decoder copies each keeping one was waste)."""
    model, make = CASES["llava"]()
    caches = []
    handle = decoder_of(model).register_forward_hook(lambda m, a, kw, out: caches.append(out.get("past_key_values")),
                                                     with_kwargs=True)
    causal.ablation(model, make([PROMPT]), batch_size=5)
    handle.remove()
    assert len(caches) == math.ceil((1 + 4 * 4) / 5) and all(c is None for c in caches), caches


def test_exact_ablation_is_refused_above_the_budget_naming_attribution(monkeypatch):
    """causal='ablation' asked by name (the page's radio, /analyze, the CLI) obeys ABLATION_BUDGET as 'auto' does."""
    from app import causal as page

    model, processor = tiny_llava()
    assert causal.resolve_setting(model, "ablation") == "ablation"  # the tiny model is within the budget
    L, H = causal.head_layout(model)
    monkeypatch.setattr(causal, "ABLATION_BUDGET", L * H * sum(p.numel() for p in model.parameters()) - 1)
    refusal = r"causal='ablation' runs one forward per head, 4 x 4 heads .*> ABLATION_BUDGET.*use causal='attribution'"
    with pytest.raises(ValueError, match=refusal):
        causal.resolve_setting(model, "ablation")
    with pytest.raises(ValueError, match=refusal):
        page.analyze(model, processor, noise_image(1), PROMPT, "ablation", hap.InputLimits())
    assert causal.resolve_setting(model, "auto") == "attribution"


def test_the_app_refuses_ablation_above_the_budget_before_any_run(monkeypatch, tmp_path):
    """/analyze and the page (one handler) refuse causal='ablation' above the budget as a message, before the three
    runs of the comparison."""
    import gradio as gr
    from app_model import ROOT, default_model

    import app.handler as handler_module
    from app import pipeline
    from app.settings import Settings, knob_defaults

    name = default_model(tmp_path)
    ran = []
    monkeypatch.setattr(pipeline, "gpu_compare", lambda *args, **kwargs: ran.append(args))
    monkeypatch.setattr(causal, "ABLATION_BUDGET", 0)
    scene = {"path": str(ROOT / "assets" / "examples" / "scene_600000.png")}
    with pytest.raises(gr.Error, match=r"causal='ablation' runs one forward per head.*use causal='attribution'"):
        handler_module.Handler(Settings(models=[name])).analyze(scene, PROMPT, name, causal="ablation",
                                                                 **knob_defaults(name))
    assert not ran


def test_ablation_explains_the_answer_token_of_the_token_importance(monkeypatch):
    """Head and token importance explain one answer token, taken once (from the gradient pass), even where the two
    passes' greedy tokens could differ (a near tie in half precision): forced here by another token."""
    model, processor = tiny_llava()
    image = noise_image(1)
    inputs = causal.prepare(model, processor, image, PROMPT)
    real = causal.gradients
    stock = real(model, inputs)[0]
    other = (stock + 1) % model.config.text_config.vocab_size
    monkeypatch.setattr(causal, "gradients", lambda model, inputs, *a: (other, *real(model, inputs, *a)[1:]))
    found = causal.analyze(model, processor, image, PROMPT, mode="ablation")
    assert found.answer_token == other
    torch.testing.assert_close(found.head_importance, loop_ablation(model, inputs, other), atol=1e-5, rtol=0)


def test_public_api_shapes_modes_and_errors():
    model, processor = tiny_llava("eager")
    heads = hap.head_importance(model, processor, noise_image(1), PROMPT, mode="attribution")
    before = hooks(model)
    assert heads.shape == (4, 4) and heads.dtype == torch.float32 and heads.device.type == "cpu"
    tokens = hap.token_importance(model, processor, noise_image(1), PROMPT)
    assert tokens.shape == (144,) and bool((tokens >= 0).all())
    assert hooks(model) == before  # the first call's own hooks are gone too: one more call added none
    with pytest.raises(ValueError, match="mode"):
        hap.head_importance(model, processor, noise_image(1), PROMPT, mode="rollout")
    with hap.patched(model, hap.HAPConfig()), pytest.raises(ValueError, match="unpatch"):
        hap.token_importance(model, processor, noise_image(1), PROMPT)


def plant_head(model, inputs: dict, layer: int, head: int) -> None:
    """Make head (`layer`, `head`) write toward the stock answer token: its o_proj slice maps the head's output at
    the last position onto the answer's unembedding direction."""
    proj = attention_outputs(model)[layer]
    d = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
    seen = {}
    handle = proj.register_forward_pre_hook(lambda m, args: seen.update(x=args[0][0, -1, head * d : (head + 1) * d]))
    with torch.no_grad():
        answer = int(model(**inputs).logits[0, -1].argmax())
    handle.remove()
    unembed = model.get_output_embeddings().weight[answer].detach()
    with torch.no_grad():
        proj.weight[:, head * d : (head + 1) * d] = torch.outer(unembed / unembed.norm(), seen["x"] / seen["x"].norm())


@pytest.mark.parametrize("mode", causal.MODES)
def test_a_planted_head_ranks_first(mode):
    model, processor = tiny_llava()
    image = noise_image(1)
    plant_head(model, causal.prepare(model, processor, image, PROMPT), layer=1, head=2)
    importance = hap.head_importance(model, processor, image, PROMPT, mode=mode)
    assert int(importance.argmax()) == 1 * 4 + 2


def test_a_planted_decisive_visual_token_ranks_first():
    """Only visual token 37 carries direction e; layer 0's head 0 reads e into its value and writes it toward the
    answer token, so the answer depends on that token (checked by replacing each token with the mean one)."""
    model, processor = tiny_llava()
    image, planted = noise_image(1), 37
    inputs = causal.prepare(model, processor, image, PROMPT)
    e = torch.randn(64, generator=torch.Generator().manual_seed(0))
    e /= e.norm()

    def only_one_carries_e(module, args, out):
        out = out - (out @ e)[..., None] * e
        out[:, planted] += out.norm(dim=-1).mean() * e
        return out

    model.model.multi_modal_projector.register_forward_hook(only_one_carries_e)
    with torch.no_grad():
        answer = int(model(**inputs).logits[0, -1].argmax())
        attn = model.model.language_model.layers[0].self_attn
        unembed = model.get_output_embeddings().weight[answer]
        attn.v_proj.weight[:16] = torch.outer(torch.eye(16)[0], e)
        attn.o_proj.weight[:, :16] = 10 * torch.outer(unembed / unembed.norm(), torch.eye(16)[0])
    tokens = hap.token_importance(model, processor, image, PROMPT)
    assert int(tokens.argmax()) == planted
    # the gradient norm measures sensitivity, not dependence: it misses the token (docs/method.md §11)
    assert int(hap.token_importance(model, processor, image, PROMPT, score="gradient_norm").argmax()) != planted
    visual = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]

    def mean_occluded(v: int):
        def replace(x):
            x = x.clone()
            x[0, visual[v]] = x[0, visual].mean(0)
            return x
        return replace

    with torch.no_grad():
        base = model(**inputs).logits[0, -1].log_softmax(-1)[answer]
        drops = []
        for v in (planted, 0, 70, 143):
            with causal.decoder_input(model, mean_occluded(v)):
                drops.append(float(base - model(**inputs).logits[0, -1].log_softmax(-1)[answer]))
    assert drops[0] > 10 * max(abs(d) for d in drops[1:])


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="the shipped model is not in assets/")
def test_attribution_agrees_with_ablation_on_the_shipped_model():
    from analysis.scenes import heldout_items

    model, processor = hap.load_model(str(SHIPPED), device="cpu")
    rhos = []
    for scene, question in heldout_items(range(500_000, 500_004), 1):
        inputs = causal.prepare(model, processor, scene.image, question.text)
        exact = causal.ablation(model, inputs)[2]
        first_order = causal.gradients(model, inputs)[2]
        rhos.append(spearman(first_order.numpy().ravel(), exact.numpy().ravel()))
    assert np.mean(rhos) >= 0.6, rhos
