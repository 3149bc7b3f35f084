"""hap.run's Result and the command line, on a tiny random LLaVA saved to disk (the load_model path)."""

import json
import math
from pathlib import Path

import pytest
import torch

import hap
from hap.__main__ import main
from hap.views import VIEWS
from tiny_models import noise_image, tiny_llava


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    model, processor = tiny_llava(layers=6, kv_heads=2)  # grouped-query attention: 4 query heads share 2
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    image = folder / "scene.png"
    noise_image(3).save(image)
    return folder, image


def test_result_holds_every_view(saved):
    folder, image = saved
    model, processor = hap.load_model(str(folder), device="cpu")
    r = hap.run(model, processor, image, "what color is the circle ?", hap.HAPConfig(retain=0.2, first_layers=0),
                max_new_tokens=3)
    L, H, N = 6, 4, 144
    assert (r.num_layers, r.num_heads, r.num_visual, r.visual_grid) == (L, H, N, (12, 12))
    assert r.paq.shape == r.sink_share.shape == (L, H) and not torch.isnan(r.paq).any()  # trace scores every layer
    assert all(c in ("sink", "dispersed", "optimal") for row in r.head_class for c in row)
    assert r.maps.head.shape == r.maps.head_attention.shape == (L, H, N)
    assert r.maps.layer.shape == r.maps.layer_uniform.shape == (L, N)
    assert r.maps.group.shape == r.maps.group_uniform.shape == (3, N)
    assert [g.layers for g in r.groups] == [(0, 2), (2, 4), (4, 6)]
    assert r.visual_per_layer == [len(r.groups[0].kept)] * 2 + [len(r.groups[1].kept)] * 2 + [len(r.groups[2].kept)] * 2
    assert set(r.groups[1].kept) <= set(r.groups[0].kept)  # a later group keeps a subset
    assert math.isclose(r.retained_tokens, sum(r.visual_per_layer) / L) and abs(r.retain - 0.2) < 0.01
    assert r.flops_ratio == pytest.approx(independent_flops_ratio(model.config.text_config, r), rel=1e-12)
    # the cut before layer 0 was weighted by layer 0's PAQ over all 144 tokens
    assert r.groups[0].scored_by == [0] and len(r.groups[0].paq[0]) == H
    assert math.isclose(sum(map(sum, r.groups[1].weights)), 1.0, rel_tol=1e-5)
    assert not torch.isnan(r.maps.group).any(axis=1).all()
    assert {"prefill_s", "decode_s", "scoring_s"} <= set(r.timings)
    json.dumps(r.to_json())


