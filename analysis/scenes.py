"""Seeded synthetic scenes and one-word questions of nine kinds (two fine-grained), each with the patches that answer it.

A scene is a 168x168 RGB image (patch 14 -> a 12x12 grid = 144 visual tokens; the LLaVA visual
token order is row-major over that grid) with 3-6 non-overlapping coloured shapes (each carrying a
dark capital letter in the patch it covers most) and one small coloured dot on a noisy,
blocky background that is either dark or light. The top-left patch always holds the same
black-and-white checker marker (a token that is always there and never informative: the raw
material of a learned attention sink, docs/method.md §3). Everything is a deterministic function
of an integer seed (numpy ``Generator``).

Seed ranges (disjoint by construction):
  * held-out seeds: ``0 <= seed < TRAIN_SEED_START`` (1_000_000); validation and test ranges are
    chosen inside it by the scripts (validation 400000-499999, test 500000+ by convention);
  * training seeds: ``seed >= TRAIN_SEED_START``.

Question kinds (``QTYPES``; one-word answers) and the patches that answer them (``target_mask``):
  * ``color``      ``what color is the <shape> ?`` (shape unique)                 -> that object;
  * ``shape``      ``what shape is the <color> object ?`` (colour unique)         -> that object;
  * ``exist``      ``is there a <color> <shape> ?`` (yes/no, 50% hard negatives)  -> the object(s), or none;
  * ``relation``   ``is the <c> <s> left of / right of / above / below the <c> <s> ?`` (yes/no; both
                   objects unique, clearly apart on that axis)                    -> both objects;
  * ``count``      ``how many <color> objects ?`` (zero-three)                    -> every counted object;
  * ``background`` ``is the background dark or light ?``                          -> every background patch;
  * ``text``       ``the object is <color> . what color is it ?`` / ``the object is a <shape> . what
                   shape is it ?`` (answerable from the prompt alone)             -> none;
  * ``letter``     ``what letter is on the <c> <s> ?`` (fine-grained: every object carries a letter in
                   one patch; the object unique by colour and shape)              -> the letter's patch;
  * ``dot``        ``what color is the dot ?`` (fine-grained: one small dot inside one background
                   patch)                                                         -> the dot's patch.

The two fine-grained kinds live in one patch each, so a selector that drops that patch loses the
answer: they exist to separate selectors. ``AUX_KINDS`` are asked in training only (not evaluated):
``position`` (``is the <c> <s> on the left or right ?`` / ``... at the top or bottom ?``, objects
clearly on one side) teaches the decoder to read an object's place, the step a relation needs.

Masks: a patch belongs to an object's mask when the object covers more than ``MASK_THRESHOLD``
(10%) of its pixels. ``other_mask`` is the union of the masks of every object not answering the
question, minus ``target_mask``.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from hap.views.ground_truth import GRID, METADATA_KEY, N_PATCHES  # the scene format the app reads: 12x12 = 144 patches

PATCH = 14
IMAGE_SIZE = GRID * PATCH  # 168
MARKER_PATCH = 0  # row-major index of the fixed checker marker (top-left)

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 175, 60),
    "blue": (45, 80, 225),
    "yellow": (235, 210, 40),
    "purple": (150, 55, 190),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
NUMBERS: tuple[str, ...] = ("zero", "one", "two", "three")
BACKGROUNDS: tuple[str, ...] = ("dark", "light")
LETTERS: tuple[str, ...] = ("e", "h", "k", "x", "z")  # answers; drawn as capitals (``_GLYPHS``)
QTYPES: tuple[str, ...] = ("color", "shape", "exist", "relation", "count", "background", "text",
                           "letter", "dot")
FINE_KINDS: tuple[str, ...] = ("letter", "dot")  # answers that live in one patch
AUX_KINDS: tuple[str, ...] = ("position",)  # training-only
SIDES: dict[str, tuple[str, str]] = {"horizontal": ("left", "right"), "vertical": ("top", "bottom")}

MIN_OBJECTS, MAX_OBJECTS = 3, 6
MIN_RADIUS, MAX_RADIUS = 12, 18
MIN_APART = 16  # px between centres along a relation's axis
MASK_THRESHOLD = 0.1  # fraction of a patch an object must cover to be in its mask
LABEL_THRESHOLD = 0.3  # fraction of a patch an object must cover to label it (stage-1 labels)
TRAIN_SEED_START = 1_000_000
GREY = {"dark": (45, 95), "light": (150, 200)}  # range of the mean grey of background blocks

DOT_RADIUS = 3.2
GLYPH_INK = 15  # grey level of a letter's strokes

# 5x7 capitals, drawn at 2x (10x14 px) centred horizontally in one 14x14 patch: one patch holds the answer
_GLYPHS: dict[str, tuple[str, ...]] = {
    "e": ("11111", "10000", "10000", "11110", "10000", "10000", "11111"),
    "h": ("10001", "10001", "10001", "11111", "10001", "10001", "10001"),
    "k": ("10001", "10010", "10100", "11000", "10100", "10010", "10001"),
    "x": ("10001", "10001", "01010", "00100", "01010", "10001", "10001"),
    "z": ("11111", "00001", "00010", "00100", "01000", "10000", "11111"),
}

_YX = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) + 0.5  # pixel centres, [2,H,W]
_CHECKER = np.where(np.add.outer(np.arange(PATCH) // 7, np.arange(PATCH) // 7) % 2 == 0, 235, 20)


@dataclass
class SceneObject:
    """One shape in a scene. ``coverage`` is a float array [144]: the fraction of each patch's
    pixels the object covers."""

    shape: str
    color: str
    cx: float
    cy: float
    radius: float
    coverage: np.ndarray = field(repr=False)
    letter: str = ""
    letter_patch: int = -1  # row-major index of the patch holding the letter

    def mask(self, threshold: float = MASK_THRESHOLD) -> np.ndarray:
        """Bool [144]: patches covered by more than ``threshold``."""
        return self.coverage > threshold


@dataclass
class Scene:
    """A rendered scene. ``image`` is a 168x168 RGB PIL image; ``background`` is dark or light."""

    seed: int
    image: Image.Image
    objects: list[SceneObject]
    background: str
    dot_color: str = ""
    dot_patch: int = -1  # row-major index of the patch holding the dot

    @property
    def coverage(self) -> np.ndarray:
        """Float [n_objects, 144]: per-object patch coverage."""
        return np.stack([o.coverage for o in self.objects])

    def patch_labels(self, threshold: float = LABEL_THRESHOLD) -> tuple[np.ndarray, np.ndarray]:
        """Dense per-patch labels for vision pre-training.

        Returns (color_ids [144], shape_ids [144]), int64: 0 = background, otherwise
        1 + index into ``COLORS`` / ``SHAPES`` of the object covering most of the patch,
        if it covers more than ``threshold``.
        """
        cov = self.coverage
        best = cov.argmax(0)
        covered = cov.max(0) > threshold
        color_idx = np.array([list(COLORS).index(o.color) + 1 for o in self.objects])
        shape_idx = np.array([SHAPES.index(o.shape) + 1 for o in self.objects])
        return (np.where(covered, color_idx[best], 0).astype(np.int64),
                np.where(covered, shape_idx[best], 0).astype(np.int64))

    def fine_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-patch labels of the fine details: (letter ids [144], dot colour ids [144]), int64,
        0 = none, otherwise 1 + index into ``LETTERS`` / ``COLORS``."""
        letters = np.zeros(N_PATCHES, dtype=np.int64)
        for o in self.objects:
            letters[o.letter_patch] = LETTERS.index(o.letter) + 1
        dots = np.zeros(N_PATCHES, dtype=np.int64)
        if self.dot_patch >= 0:
            dots[self.dot_patch] = list(COLORS).index(self.dot_color) + 1
        return letters, dots

    def background_mask(self) -> np.ndarray:
        """Bool [144]: patches no object touches (the marker and dot patches excluded)."""
        out = ~_union(self.objects)
        out[MARKER_PATCH] = False
        if self.dot_patch >= 0:
            out[self.dot_patch] = False
        return out


