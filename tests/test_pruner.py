"""PruneState: planning a prefill, the positions it tracks, a cut; and on the shipped model, HAP keeps exactly
the tokens an independent computation (eager attention, PAQ, softmax(PAQ / T) head weights, top-k) says."""

from pathlib import Path

import pytest
import torch
from PIL import Image

import hap
from hap.planning.flops import DecoderShape
from hap.patch.state import PruneState
from hap.runs.run import chat_prompt

SHAPE = DecoderShape.mha(layers=4, hidden=8, intermediate=16)
SHIPPED = Path(__file__).resolve().parent.parent / "assets"


def layout(prefix: int, n: int, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """visual_mask and attention_mask [batch, T] of left-padded `[pad][prefix][n visual][prompt_b]` rows."""
    T = prefix + n + max(prompt)
    visual = torch.zeros(len(prompt), T, dtype=torch.bool)
    mask = torch.ones(len(prompt), T, dtype=torch.long)
    for b, p in enumerate(prompt):
        pad = max(prompt) - p
        mask[b, :pad] = 0
        visual[b, pad + prefix : pad + prefix + n] = True
    return visual, mask


def test_start_plans_the_rows_the_positions_and_the_layers_to_capture():
    visual, mask = layout(prefix=2, n=6, prompt=[3, 1])
    st = PruneState.start(hap.HAPConfig.paper(retain=0.5, first_layers=1, groups=2), visual, mask, SHAPE, trace=False)
    assert st.config.first_layers == 1 and st.schedule.cuts == [1, 2]
    assert st.row_valid.tolist() == [[True, True, True], [False, False, True]]  # sample 1 has one prompt row
    assert st.visual_pos.tolist() == [[2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 8, 9]]
    assert st.scoring_layers == {0, 1} and st.capture_layers == {0, 1} and not st.lookahead_layers
    assert st.tracer is None and st.cut_index(2) == 1 and st.cut_index(3) is None
    traced = PruneState.start(hap.HAPConfig.paper(retain=0.5, first_layers=0), visual, mask, SHAPE, trace=True)
    assert traced.lookahead_layers == {0} and traced.capture_layers == {0, 1, 2, 3} and traced.tracer is not None


@pytest.mark.parametrize(
    "visual, match",
    [(torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]), "same number of visual tokens"),
     (torch.zeros(1, 4), "no visual tokens"), (torch.tensor([[0, 1, 1, 1]]), "no prompt token follows the image")],
)
def test_start_refuses_inputs_it_cannot_prune(visual, match):
    with pytest.raises(ValueError, match=match):
        PruneState.start(hap.HAPConfig(retain=0.5), visual.bool(), None, SHAPE, trace=False)


def test_a_cut_keeps_the_top_scored_tokens_and_tracks_every_position():
    visual, _ = layout(prefix=1, n=4, prompt=[2])
    config = hap.HAPConfig(method="uniform", retain=0.75, first_layers=1, groups=1)
    st = PruneState.start(config, visual, None, DecoderShape.mha(2, 8, 16), trace=True)
    assert st.schedule.kept == [2]
    rows = torch.zeros(1, 2, 2, 7)  # [batch, heads, P, T]: layer 0's prompt rows
    rows[..., 1:5] = torch.tensor([0.1, 0.4, 0.05, 0.3])  # visual tokens 1 and 3 get the most attention
    st.record(0, rows, torch.ones(1, 7, 8))
    kept = st.cut(1)
    assert kept.tolist() == [[0, 2, 4, 5, 6]]  # prefix, visual 1 and 3, the prompt
    assert st.kept_orig.tolist() == [[1, 3]] and st.visual_pos.tolist() == [[1, 2]]
    assert st.cuts[0].kept.tolist() == [[1, 3]] and st.cuts[0].scored_layers == [0]
    assert torch.equal(st.cuts[0].weights, torch.full((1, 1, 2), 0.5))
    step = torch.ones(1, 8, dtype=torch.long)  # the prompt's 7 columns + one generated token
    step[0, 2] = 0
    assert st.decode_attention_mask(1, step).tolist() == [[1, 0, 1, 1, 1, 1]]
    assert sorted(st.tracer.layers) == [0] and 1 in st.tracer.cut_maps


def independent_cut(model, inputs, config: hap.HAPConfig, k: int) -> tuple[list[int], torch.Tensor]:
    """(kept indices, head weights [layers, heads]) of a cut entering layer K scored by layers [0, K), from
    the stock model's eager attention and hidden states, with PAQ written out from its definition."""
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    ids = inputs["input_ids"][0]
    vis = (ids == model.config.image_token_id).nonzero().flatten()
    rows = torch.arange(int(vis[-1]) + 1, len(ids))  # every prompt token after the image
    paq, maps = [], []
    for layer in range(config.first_layers):
        A = out.attentions[layer][0][:, rows][:, :, vis].double()  # [H, P, N], rows softmaxed over all keys
        norms = out.hidden_states[layer][0, vis].double().norm(dim=-1)
        sink = norms > config.sink_rho * norms.median()
        a = A / A.sum(-1, keepdim=True)
        sigma = a[..., sink].sum(-1).mean(-1)
        b = a[..., ~sink] / a[..., ~sink].sum(-1, keepdim=True)
        entropy = -(b * b.clamp_min(1e-12).log()).sum(-1) / torch.log(torch.tensor(float((~sink).sum())))
        paq.append((1 - sigma) * (1 - entropy.mean(-1)))
        maps.append(A)
    paq = torch.stack(paq)  # [layers, H]
    w = torch.softmax(paq.flatten() / config.temperature, 0).view_as(paq)
    fused = (torch.stack(maps) * w[..., None, None]).sum((0, 1))  # [P, N]
    scores = fused.norm(dim=0)
    top = scores.topk(k + 1)
    assert top.values[k - 1] - top.values[k] > 1e-6, "a near-tie at the cut would make the check ambiguous"
    return sorted(top.indices[:k].tolist()), w


def test_hap_keeps_what_the_independent_computation_says_on_the_shipped_model():
    model, processor = hap.load_model(str(SHIPPED / "tiny-llava"), device="cpu")
    model.set_attn_implementation("eager")
    image = Image.open(SHIPPED / "examples" / "scene_600003.png").convert("RGB")
    inputs = processor(images=image, text=chat_prompt(processor, "what color is the circle ?"), return_tensors="pt")
    config = hap.HAPConfig.paper(method="hap", retain=0.5, first_layers=2, groups=1)
    with hap.patched(model, config) as patch, torch.no_grad():
        model(**inputs)
    cut = patch.state.cuts[0]
    expected, weights = independent_cut(model, inputs, config, patch.state.schedule.kept[0])
    assert cut.layer == 2 and cut.scored_layers == [0, 1]
    torch.testing.assert_close(cut.weights[0].double(), weights, atol=1e-4, rtol=1e-3)
    assert weights.max() > 2 * weights.min()  # PAQ really separates heads: the weights are not flat
    assert cut.kept[0].tolist() == expected