def independent_flops_ratio(tc, r: hap.Result) -> float:
    """Prefill MACs of the pruned schedule over the unpruned ones, from the decoder's own config: per layer and
    n tokens, q and o projections 2nd^2, k and v projections 2n d kv_dim, attention 2n^2d, gated FFN 3ndm."""
    d, m = tc.hidden_size, tc.intermediate_size
    kv_dim = tc.num_key_value_heads * (tc.hidden_size // tc.num_attention_heads)

    def macs(n: int) -> int:
        return 2 * n * d * d + 2 * n * d * kv_dim + 2 * n * n * d + 3 * n * d * m

    pruned = sum(macs(r.text_tokens + v) for v in r.visual_per_layer)
    return pruned / (tc.num_hidden_layers * macs(r.text_tokens + r.num_visual))


def test_uniform_weights_are_flat_and_none_prunes_nothing(saved):
    folder, image = saved
    model, processor = hap.load_model(str(folder), device="cpu")
    u = hap.run(model, processor, image, "is there a red square ?", hap.HAPConfig(method="uniform", retain=0.3,
                                                                                    first_layers=1, groups=2))
    flat = [w for row in u.groups[1].weights for w in row]
    assert max(flat) - min(flat) < 1e-7
    n = hap.run(model, processor, image, "is there a red square ?", hap.HAPConfig(method="none"))
    assert n.groups == [] and n.retained_tokens == 144 and n.flops_ratio == 1.0


def test_the_unpruned_run_times_its_prefill_like_every_run(saved):
    """method="none" untraced (the page's "Unpruned" card) times its prefill apart from its decode steps."""
    folder, image = saved
    model, processor = hap.load_model(str(folder), device="cpu")
    for config in (hap.HAPConfig(method="none"), hap.HAPConfig(retain=0.2, first_layers=0)):
        t = hap.run(model, processor, image, "what color is it ?", config, max_new_tokens=4, trace=False).timings
        assert 0 < t["prefill_s"] < t["generate_s"], (config.method, t)
        assert t["decode_s"] == pytest.approx(t["generate_s"] - t["prefill_s"])


def test_cli_prints_and_writes_json(saved, tmp_path, capsys):
    folder, image = saved
    out = tmp_path / "out.json"
    code = main(["run", "--model", str(folder), "--image", str(image), "--prompt", "what shape is the red object ?",
                 "--method", "hap", "--retain", "0.111", "--first-layers", "0", "--json", str(out),
                 "--max-new-tokens", "3", "--figures", str(tmp_path / "figures")])
    printed = capsys.readouterr().out
    assert code == 0 and "answer:" in printed and "group 2: layers [4, 6)" in printed
    data = json.loads(out.read_text())
    model, processor = hap.load_model(str(folder), device="cpu")
    direct = hap.run(model, processor, image, "what shape is the red object ?",
                     hap.HAPConfig(method="hap", retain=0.111, first_layers=0), max_new_tokens=3).to_json()
    assert set(data) == set(direct) and set(data["timings"]) == set(direct["timings"])
    for key, value in direct.items():  # every field but the timings is what hap.run gives
        assert key == "timings" or data[key] == value, key
    assert all(v >= 0 for v in data["timings"].values())
    assert data["method"] == "hap" and abs(data["retain"] - 0.111) < 0.01 and len(data["groups"]) == 3
    assert data["config"]["first_layers"] == 0 and data["target_retain"] == 0.111
    pngs = sorted(p.stem for p in (tmp_path / "figures").glob("*.png"))
    assert pngs == sorted(v.name for v in VIEWS) and f"wrote {len(VIEWS)} figures" in printed
    assert all((tmp_path / "figures" / f"{name}.png").stat().st_size > 2000 for name in pngs)


def test_cli_causal_writes_head_utility(saved, tmp_path, capsys):
    folder, image = saved
    out = tmp_path / "causal.json"
    code = main(["run", "--model", str(folder), "--image", str(image), "--prompt", "what color is it ?", "--causal",
                 "--max-new-tokens", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    found = json.loads(out.read_text())["head_utility"]
    assert code == 0 and "head utility" in printed and f"Spearman(PAQ, utility) {found['spearman']}" in printed
    assert {"values", "keep", "spearman", "uniform", "paq_weighted"} <= set(found) and found["keep"] == 16
    model, processor = hap.load_model(str(folder), device="cpu")
    direct = hap.head_utility(model, processor, image, "what color is it ?", rows=hap.HAPConfig().rows)
    values = torch.tensor([[math.nan if v is None else v for v in row] for row in found["values"]])
    torch.testing.assert_close(values, direct, atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize(
    "args, message",
    [(["--model", "/no/such/model"], "cannot load"), (["--retain", "0"], "retain=0.0"),
     (["--retain", "0.05", "--first-layers", "2"], "unreachable")],
)
def test_cli_errors_are_one_line_and_exit_2(saved, capsys, args, message):
    folder, image = saved
    base = {"--model": str(folder), "--image": str(image), "--prompt": "what ?"}
    base.update(dict(zip(args[::2], args[1::2])))
    code = main(["run", *[x for kv in base.items() for x in kv]])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after any loading progress bar
    assert code == 2 and last.startswith("error: ") and message in last


def test_cli_answers_on_the_shipped_model_with_no_knob_given(capsys):
    shipped = Path(__file__).resolve().parent.parent / "assets"
    image = shipped / "examples" / "scene_600000.png"
    code = main(["run", "--image", str(image), "--prompt", "what color is the circle ?"])
    printed = capsys.readouterr().out
    assert code == 0 and "answer:" in printed and "layers: 6" in printed and "(target 0.25)" in printed
