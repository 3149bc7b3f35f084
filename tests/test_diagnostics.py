"""Training diagnostics (analysis/training/diagnostics.py): attention parking, massive activations, the table."""
import pytest
import torch
from transformers import LlavaForConditionalGeneration

from analysis.training.diagnostics import _parking, diagnose, marker_attention, table
from analysis.training.tiny_vlm import VOCAB, build_config, build_processor
from analysis.training.train_model import diagnostic_items


def test_parking_splits_each_row_into_before_on_and_after_the_image():
    """Layer 0: every row on token 0 (before the image); layer 1: half on the image, half on the row itself."""
    T, image, rows = 6, torch.arange(1, 4), torch.tensor([4, 5])
    first = torch.zeros(1, 2, T, T)
    first[..., 0] = 1.0
    second = torch.zeros(1, 2, T, T)
    second[..., 1:4] = 0.5 / 3
    second[0, :, 4, 4] = second[0, :, 5, 5] = 0.5
    got = _parking((first, second), image, rows)
    assert torch.allclose(got, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]]))


@pytest.fixture(scope="module")
def diagnosed():
    torch.manual_seed(0)
    processor = build_processor()
    config = build_config(processor, text_layers=2, text_hidden=32, text_heads=2, text_mlp=64,
                          vision_hidden=32, vision_layers=1, vision_heads=2)
    model = LlavaForConditionalGeneration(config).eval()
    return diagnose(model, processor, diagnostic_items(1))


def test_diagnose_reports_where_attention_parks_and_the_largest_norm(diagnosed):
    layers = 2
    parking = diagnosed["row_attention_per_layer"]
    assert len(parking) == layers
    for row in parking:  # causal rows after the image: every share present, summing to one
        assert row["before_image"] > 0 and row["image"] > 0 and row["after_image"] > 0
        assert sum(row.values()) == pytest.approx(1.0, abs=2e-3)
    massive = diagnosed["massive_per_layer"]
    assert len(massive) == layers
    for layer, m in enumerate(massive):  # over every prompt token, so at least the largest visual one
        assert m["ratio"] >= diagnosed["norm_ratio_per_layer"][layer] - 1e-2
        visual = m["token"].startswith("visual ") and 0 <= int(m["token"].split()[1]) < 144
        assert visual or m["token"] in VOCAB


def test_table_reads_old_and_new_logs(diagnosed):
    record = {"step": 10, "minutes": 1.0, "fraction": 0.5, "followup": 0.5,
              "accuracy": {"color": 0.5, "shape": 0.25, "overall": 0.4, "n": {}}, "diagnostics": diagnosed}
    newer = ("massive_per_layer", "row_attention_per_layer", "marker_attention")  # keys older logs lack
    old = {**record, "step": 5, "diagnostics": {k: v for k, v in diagnosed.items() if k not in newer}}
    lines = table([old, record], None).splitlines()
    assert len(lines) == 4 and all(line.count("|") == 13 for line in lines)
    assert lines[2].endswith("| – | – | – |")
    top = max(diagnosed["massive_per_layer"], key=lambda m: m["ratio"])
    assert f"{top['ratio']:.1f} ({top['token']})" in lines[3]
    assert f"{diagnosed['marker_attention']['all']['busiest']:.2f} / " in lines[3]


def test_marker_attention_finds_the_head_that_parks_on_the_marker_patch_when_the_image_is_irrelevant():
    """Head (1, 0) puts 0.8 of its visual attention on token 0 for the text questions only; the rest spread evenly."""
    Q, L, H, V = 4, 2, 3, 10
    dists = torch.full((Q, L, H, V), 1 / V)
    kinds = ["color", "text", "text", "dot"]
    dists[1:3, 1, 0] = torch.tensor([0.8] + [0.2 / (V - 1)] * (V - 1))
    got = marker_attention(dists, kinds)
    assert got["uniform"] == pytest.approx(0.1)
    assert got["text"]["head"] == [1, 0] and got["text"]["busiest"] == pytest.approx(0.8)
    assert got["text"]["mean"] == pytest.approx((0.8 + 5 * 0.1) / 6, abs=1e-3)
    assert got["all"]["head"] == [1, 0] and got["all"]["busiest"] == pytest.approx((0.8 * 2 + 0.1 * 2) / 4)
    assert "text" not in marker_attention(dists[[0, 3]], ["color", "dot"])


def test_diagnose_reports_the_marker_patch_reading(diagnosed):
    marker = diagnosed["marker_attention"]
    assert marker["uniform"] == pytest.approx(1 / 144, abs=1e-4)
    for part in ("all", "text"):  # diagnostic_items asks every kind, text included
        layer, head = marker[part]["head"]
        assert 0 <= layer < 2 and 0 <= head < 2
        assert 0 <= marker[part]["mean"] <= marker[part]["busiest"] <= 1
