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
            assert 2 <= mask.sum() <= 16  # radius 12-18 px: about 2x2 .. 4x4 patches
            inside = S._shape_mask(obj.shape, obj.cx, obj.cy, obj.radius) & (pixels != S.GLYPH_INK).any(-1)
            colour = np.median(pixels[inside], axis=0)  # the letter's ink aside
            assert np.abs(colour - np.array(COLORS[obj.color])).max() < 60


def _check_answer(scene, q) -> None:
    """Recompute the answer and the answering patches of ``q`` from the scene's objects."""
    words = q.text.split()
    objs = scene.objects
    present = {(o.color, o.shape) for o in objs}
    union = np.zeros(GRID * GRID, bool)
    for o in objs:
        union |= o.mask()
    if q.qtype == "color":
        (obj,) = [o for o in objs if o.shape == words[-2]]
        assert q.answer == obj.color and (q.target_mask == obj.mask()).all()
    elif q.qtype == "shape":
        (obj,) = [o for o in objs if o.color == words[-3]]
        assert q.answer == obj.shape and (q.target_mask == obj.mask()).all()
    elif q.qtype == "exist":
        color, shape = words[-3], words[-2]
        assert q.answer == ("yes" if (color, shape) in present else "no")
        assert q.target_mask.any() == (q.answer == "yes")
        if q.answer == "no":
            assert any(c == color or s == shape for c, s in present)  # hard negative
    elif q.qtype == "relation":
        (a,) = [o for o in objs if (o.color, o.shape) == (words[2], words[3])]
        (b,) = [o for o in objs if (o.color, o.shape) == (words[-3], words[-2])]
        rel = " ".join(words[4:-4])
        d = {"left of": b.cx - a.cx, "right of": a.cx - b.cx, "above": b.cy - a.cy, "below": a.cy - b.cy}[rel]
        assert abs(d) >= S.MIN_APART and q.answer == ("yes" if d > 0 else "no")
        assert (q.target_mask == (a.mask() | b.mask())).all()
    elif q.qtype == "count":
        members = [o for o in objs if o.color == words[2]]
        assert q.answer == S.NUMBERS[len(members)]
        expected = np.zeros(GRID * GRID, bool)
        for o in members:
            expected |= o.mask()
        assert (q.target_mask == expected).all()
    elif q.qtype == "letter":
        (obj,) = [o for o in objs if (o.color, o.shape) == (words[-3], words[-2])]
        assert q.answer == obj.letter and np.flatnonzero(q.target_mask).tolist() == [obj.letter_patch]
        assert obj.mask()[obj.letter_patch]
        # the rest of the named object neither answers nor distracts
        others = np.any([o.mask() for o in objs if o is not obj], axis=0)
        assert (q.other_mask == others & ~q.target_mask).all()
        return
    elif q.qtype == "dot":
        assert q.answer == scene.dot_color and np.flatnonzero(q.target_mask).tolist() == [scene.dot_patch]
        assert not union[scene.dot_patch] and (q.other_mask == union).all()
        return
    elif q.qtype == "background":
        assert q.answer == scene.background
        others = (np.arange(GRID * GRID) != S.MARKER_PATCH) & (np.arange(GRID * GRID) != scene.dot_patch)
        assert (q.target_mask == ~union & others).all()
        assert (q.other_mask == union).all()  # the objects are what does not answer it
        return
    else:
        assert q.qtype == "text" and q.answer == words[3 if words[3] != "a" else 4]
        assert not q.target_mask.any()
    assert not (q.target_mask & q.other_mask).any()
    assert ((q.target_mask | q.other_mask) == union).all()


def test_answers_consistent_with_objects():
    seen = set()
    for seed in SEEDS:
        scene = make_scene(seed)
        for q in make_questions(scene, seed, 16):
            seen.add(q.qtype)
            _check_answer(scene, q)
    assert seen == set(S.QTYPES)


def test_marker_and_background():
    pixels = [np.asarray(make_scene(seed).image)[:PATCH, :PATCH] for seed in SEEDS]
    assert all((p == pixels[0]).all() for p in pixels)  # the marker patch never changes
    assert pixels[0].min() < 40 and pixels[0].max() > 200
    kinds = {make_scene(seed).background for seed in SEEDS}
    assert kinds == {"dark", "light"}
    for seed in SEEDS:
        scene = make_scene(seed)
        grey = np.asarray(scene.image).astype(float)[scene.background_mask().reshape(GRID, 1, GRID, 1)
                                                     .repeat(PATCH, 1).repeat(PATCH, 3).reshape(IMAGE_SIZE, IMAGE_SIZE)].mean()
        assert (grey < 110) == (scene.background == "dark")
        assert all(not o.mask()[S.MARKER_PATCH] for o in scene.objects)


