"""Synthetic scenes: determinism, masks, answers, seed ranges."""
import numpy as np
import pytest

from analysis import scenes as S
from analysis.scenes import (COLORS, GRID, IMAGE_SIZE, PATCH, SHAPES, TRAIN_SEED_START,
                             heldout_items, make_questions, make_scene)

SEEDS = range(40)


def test_constants():
    assert (IMAGE_SIZE, PATCH, GRID) == (168, 14, 12)
    assert len(COLORS) == 5 and len(SHAPES) == 3


def test_deterministic_by_seed():
    for seed in (0, 7, TRAIN_SEED_START + 3):
        a, b = make_scene(seed), make_scene(seed)
        assert a.image.tobytes() == b.image.tobytes()
        assert [(o.shape, o.color, o.cx, o.cy) for o in a.objects] == \
               [(o.shape, o.color, o.cx, o.cy) for o in b.objects]
        qa, qb = make_questions(a, seed, 8), make_questions(b, seed, 8)
        assert [(q.text, q.answer) for q in qa] == [(q.text, q.answer) for q in qb]
        assert all((x.target_mask == y.target_mask).all() for x, y in zip(qa, qb))
    assert make_scene(1).image.tobytes() != make_scene(2).image.tobytes()


def test_scene_layout():
    for seed in SEEDS:
        scene = make_scene(seed)
        assert scene.image.size == (IMAGE_SIZE, IMAGE_SIZE) and scene.image.mode == "RGB"
        assert S.MIN_OBJECTS <= len(scene.objects) <= S.MAX_OBJECTS
        assert scene.coverage.shape == (len(scene.objects), GRID * GRID)
        # non-overlapping: coverages of one patch never sum above 1
        assert scene.coverage.sum(0).max() <= 1.0 + 1e-6


def test_masks_match_object_positions():
    for seed in SEEDS:
        scene = make_scene(seed)
        pixels = np.asarray(scene.image).astype(int)
        for obj in scene.objects:
            mask = obj.mask()
            assert mask.dtype == bool and mask.shape == (GRID * GRID,)
            centre = int(obj.cy // PATCH) * GRID + int(obj.cx // PATCH)  # row-major patch index
            assert mask[centre]
            rows, cols = np.nonzero(mask.reshape(GRID, GRID))
            assert abs(rows.mean() * PATCH + PATCH / 2 - obj.cy) < PATCH
            assert abs(cols.mean() * PATCH + PATCH / 2 - obj.cx) < PATCH
            assert 3 <= mask.sum() <= 16  # radius 14-22 px: 2x2 .. 4x4 patches
            colour = pixels[int(obj.cy), int(obj.cx)]
            assert np.abs(colour - np.array(COLORS[obj.color])).max() < 60


def test_answers_consistent_with_objects():
    seen = set()
    for seed in SEEDS:
        scene = make_scene(seed)
        present = {(o.color, o.shape) for o in scene.objects}
        for q in make_questions(scene, seed, 12):
            seen.add(q.qtype)
            words = q.text.split()
            assert not (q.target_mask & q.other_mask).any()
            if q.qtype == "color":
                (obj,) = [o for o in scene.objects if o.shape == words[-2]]
                assert q.answer == obj.color
                assert (q.target_mask == obj.mask()).all()
            elif q.qtype == "shape":
                (obj,) = [o for o in scene.objects if o.color == words[-3]]
                assert q.answer == obj.shape
                assert (q.target_mask == obj.mask()).all()
            else:
                color, shape = words[-3], words[-2]
                assert q.answer == ("yes" if (color, shape) in present else "no")
                if q.answer == "no":
                    assert not q.target_mask.any()
                    assert any(c == color or s == shape for c, s in present)  # hard negative
                else:
                    assert q.target_mask.any()
            union = np.zeros(GRID * GRID, bool)
            for o in scene.objects:
                union |= o.mask()
            assert ((q.target_mask | q.other_mask) == union).all()
    assert seen == set(S.QTYPES)


def test_exist_answers_balanced():
    answers = [q.answer for _, q in heldout_items(range(300), 3) if q.qtype == "exist"]
    assert 0.4 < answers.count("yes") / len(answers) < 0.6


def test_patch_labels():
    scene = make_scene(5)
    colors, shapes = scene.patch_labels()
    assert colors.shape == shapes.shape == (GRID * GRID,)
    assert ((colors == 0) == (shapes == 0)).all()
    for obj in scene.objects:
        core = obj.coverage > 0.9
        assert (colors[core] == list(COLORS).index(obj.color) + 1).all()
        assert (shapes[core] == SHAPES.index(obj.shape) + 1).all()


def test_seed_ranges_disjoint():
    from analysis import train_model as T

    assert T.State().next_seed == TRAIN_SEED_START  # training draws seeds upward from here
    assert T.STAGE1_EVAL_START + T.Settings(model={}).s1_probe_scenes <= TRAIN_SEED_START
    assert T.STAGE2_EVAL_START + T.Settings(model={}).eval_scenes <= TRAIN_SEED_START
    with pytest.raises(ValueError):
        next(heldout_items(range(TRAIN_SEED_START - 1, TRAIN_SEED_START + 1), 1))
    items = list(heldout_items(range(10), 2))
    assert len(items) == 20 and all(s.seed < TRAIN_SEED_START for s, _ in items)


def test_shipped_examples_match_generator():
    import json
    from pathlib import Path

    from PIL import Image

    folder = Path(__file__).resolve().parents[1] / "assets" / "examples"
    if not (folder / "scenes.json").exists():
        pytest.skip("no shipped examples")
    for entry in json.loads((folder / "scenes.json").read_text()):
        assert entry["seed"] < TRAIN_SEED_START
        scene = make_scene(entry["seed"])
        assert Image.open(folder / entry["file"]).tobytes() == scene.image.tobytes()
        matches = [q for q in make_questions(scene, entry["seed"], 9) if q.text == entry["prompt"]]
        assert matches and matches[0].answer == entry["answer"]
