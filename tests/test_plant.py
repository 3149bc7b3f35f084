"""hap.plant, the head lab: planted sink and dispersed heads change every forward exactly as planned (SDPA, eager,
GQA, LLaVA and Qwen2-VL), a massive plan's sink tokens carry a massive activation from the first planted sink layer on
(GQA, M-RoPE, sliding layers), what HAP captures is what the model runs, the model is stock after the block, bad plans
are refused naming the field; on the shipped model both sink detectors find planted sinks over 1 and 4 tokens."""

from pathlib import Path

import pytest
import torch

import hap
from hap.causal import ablation, gradients
from hap.patch import attention_outputs, decoder_of
from hap.lab.plan import (MASSIVE_RATIO, Plan, classifier_report, massive_activation, massive_dims, plant_attention,
                          precision_recall, redundant_tokens, share_plan)
from hap.runs.run import chat_prompt
from tiny_models import llava_case, qwen_vl_case
from tiny_zoo import picture
from tiny_zoo_recent import gemma3

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "assets" / "tiny-llava"

CASES = {
    "llava-sdpa-gqa": lambda: llava_case("sdpa"),
    "llava-eager-gqa": lambda: llava_case("eager"),
    "qwen2vl-sdpa": lambda: qwen_vl_case("sdpa"),
}


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _hooks(model) -> int:
    """Forward hooks on the model (transformers adds its own output-capturing ones on the first forward)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# --- the arithmetic -------------------------------------------------------------------------------------------


def test_plant_attention_moves_the_share_and_keeps_rows_summing():
    torch.manual_seed(0)
    attn = torch.rand(2, 3, 4, 10).softmax(-1)  # 3 heads, 4 rows, 10 keys
    visual = torch.zeros(2, 10, dtype=torch.bool)
    visual[:, 2:8] = True
    sink = torch.zeros(2, 10, dtype=torch.bool)
    sink[:, 3] = True
    out = plant_attention(attn, visual, sink, [0], [2], 0.9)
    assert torch.allclose(out.sum(-1), attn.sum(-1))
    assert bool((out[:, 0, :, 3] >= 0.9).all())  # the sink head: at least the strength on the sink token
    assert torch.equal(out[:, 1], attn[:, 1])  # an unplanted head untouched
    disp = out[:, 2]  # the dispersed head: its text attention and visual share unchanged, visual part nearly flat
    assert torch.allclose(disp[..., ~visual[0]], attn[:, 2][..., ~visual[0]])
    assert torch.allclose(disp[..., visual[0]].sum(-1), attn[:, 2][..., visual[0]].sum(-1))
    spread = disp[..., visual[0]] / disp[..., visual[0]].sum(-1, keepdim=True)
    assert float((spread - 1 / 6).abs().max()) < 0.1 * 1 / 6 * 6


def test_a_massive_activation_lifts_the_sink_rows_in_fixed_dimensions():
    torch.manual_seed(0)
    hidden = torch.randn(2, 10, 4096, dtype=torch.bfloat16)
    visual = torch.zeros(2, 10, dtype=torch.bool)
    visual[:, 2:8] = True
    sink = torch.zeros(2, 10, dtype=torch.bool)
    sink[0, 3], sink[1, [4, 6]] = True, True
    out = massive_activation(hidden, visual, sink)
    assert massive_dims(4096) == [1415, 2533] and massive_dims(64) == [22, 39]
    assert out.dtype == torch.bfloat16 and torch.equal(out[~sink], hidden[~sink])
    changed = (out != hidden).any(1).any(0).nonzero()[:, 0].tolist()  # the dimensions any row changed in
    assert changed == [1415, 2533]
    norms = out.float().norm(dim=-1)
    median = hidden.float().norm(dim=-1)[visual].view(2, -1).median(-1).values
    assert torch.allclose(norms[sink], MASSIVE_RATIO * median[[0, 1, 1]], rtol=0.02)
    assert torch.equal(massive_activation(hidden, torch.zeros_like(visual), sink), hidden)  # no visual rows: nothing


def test_redundant_tokens_pick_the_plain_background():
    x = torch.randn(1, 9, 16)
    x[0, [1, 4, 7]] = torch.ones(16)  # three identical background patches
    assert redundant_tokens(x, 1).tolist() == [[1]]
    assert redundant_tokens(x, 3).tolist() == [[1, 4, 7]]


def test_precision_recall_and_share_plan():
    pr = precision_recall([(0, 1), (1, 2)], [(0, 1), (2, 0)])
    assert (pr["precision"], pr["recall"], pr["missed"]) == (0.5, 0.5, [[1, 2]])
    assert precision_recall([], [])["precision"] is None
    plan = share_plan(range(2, 4), 8, 0.25, seed=3)
    assert len(plan.sink) == 4 and {l for l, _ in plan.sink} == {2, 3}
    assert share_plan(range(2, 4), 8, 0.25, seed=3) == plan
    classes = [["sink", "optimal"], ["dispersed", ""]]
    report = classifier_report(Plan.of(sink=[(0, 0)], dispersed=[(1, 1)]), classes)
    assert report["sink"]["recall"] == 1.0 and report["dispersed"]["recall"] == 0.0


@pytest.mark.parametrize("value, field", [
    ({"sink": [[0, 9]]}, "head 9"), ({"sink": [[7, 0]]}, "layer 7"), ({"dispersed": [[-1, 0]]}, "layer -1"),
    ({"sink_tokens": []}, "sink_tokens"), ({"strength": 1.5}, "strength"), ({"strength": -0.1}, "strength"),
    ({"sink": [[0, 1]], "dispersed": [[0, 1]]}, "dispersed"), ({"sink": [[0]]}, "sink"), ({"heads": []}, "unknown"),
    ("{not json", "JSON"), ([1, 2], "JSON object"), ({"sink_tokens": ["a"]}, "sink_tokens"),
    ({"sink_tokens": 0}, "sink_tokens=0"), ({"massive": "yes"}, "massive"),
])
def test_bad_plans_are_refused_naming_the_field(value, field):
    model, _ = llava_case()
    with pytest.raises(ValueError, match=field):
        plan = Plan.from_json(value)
        with hap.plant(model, plan.sink, plan.dispersed, plan.sink_tokens, plan.strength):
            pass
    assert _hooks(model) == 0


def test_out_of_range_sink_tokens_are_refused_at_the_prefill():
    model, make = llava_case()
    with pytest.raises(ValueError, match=r"sink_tokens \[144\] are out of range; this image has visual tokens 0..143"):
        with hap.plant(model, sink=[(1, 0)], sink_tokens=[144]):
            _logits(model, make(["what color ?"], [0]))
    with pytest.raises(ValueError, match=r"sink_tokens=145 is more than this image's 144 visual tokens"):
        with hap.plant(model, sink=[(1, 0)], sink_tokens=145):
            _logits(model, make(["what color ?"], [0]))


# --- the model ------------------------------------------------------------------------------------------------


def test_a_plan_of_nothing_leaves_logits_exactly_equal_and_the_block_leaves_the_model_stock():
    model, make = llava_case()
    inputs = make(["what color is the circle ?"], [0])
    stock, hooks = _logits(model, inputs), _hooks(model)
    with hap.plant(model):
        assert torch.equal(_logits(model, inputs), stock)
    with hap.plant(model, sink=[(1, 0), (2, 3)], dispersed=[(3, 1)]):
        assert not torch.equal(_logits(model, inputs), stock)
    assert torch.equal(_logits(model, inputs), stock) and _hooks(model) == hooks
    with pytest.raises(RuntimeError, match="boom"):
        with hap.plant(model, sink=[(1, 0)]):
            raise RuntimeError("boom")
    assert torch.equal(_logits(model, inputs), stock) and _hooks(model) == hooks


def _reference(model, inputs, layer: int, head: int, sink_token: int, kind: str, strength: float) -> tuple:
    """(eager stock attention of `head` at `layer` over every key [B, T, T], its values [B, T, d], visual and
    sink masks [B, T]) from the stock model run eagerly."""
    taken = {}
    attn_module = model.model.language_model.layers[layer].self_attn
    handle = attn_module.v_proj.register_forward_hook(lambda m, a, out: taken.update(v=out))
    implementation = model.config.text_config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
    finally:
        handle.remove()
        model.set_attn_implementation(implementation)
    A = out.attentions[layer][:, head].float()
    group = attn_module.config.num_attention_heads // attn_module.config.num_key_value_heads
    B, T = A.shape[:2]
    v = taken["v"].view(B, T, -1, attn_module.head_dim)[:, :, head // group].float()
    visual = inputs["input_ids"] == model.config.image_token_id
    sink = torch.zeros_like(visual)
    sink[:, visual[0].nonzero()[sink_token, 0]] = True
    return A, v, visual, sink


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["sink", "dispersed"])
def test_the_planted_head_runs_the_planned_attention_and_a_sink_reads_nothing(case, kind):
    """The planted head's output (its o_proj input slice) on the rows after the image equals A' V', A' the eager
    stock attention planted by hand, V' its values with the sink token's zeroed for a sink; other heads and rows
    are untouched. With GQA (2 kv heads of 4 query heads) the head's neighbour in its group stays stock."""
    model, make = CASES[case]()
    inputs = make(["what color is the circle ?"], [0])
    layer, head, token, s = 1, 2, 5, 0.8
    A, v, visual, sink = _reference(model, inputs, layer, head, token, kind, s)
    seen = {}
    o_proj = attention_outputs(model)[layer]
    with hap.plant(model, **{kind: [(layer, head)]}, sink_tokens=[token], strength=s, massive=False):
        handle = o_proj.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
        try:
            _logits(model, inputs)
        finally:
            handle.remove()
    handle = o_proj.register_forward_pre_hook(lambda m, a: seen.update(stock=a[0]))
    _logits(model, inputs)
    handle.remove()
    B, T = A.shape[:2]
    d = v.shape[-1]
    x, stock = seen["x"].view(B, T, -1, d), seen["stock"].view(B, T, -1, d)
    after = torch.arange(T) > visual[0].nonzero().max()
    planted = plant_attention(A[:, None], visual, sink, [0] if kind == "sink" else [],
                              [0] if kind == "dispersed" else [], s)[:, 0]
    values = v * (~sink).float()[..., None] if kind == "sink" else v
    expected = planted @ values
    assert torch.allclose(x[:, after, head].float(), expected[:, after], atol=1e-5)
    assert torch.equal(x[:, ~after, head], stock[:, ~after, head])
    others = [h for h in range(x.shape[2]) if h != head]
    assert torch.equal(x[:, :, others], stock[:, :, others])
    if kind == "sink":
        assert float(planted[:, after][..., sink[0]].sum(-1).min()) >= s - 1e-6