def test_yes_no_answers_balanced():
    items = list(heldout_items(range(300), 7))
    for kind in ("exist", "relation"):
        answers = [q.answer for _, q in items if q.qtype == kind]
        assert 0.4 < answers.count("yes") / len(answers) < 0.6, kind


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
    from analysis.training import train_model as T

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
        matches = [q for q in make_questions(scene, entry["seed"], 28) if q.text == entry["prompt"]]
        assert matches and matches[0].answer == entry["answer"]
        meta = json.loads(Image.open(folder / entry["file"]).text[S.METADATA_KEY])
        assert meta == json.loads(json.dumps(S.describe(scene, matches[0])))
    assert {e["qtype"] for e in json.loads((folder / "scenes.json").read_text())} == set(S.QTYPES)


def test_metadata_round_trip(tmp_path):
    import json

    from PIL import Image

    scene = make_scene(12)
    q = next(q for q in make_questions(scene, 12, 28) if q.qtype == "relation")
    S.save_scene(scene, tmp_path / "s.png", q)
    image = Image.open(tmp_path / "s.png")
    assert image.convert("RGB").tobytes() == scene.image.tobytes()
    meta = json.loads(image.text[S.METADATA_KEY])
    assert meta["question"]["answering_patches"] == np.flatnonzero(q.target_mask).tolist()
    assert meta["question"]["kind"] == "relation" and meta["grid"] == GRID
    assert [o["patches"] for o in meta["objects"]] == [np.flatnonzero(o.mask()).tolist() for o in scene.objects]


def _patch_pixels(scene, index: int) -> np.ndarray:
    top, left = (index // GRID) * PATCH, (index % GRID) * PATCH
    return np.asarray(scene.image).astype(int)[top:top + PATCH, left:left + PATCH]


def test_letters_are_drawn_in_one_patch():
    """Each object's letter is the glyph's ink pattern (2x, 2 px from the left) in its letter patch, and
    no other letter's pattern fits there."""
    for seed in SEEDS:
        scene = make_scene(seed)
        for obj in scene.objects:
            ink = (_patch_pixels(scene, obj.letter_patch) == S.GLYPH_INK).all(-1)[:, 2:12]
            glyphs = {ch: np.kron(np.array([[c == "1" for c in row] for row in rows]), np.ones((2, 2), bool))
                      for ch, rows in S._GLYPHS.items()}
            assert (ink == glyphs[obj.letter]).all()
            assert obj.letter_patch == int(obj.coverage.argmax())


def test_dot_and_fine_labels():
    for seed in SEEDS:
        scene = make_scene(seed)
        assert scene.dot_patch >= 0 and scene.dot_color in COLORS
        centre = _patch_pixels(scene, scene.dot_patch)[PATCH // 2, PATCH // 2]
        assert (centre == COLORS[scene.dot_color]).all()
        assert all(o.coverage[scene.dot_patch] == 0 for o in scene.objects)
        letters, dots = scene.fine_labels()
        assert np.flatnonzero(dots).tolist() == [scene.dot_patch]
        assert dots[scene.dot_patch] == list(COLORS).index(scene.dot_color) + 1
        assert sorted(np.flatnonzero(letters).tolist()) == sorted(o.letter_patch for o in scene.objects)
        assert all(letters[o.letter_patch] == S.LETTERS.index(o.letter) + 1 for o in scene.objects)


def test_position_questions_and_small_scenes():
    """The training-only position kind answers which side an object is on; ``n_objects`` forces the
    curriculum's two-object scenes."""
    asked = 0
    for seed in SEEDS:
        scene = make_scene(seed, n_objects=2)
        assert len(scene.objects) == 2
        for q in make_questions(scene, seed, 4, S.AUX_KINDS):
            words = q.text.split()
            (obj,) = [o for o in scene.objects if (o.color, o.shape) == (words[2], words[3])]
            centre = obj.cx if "left" in words else obj.cy
            assert abs(centre - IMAGE_SIZE / 2) >= S.MIN_APART
            assert q.answer == {True: "left" if "left" in words else "top",
                                False: "right" if "left" in words else "bottom"}[centre < IMAGE_SIZE / 2]
            asked += 1
    assert asked > 20
    assert not set(S.AUX_KINDS) & set(S.QTYPES)
