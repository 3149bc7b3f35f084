"""Ground truth from scene metadata: reading it back, head grounding, kept recall."""
import numpy as np
from PIL import Image

from analysis.ground_truth import head_grounding, kept_recall, patch_mask, read_metadata
from analysis.scenes import make_questions, make_scene, save_scene


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