def test_a_full_strength_sink_head_outputs_nothing_after_the_image():
    model, make = llava_case()
    inputs = make(["what color ?"], [0])
    seen = {}
    with hap.plant(model, sink=[(2, 1)], strength=1.0):
        handle = attention_outputs(model)[2].register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
        _logits(model, inputs)
        handle.remove()
    T = inputs["input_ids"].shape[1]
    after = (torch.arange(T) > (inputs["input_ids"][0] == model.config.image_token_id).nonzero().max())
    assert float(seen["x"].view(1, T, 4, -1)[0, after, 1].abs().max()) == 0.0


def _gemma3_case():
    model, processor = gemma3()

    def make(questions, seeds):
        return processor(images=[[picture((100, 170), seed)] for seed in seeds],
                         text=[chat_prompt(processor, q) for q in questions], return_tensors="pt", padding=True)
    return model, make


MASSIVE_CASES = {"llava-gqa": llava_case, "qwen2vl-mrope": qwen_vl_case, "gemma3-sliding": _gemma3_case}


def _layer_inputs(model, inputs) -> list[torch.Tensor]:
    """The hidden states entering every decoder layer (after any planting hook), sample 0, float32."""
    seen, handles = {}, []
    for i, layer in enumerate(decoder_of(model).layers):
        take = lambda m, args, kwargs, i=i: seen.update({i: (args[0] if args else kwargs["hidden_states"])[0].float()})
        handles.append(layer.register_forward_pre_hook(take, with_kwargs=True))
    try:
        _logits(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[i] for i in sorted(seen)]