@dataclass
class Question:
    """A question about a scene; masks are bool [144] in row-major patch order."""

    text: str
    answer: str
    qtype: str
    target_mask: np.ndarray = field(repr=False)
    other_mask: np.ndarray = field(repr=False)


def _shape_mask(shape: str, cx: float, cy: float, r: float) -> np.ndarray:
    """Bool [H, W] pixel mask of a shape with centre (cx, cy) and radius r."""
    y, x = _YX
    if shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    if shape == "square":
        half = 0.85 * r  # similar area to the circle
        return (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    if shape == "triangle":  # upward, apex at the top, base at cy + r
        top, bottom = cy - r, cy + r
        half_width = (y - top) / (bottom - top) * r * 1.1
        return (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half_width)
    raise ValueError(f"unknown shape {shape!r}")


def _patch_coverage(pixel_mask: np.ndarray) -> np.ndarray:
    """Float [144]: fraction of each 14x14 patch covered by a [H, W] bool mask."""
    blocks = pixel_mask.reshape(GRID, PATCH, GRID, PATCH)
    return blocks.mean(axis=(1, 3)).reshape(-1)


def _background(rng: np.random.Generator, kind: str) -> np.ndarray:
    """Float [H, W, 3]: blocky low-saturation texture of a dark or light grey, plus pixel noise."""
    block = int(rng.integers(6, 15))
    n = -(-IMAGE_SIZE // block)
    grey = rng.uniform(*GREY[kind], size=(n, n, 1))
    tint = rng.uniform(-12, 12, size=(n, n, 3))
    coarse = np.repeat(np.repeat(grey + tint, block, 0), block, 1)[:IMAGE_SIZE, :IMAGE_SIZE]
    return coarse + rng.normal(0, 10, size=(IMAGE_SIZE, IMAGE_SIZE, 3))


def _clear_of_marker(cx: float, cy: float, r: float) -> bool:
    """True when a shape's bounding box keeps 2 px away from the marker patch."""
    return cx - r > PATCH + 2 or cy - r > PATCH + 2


def _one_hot(index: int) -> np.ndarray:
    out = np.zeros(N_PATCHES, dtype=bool)
    out[index] = True
    return out


def _patch_box(index: int) -> tuple[int, int]:
    """(top, left) pixel of a row-major patch index."""
    return (index // GRID) * PATCH, (index % GRID) * PATCH


def _draw_letter(pixels: np.ndarray, letter: str, patch: int) -> None:
    """Ink a 2x capital (10x14 px) into ``patch``, 2 px from its left edge."""
    ink = np.kron(np.array([[c == "1" for c in row] for row in _GLYPHS[letter]]), np.ones((2, 2), bool))
    top, left = _patch_box(patch)
    region = pixels[top:top + PATCH, left + 2:left + 12]
    region[ink] = GLYPH_INK


def _place_dot(pixels: np.ndarray, rng: np.random.Generator, objects: list[SceneObject]) -> tuple[str, int]:
    """Draw one small dot centred in a random background patch no object touches; (colour, patch)."""
    touched = np.zeros(N_PATCHES, dtype=bool)
    for o in objects:
        touched |= o.coverage > 0
    touched[MARKER_PATCH] = True
    free = np.flatnonzero(~touched)
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    if not len(free):
        return "", -1
    patch = int(free[int(rng.integers(len(free)))])
    top, left = _patch_box(patch)
    y, x = _YX
    dot = (x - left - PATCH / 2) ** 2 + (y - top - PATCH / 2) ** 2 <= DOT_RADIUS ** 2
    pixels[dot] = COLORS[color]
    return color, patch


def make_scene(seed: int, n_objects: int | None = None) -> Scene:
    """Render the scene of ``seed``: 3-6 non-overlapping shapes (``n_objects`` when given: the
    training curriculum's small scenes), each with a letter, on a dark or light background, one
    small dot, the checker marker in the top-left patch."""
    rng = np.random.default_rng([seed, 0])
    background = BACKGROUNDS[int(rng.integers(2))]
    pixels = _background(rng, background)
    pixels[:PATCH, :PATCH] = _CHECKER[..., None]
    drawn = int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1))
    n_objects = drawn if n_objects is None else n_objects
    placed: list[tuple[float, float, float]] = []
    objects: list[SceneObject] = []
    color_names = list(COLORS)
    for _ in range(400):  # rejection sampling of positions
        if len(objects) == n_objects:
            break
        r = float(rng.uniform(MIN_RADIUS, MAX_RADIUS))
        cx, cy = (float(v) for v in rng.uniform(r + 1, IMAGE_SIZE - r - 1, size=2))
        if not _clear_of_marker(cx, cy, r) or any(
                (cx - px) ** 2 + (cy - py) ** 2 < (r + pr + 3) ** 2 for px, py, pr in placed):
            continue
        placed.append((cx, cy, r))
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        color = color_names[int(rng.integers(len(color_names)))]
        pix = _shape_mask(shape, cx, cy, r)
        shade = np.array(COLORS[color], dtype=np.float64) * rng.uniform(0.9, 1.05)
        pixels[pix] = shade + rng.normal(0, 8, size=(int(pix.sum()), 3))
        coverage = _patch_coverage(pix)
        objects.append(SceneObject(shape, color, cx, cy, r, coverage,
                                   LETTERS[int(rng.integers(len(LETTERS)))], int(coverage.argmax())))
    for o in objects:  # letters last, so no later shape paints over one
        _draw_letter(pixels, o.letter, o.letter_patch)
    dot_color, dot_patch = _place_dot(pixels, rng, objects)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    return Scene(seed, image, objects, background, dot_color, dot_patch)


def _union(objects: list[SceneObject]) -> np.ndarray:
    """Bool [144]: union of the objects' masks."""
    out = np.zeros(N_PATCHES, dtype=bool)
    for o in objects:
        out |= o.mask()
    return out


def _question(scene: Scene, text: str, answer: str, qtype: str,
              targets: list[SceneObject], target: np.ndarray | None = None) -> Question:
    """A question whose answering patches are the targets' masks (or ``target`` when given)."""
    target = _union(targets) if target is None else target
    other = _union([o for o in scene.objects if all(o is not t for t in targets)]) & ~target
    return Question(text, answer, qtype, target, other)


def _relation_holds(relation: str, a: SceneObject, b: SceneObject) -> bool | None:
    """Whether ``a`` is ``relation`` ``b``; None when the two are too close on that axis to say."""
    horizontal = relation in ("left of", "right of")
    delta = (a.cx - b.cx) if horizontal else (a.cy - b.cy)
    if abs(delta) < MIN_APART:
        return None
    return (delta < 0) if relation in ("left of", "above") else (delta > 0)


def _candidates(scene: Scene, qtype: str, rng: np.random.Generator) -> list[Question]:
    """All questions of one kind that are well-posed for ``scene`` (yes/no kinds: one coin flip)."""
    objs = scene.objects
    if qtype == "color":
        return [_question(scene, f"what color is the {s} ?", o.color, qtype, [o])
                for s in SHAPES for o in objs if o.shape == s
                and sum(p.shape == s for p in objs) == 1]
    if qtype == "shape":
        return [_question(scene, f"what shape is the {c} object ?", o.shape, qtype, [o])
                for c in COLORS for o in objs if o.color == c
                and sum(p.color == c for p in objs) == 1]
    if qtype == "exist":
        return _exist_candidates(scene, rng)
    if qtype == "relation":
        return _relation_candidates(scene, rng)
    if qtype == "count":
        counts = {c: [o for o in objs if o.color == c] for c in COLORS}
        return [_question(scene, f"how many {c} objects ?", NUMBERS[len(members)], qtype, members)
                for c, members in counts.items() if len(members) < len(NUMBERS)]
    if qtype == "background":
        return [_question(scene, "is the background dark or light ?", scene.background, qtype,
                          [], scene.background_mask())]
    if qtype == "text":
        color, shape = list(COLORS)[int(rng.integers(len(COLORS)))], SHAPES[int(rng.integers(3))]
        return [_question(scene, f"the object is {color} . what color is it ?", color, qtype, []),
                _question(scene, f"the object is a {shape} . what shape is it ?", shape, qtype, [])]
    if qtype == "letter":
        return [_question(scene, f"what letter is on the {o.color} {o.shape} ?", o.letter, qtype, [o],
                          _one_hot(o.letter_patch)) for o in _unique(objs)]
    if qtype == "dot":
        return [] if scene.dot_patch < 0 else [
            _question(scene, "what color is the dot ?", scene.dot_color, qtype, [], _one_hot(scene.dot_patch))]
    if qtype == "position":
        return _position_candidates(scene)
    raise ValueError(f"unknown question kind {qtype!r}; choose one of {', '.join(QTYPES)}")


def _exist_candidates(scene: Scene, rng: np.random.Generator) -> list[Question]:
    objs = scene.objects
    present = {(o.color, o.shape) for o in objs}
    if rng.random() < 0.5:
        return [_question(scene, f"is there a {c} {s} ?", "yes", "exist",
                          [o for o in objs if (o.color, o.shape) == (c, s)])
                for c, s in sorted(present)]
    colors, shapes = {c for c, _ in present}, {s for _, s in present}
    hard = [(c, s) for c in COLORS for s in SHAPES
            if (c, s) not in present and (c in colors or s in shapes)]
    return [_question(scene, f"is there a {c} {s} ?", "no", "exist", []) for c, s in hard]


def _unique(objs: list[SceneObject]) -> list[SceneObject]:
    """The objects no other object shares both colour and shape with."""
    return [o for o in objs if sum((p.color, p.shape) == (o.color, o.shape) for p in objs) == 1]


def _position_candidates(scene: Scene) -> list[Question]:
    """Uniquely named objects clearly on one side of the image (``MIN_APART`` px from the middle)."""
    out = []
    for o in _unique(scene.objects):
        for axis, (first, second) in SIDES.items():
            delta = (o.cx if axis == "horizontal" else o.cy) - IMAGE_SIZE / 2
            if abs(delta) >= MIN_APART:
                text = (f"is the {o.color} {o.shape} on the left or right ?" if axis == "horizontal"
                        else f"is the {o.color} {o.shape} at the top or bottom ?")
                out.append(_question(scene, text, first if delta < 0 else second, "position", [o]))
    return out


def _relation_candidates(scene: Scene, rng: np.random.Generator) -> list[Question]:
    """Pairs of uniquely named objects and a relation that clearly holds (yes) or clearly fails
    (no), chosen by one coin flip."""
    unique = _unique(scene.objects)
    want = bool(rng.random() < 0.5)
    out = []
    for a in unique:
        for b in unique:
            for rel in RELATIONS:
                holds = None if a is b else _relation_holds(rel, a, b)
                if holds is want:
                    out.append(_question(
                        scene, f"is the {a.color} {a.shape} {rel} the {b.color} {b.shape} ?",
                        "yes" if want else "no", "relation", [a, b]))
    return out


def make_questions(scene: Scene, seed: int, n: int | None = None,
                   kinds: tuple[str, ...] = QTYPES) -> list[Question]:
    """Sample ``n`` questions about ``scene`` (default: one per kind), kinds balanced.

    Kinds cycle in a seeded random order; a kind with no well-posed question for this scene is
    skipped (when no kind has one, fewer than ``n`` come back). Questions may repeat when ``n``
    exceeds the distinct candidates.
    """
    rng = np.random.default_rng([seed, 1])
    n = len(kinds) if n is None else n
    order = [kinds[i] for i in rng.permutation(len(kinds))]
    out: list[Question] = []
    i, misses = 0, 0
    while len(out) < n and misses < len(order):
        qtype = order[i % len(order)]
        i += 1
        cands = _candidates(scene, qtype, rng)
        misses = 0 if cands else misses + 1
        if cands:
            out.append(cands[int(rng.integers(len(cands)))])
    return out


def heldout_items(seeds: range, per_scene: int, kinds: tuple[str, ...] = QTYPES) -> Iterator[tuple[Scene, Question]]:
    """Yield (scene, question) pairs for held-out seeds (all must be < TRAIN_SEED_START), questions of `kinds`."""
    if seeds.start < 0 or max(seeds, default=0) >= TRAIN_SEED_START:
        raise ValueError(f"held-out seeds must lie in [0, {TRAIN_SEED_START})")
    for seed in seeds:
        scene = make_scene(seed)
        for q in make_questions(scene, seed, per_scene, kinds):
            yield scene, q


def describe(scene: Scene, question: Question | None = None) -> dict:
    """A scene's ground truth as plain JSON: grid, background, objects with their patches (row-major
    indices into the 12x12 grid) and, for a question, its text, answer, kind and answering patches."""
    out = {
        "seed": scene.seed, "grid": GRID, "background": scene.background,
        "marker_patch": MARKER_PATCH, "dot": {"color": scene.dot_color, "patch": scene.dot_patch},
        "objects": [{"shape": o.shape, "color": o.color, "cx": round(o.cx, 2), "cy": round(o.cy, 2),
                     "radius": round(o.radius, 2), "patches": np.flatnonzero(o.mask()).tolist(),
                     "letter": o.letter, "letter_patch": o.letter_patch}
                    for o in scene.objects],
    }
    if question is not None:
        out["question"] = {"text": question.text, "answer": question.answer, "kind": question.qtype,
                           "answering_patches": np.flatnonzero(question.target_mask).tolist()}
    return out


def save_scene(scene: Scene, path, question: Question | None = None) -> None:
    """Write the scene as a PNG whose text metadata (`METADATA_KEY`) holds `describe(...)`."""
    import json

    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text(METADATA_KEY, json.dumps(describe(scene, question)))
    scene.image.save(path, pnginfo=info)


def export_examples(folder: str, seeds: range = range(600_000, 600_014)) -> list[dict]:
    """Write held-out example scenes (question kinds in turn, so every kind appears) as PNGs with
    their ground truth in the metadata, plus ``scenes.json`` (file, seed, prompt, answer, qtype)."""
    import json
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, seed in enumerate(seeds):
        scene = make_scene(seed)
        wanted = QTYPES[i % len(QTYPES)]
        questions = make_questions(scene, seed, 4 * len(QTYPES))
        q = next((q for q in questions if q.qtype == wanted), questions[0])
        name = f"scene_{seed}.png"
        save_scene(scene, out / name, q)
        entries.append({"file": name, "seed": seed, "prompt": q.text, "answer": q.answer,
                        "qtype": q.qtype})
    (out / "scenes.json").write_text(json.dumps(entries, indent=1) + "\n")
    return entries


if __name__ == "__main__":
    import sys

    export_examples(sys.argv[1] if len(sys.argv) > 1 else "assets/examples")
