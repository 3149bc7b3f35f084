"""Ground truth from scene metadata: reading it back, head grounding, kept recall, a run's truth for the app."""
import numpy as np
import pytest
from PIL import Image

import hap
from analysis.scenes import make_questions, make_scene, save_scene
from hap.causal import spearman
from hap.views.ground_truth import (answering_cut, file_metadata, head_grounding, kept_recall, patch_mask, question_for,
                              read_metadata, scene_truth, truth_json)


def test_read_metadata_round_trip_and_absence(tmp_path):
    scene = make_scene(3)
    q = make_questions(scene, 3)[0]
    save_scene(scene, tmp_path / "a.png", q)
    meta = read_metadata(Image.open(tmp_path / "a.png"))
    assert meta["question"]["answering_patches"] == np.flatnonzero(q.target_mask).tolist()
    assert read_metadata(Image.open(tmp_path / "a.png").convert("RGB"))["seed"] == 3
    scene.image.save(tmp_path / "plain.png")
    assert read_metadata(Image.open(tmp_path / "plain.png")) is None
    bad = Image.new("RGB", (4, 4))
    bad.info["hap-scene"] = '{"objects": [], "question": {"answering_patches": [999]}}'
    assert read_metadata(bad) is None  # patches outside the grid are refused
    bad.info["hap-scene"] = "not json"
    assert read_metadata(bad) is None


def test_head_grounding_and_recall():
    target = patch_mask([0, 1], n=8)  # a quarter of the area
    dist = np.array([[0.5, 0.5, 0, 0, 0, 0, 0, 0],  # all on the target: 4x its area share
                     [1 / 8] * 8,  # uniform: 1
                     [0, 0, np.nan, 0.25, 0.25, 0.25, 0.25, np.nan]])  # none on it, NaN = pruned
    np.testing.assert_allclose(head_grounding(dist, target), [4.0, 1.0, 0.0])
    assert head_grounding(dist, patch_mask([], n=8)) is None
    assert kept_recall(np.array([1, 5]), target) == 0.5
    assert kept_recall(np.array([1]), patch_mask([], n=8)) is None


def test_kept_recall_divides_by_the_answering_patches_not_the_kept_ones():
    target = np.zeros(10, dtype=bool)
    target[[0, 1, 2, 3]] = True
    assert kept_recall(np.array([0, 1, 7]), target) == 0.5  # 2 of the 4 answering patches (not 2 of 3 kept)
    assert kept_recall(np.arange(10), target) == 1.0


def test_the_truth_is_for_the_saved_question_only(tmp_path):
    scene = make_scene(5)
    q = make_questions(scene, 5)[0]
    save_scene(scene, tmp_path / "s.png", q)
    meta = file_metadata(tmp_path / "s.png")
    assert meta == file_metadata(Image.open(tmp_path / "s.png"))
    assert question_for(meta, "  " + q.text.upper() + " ", 144) == (meta["question"], "")  # words, case aside
    none, why = question_for(meta, "is there a cat ?", 144)
    assert none is None and f'the ground truth of this scene is for "{q.text}"' in why
    assert "this model sees 576 visual tokens" in question_for(meta, q.text, 576)[1]
    assert "carries no scene description" in question_for(None, q.text, 144)[1]
    assert "no question" in question_for({"objects": []}, q.text, 144)[1]


def view_data(paq: np.ndarray, attention: np.ndarray, kept: list[list[int]]):
    from hap.views import ViewData

    layers, heads, visual = attention.shape
    stats = np.stack([paq] + [np.zeros_like(paq)] * 3, -1)
    groups = [hap.Group(g, (g, g + 1), [g], k, [], []) for g, k in enumerate(kept)]
    nan = np.full((layers, heads, visual), np.nan)
    return ViewData(np.zeros((4, 4, 3), np.uint8), (2, 4), [[""] * heads] * layers, stats, nan, attention,
                    nan[:, 0], nan[:0, 0], nan[:0, 0], groups)


def test_a_runs_truth_grounding_spearman_recall_and_json():
    attention = np.full((3, 2, 8), 1 / 8)
    attention[0, 0] = [0.5, 0.5, 0, 0, 0, 0, 0, 0]  # grounding 4
    attention[0, 1] = [0.25, 0, 0.25, 0.25, 0.25, 0, 0, 0]  # grounding 1
    attention[1, 0] = [0, 0, 0.25, 0.25, 0.25, 0.25, 0, 0]  # grounding 0
    paq = np.array([[0.9, 0.5], [0.1, 0.4], [np.nan, np.nan]])  # layer 2 not scored
    truth = scene_truth({"text": "q ?", "answering_patches": [0, 1]}, view_data(paq, attention, [[0, 5], [5]]))
    np.testing.assert_allclose(truth.grounding[:2], [[4, 1], [0, 1]])
    assert np.isnan(truth.grounding[2]).all()  # not scored: no grounding, though its attention is uniform
    assert truth.spearman == pytest.approx(spearman(np.array([0.9, 0.5, 0.1, 0.4]), np.array([4.0, 1, 0, 1])))
    assert truth.kept_recall == [0.5, 0.0]
    data = truth_json(truth)
    assert data["queried"] == [0, 1] and data["head_grounding"][2] == [None, None]
    assert data["head_grounding"][0] == [4.0, 1.0] and data["kept_recall"] == [0.5, 0.0]
    text_only = scene_truth({"text": "q ?", "answering_patches": []}, view_data(paq, attention, [[0]]))
    assert text_only.grounding is None and text_only.spearman is None and text_only.kept_recall == [None]
    assert truth_json(text_only) == {"queried": [], "head_grounding": None, "spearman": None, "kept_recall": [None]}


def test_grounding_is_unknown_not_0_where_the_answering_patches_were_cut_before_the_layer():
    """Layer 2 is scored, but an earlier cut removed patches 0 and 1: its heads have nothing to look at there."""
    attention = np.full((3, 2, 8), 1 / 8)
    attention[0, 0] = [0.5, 0.5, 0, 0, 0, 0, 0, 0]
    attention[2] = [np.nan, np.nan, 0.25, 0.25, 0.25, 0.25, 0, 0]  # patches 0, 1 gone from layer 2's input
    paq = np.array([[0.9, 0.5], [0.1, 0.4], [0.3, 0.2]])  # every layer scored
    target = patch_mask([0, 1], n=8)
    assert head_grounding(attention, target)[2].tolist() == [0.0, 0.0]  # the bare ratio would read 0
    assert answering_cut(attention, target).tolist() == [False, False, True]
    truth = scene_truth({"text": "q ?", "answering_patches": [0, 1]}, view_data(paq, attention, [[2, 3], [2]]))
    assert np.isnan(truth.grounding[2]).all() and truth.cut.tolist() == [False, False, True]
    assert truth.unknown(2) == "answering patches were cut before layer 2" and truth.unknown(1) == ""
    assert truth_json(truth)["head_grounding"][2] == [None, None]
    assert truth.spearman == pytest.approx(spearman(np.array([0.9, 0.5, 0.1, 0.4]), np.array([4.0, 1, 1, 1])))
    not_captured = np.full((1, 2, 8), np.nan)  # a layer without attention is not scored, not cut
    assert answering_cut(not_captured, target).tolist() == [False]