@pytest.mark.parametrize("case", list(MASSIVE_CASES))
def test_massive_sink_tokens_stand_out_from_the_first_planted_sink_layer_on(case):
    """A massive plan (two sink heads in layer 1, Gemma 3's 3, two sink tokens): from that layer's input on the sink
    tokens' norm is far past sink_rho x the median visual token's (float32 norms); before it, and with massive=False,
    they are ordinary; a dispersed-only plan adds nothing; decode steps agree with a full forward; after the block,
    stock."""
    model, make = MASSIVE_CASES[case]()
    inputs = make(["what color is the circle ?"], [0])
    stock = _logits(model, inputs)
    visual = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]
    rho = hap.HAPConfig().sink_rho

    def ratios(**plan) -> list[float]:
        with hap.plant(model, sink_tokens=[1, 4], **plan) as lab:
            hidden = _layer_inputs(model, inputs)
            assert lab.sink_index[0].tolist() == [1, 4]
        norms = [h.norm(dim=-1) for h in hidden]
        return [float(n[visual[[1, 4]]].min() / n[visual].median()) for n in norms]

    first = 3 if case.startswith("gemma3") else 1  # Gemma 3's layers 0-2 slide a window: planting there is refused
    if first == 3:
        with pytest.raises(ValueError, match="sink: layer 1 of Gemma3ForConditionalGeneration slides a window of 8 "
                                             r"tokens; hap.plant plants heads in full-attention layers only \(3\)"):
            ratios(sink=[(1, 0)])
    massive = ratios(sink=[(first, 0), (first, 1)])
    assert all(r > 3 * rho for r in massive[first:]) and all(r < rho for r in massive[:first]), massive
    assert all(r < rho for r in ratios(sink=[(first, 0), (first, 1)], massive=False))
    assert all(r < rho for r in ratios(dispersed=[(first, 0)]))
    full = dict(inputs)
    with hap.plant(model, sink=[(first, 0)], sink_tokens=2), torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        full.update(input_ids=out.sequences, attention_mask=torch.ones_like(out.sequences))
        for key in ("mm_token_type_ids", "token_type_ids"):
            if key in inputs:
                full[key] = (out.sequences == model.config.image_token_id).to(inputs[key].dtype)
        logits = model(**full, use_cache=False).logits
    T = inputs["input_ids"].shape[1]
    for step, step_logits in enumerate(out.logits):
        assert torch.allclose(step_logits, logits[:, T - 1 + step], atol=1e-4)
    assert torch.equal(_logits(model, inputs), stock)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_decodes_what_a_full_forward_computes_with_the_plan(case):
    """The planted decode steps (keys from the cache) agree with a no-cache forward over prompt + answer."""
    model, make = CASES[case]()
    inputs = make(["what color is the circle ?", "is there a square ?"], [0, 1])
    with hap.plant(model, sink=[(1, 0), (3, 3)], dispersed=[(2, 1)], strength=0.9), torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        full = dict(inputs, input_ids=out.sequences,
                    attention_mask=torch.cat([inputs["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1))
        if "mm_token_type_ids" in inputs:
            full["mm_token_type_ids"] = (out.sequences == model.config.image_token_id).int()
        logits = model(**full, use_cache=False).logits
    T = inputs["input_ids"].shape[1]
    for step, step_logits in enumerate(out.logits):
        assert torch.allclose(step_logits, logits[:, T - 1 + step], atol=1e-4)


@pytest.mark.parametrize("case", ["llava-sdpa-gqa", "qwen2vl-sdpa"])
def test_hap_scores_what_the_planted_model_runs(case):
    """Under HAP's pruned prefill (a cut, merged tokens), the captured rows of a planted sink head hold at least
    the strength on the sink token; generate runs to the end and the block leaves no hook."""
    model, make = CASES[case]()
    inputs = make(["what color is the circle ?"], [0])
    _logits(model, inputs)  # transformers adds its own output-capturing hooks on the first forward
    hooks = _hooks(model)
    # relevance top-k (diversity=0): HAP+'s diversity counts the flagged sink token as a duplicate and drops it at the
    # cut (docs/method.md §10), and layer 2's planted head could then park on nothing
    config = hap.HAPConfig(retain=0.5, first_layers=1, groups=2, diversity=0.0)
    with hap.plant(model, sink=[(0, 1), (2, 2)], sink_tokens=[3], strength=0.9, massive=False) as lab:
        with hap.patched(model, config, trace=True) as patch, torch.no_grad():
            model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert lab.report()["sink_tokens_used"] == [3]
    for layer, head in ((0, 1), (2, 2)):
        traced = patch.state.tracer.layers[layer]
        on_sink = traced.visual_share[0, head] * traced.head_attention[0, head, 3]  # rows="last": one row
        assert float(on_sink) >= 0.9 - 1e-5
    assert _hooks(model) == hooks


def test_the_causal_path_sees_the_planted_heads():
    model, make = llava_case(layers=2)
    inputs = make(["what color ?"], [0])
    stock = ablation(model, inputs)[2]
    with hap.plant(model, sink=[(0, 0)], strength=1.0):
        planted = ablation(model, inputs)[2]
        attribution = gradients(model, inputs)[2]
    assert not torch.allclose(stock, planted)
    assert torch.isfinite(attribution).all()


# --- the shipped model: the classifier finds the planted heads ---------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    if not (SHIPPED / "config.json").is_file():
        pytest.skip("the shipped model is not in assets/")
    return hap.load_model(str(SHIPPED), device="cpu")


def _classes(model, processor, items, plan: Plan, config: hap.HAPConfig) -> list[list[list[str]]]:
    classes = []
    with hap.plant(model, plan.sink, plan.dispersed, plan.sink_tokens, plan.strength, plan.massive):
        for scene, question in items:
            classes.append(hap.run(model, processor, scene.image, question.text, config, max_new_tokens=1).head_class)
    return classes


def _found(model, processor, items, plan: Plan, detector: str) -> tuple[float, float]:
    """(mean recall of the planted sink heads, mean share of the unplanted heads classed sink) over `items`."""
    config = hap.HAPConfig(method="none", sink_detector=detector)
    layers, heads = model.config.text_config.num_hidden_layers, model.config.text_config.num_attention_heads
    found = [classifier_report(plan, c)["sink"] for c in _classes(model, processor, items, plan, config)]
    false = sum(f["classified"] - len(f["found"]) for f in found) / ((layers * heads - len(plan.sink)) * len(found))
    return sum(f["recall"] for f in found) / len(found), false


@pytest.mark.slow
def test_planted_heads_are_classified_on_held_out_scenes(shipped):
    """Held-out test scenes (seeds 500000+; the settings were chosen on validation seeds 400000-400005): planted
    sinks in half the heads of every layer, parked on 1, 4 or 8 sink tokens per image, are classified sink by the
    paper's norm test (massive activations) and by the attention-consensus test (recall >= 0.9), unplanted heads
    rarely (<= 10%); without the massive activation the norm test sees none and the consensus test still finds them;
    planted dispersed heads are classified dispersed (recall >= 0.8)."""
    from analysis.scenes import heldout_items

    model, processor = shipped
    items = list(heldout_items(range(500_000, 500_004), 1))
    layers, heads = model.config.text_config.num_hidden_layers, model.config.text_config.num_attention_heads
    for count in (1, 4, 8):
        sinks = share_plan(range(layers), heads, 0.5, seed=0, sink_tokens=count)
        for detector in ("norm", "consensus"):
            recall, false = _found(model, processor, items, sinks, detector)
            assert recall >= 0.9 and false <= 0.1, (count, detector, recall, false)
        plain = share_plan(range(layers), heads, 0.5, seed=0, sink_tokens=count, massive=False)
        assert _found(model, processor, items, plain, "norm")[0] == 0.0
        assert _found(model, processor, items, plain, "consensus")[0] >= 0.9
    scene, question = items[0]  # the norm test flags the 4 sink tokens at every layer from the first planted one on
    with hap.plant(model, sink=[(1, 0), (3, 2)], sink_tokens=4):
        result = hap.run(model, processor, scene.image, question.text, hap.HAPConfig(method="none"), max_new_tokens=1)
    assert result.sink_tokens == [0] + [4] * (layers - 1)
    config = hap.HAPConfig(method="none", sink_detector="consensus")
    dispersed = share_plan(range(layers), heads, 0.25, seed=1, kind="dispersed")
    found = [classifier_report(dispersed, c)["dispersed"]
             for c in _classes(model, processor, items, dispersed, config)]
    assert sum(f["recall"] for f in found) / len(found) >= 0.8


@pytest.mark.parametrize("family", ["llava-next", "llava-next-mistral", "llava-onevision", "internvl", "idefics3",
                                    "smolvlm", "qwen3-vl"])
def test_a_massive_plan_runs_on_every_family_or_is_refused_by_name(family):
    """The other supported families (tiles, thumbnails, DeepStack): a massive sink plan in layer 1 lifts the sink
    tokens' norm past 3 x sink_rho x the median from layer 1's input on and runs under HAP's pruned prefill; a decoder
    whose every layer slides a window (Mistral's) is refused naming the layer."""
    from tiny_zoo import ZOO, inputs
    from tiny_zoo_more import idefics3, internvl
    from tiny_zoo_recent import qwen3_vl

    builders = {**ZOO, "internvl": internvl, "idefics3": idefics3, "smolvlm": lambda: idefics3(smolvlm=True),
                "qwen3-vl": qwen3_vl}
    model, processor = builders[family]()
    batch = inputs(processor, ["what color is the circle ?"], [(100, 170)])
    if family == "llava-next-mistral":
        with pytest.raises(ValueError, match="sink: layer 1 of LlavaNextForConditionalGeneration slides a window of 24"):
            with hap.plant(model, sink=[(1, 0)]):
                pass
        return
    visual = (batch["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]
    with hap.plant(model, sink=[(1, 0)], sink_tokens=2) as lab:
        hidden = _layer_inputs(model, batch)
        sinks = visual[lab.sink_index[0]]
        result = hap.run(model, processor, picture((100, 170)), "what color is the circle ?", hap.HAPConfig(retain=0.5),
                         max_new_tokens=2)
    ratios = [float(h.norm(dim=-1)[sinks].min() / h.norm(dim=-1)[visual].median()) for h in hidden]
    rho = hap.HAPConfig().sink_rho
    assert ratios[0] < rho and all(r > 3 * rho for r in ratios[1:]), ratios
    assert result.plant["massive"] and result.sink_tokens[0] == 0 and result.sink_tokens[1] >= 1
