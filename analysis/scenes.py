"""Seeded synthetic scenes and one-word questions with ground-truth patch masks.

A scene is a 168x168 RGB image (patch 14 -> a 12x12 grid = 144 visual tokens, the LLaVA
visual token order is row-major over that grid) on a noisy, blocky grey background with
2-5 non-overlapping coloured shapes. Everything is a deterministic function of an integer
seed (numpy ``Generator``).

Seed ranges (disjoint by construction):
  * held-out / benchmark seeds: ``0 <= seed < TRAIN_SEED_START`` (1_000_000);
  * training seeds:            ``seed >= TRAIN_SEED_START``.

Question types (one-word answers):
  * ``color``: ``what color is the <shape> ?``      -- the shape is unique in the scene;
  * ``shape``: ``what shape is the <color> object ?`` -- the colour is unique in the scene;
  * ``exist``: ``is there a <color> <shape> ?``     -- yes/no, 50% hard negatives (the colour
    or the shape, never both, occurs in the scene).
Counting questions are not generated.

Masks: a patch belongs to an object's mask when the object covers more than
``MASK_THRESHOLD`` (10%) of the patch's pixels. ``target_mask`` is the union of the masks of
the object(s) the question is about; for a negative ``exist`` question there is no such
object and ``target_mask`` is empty. ``other_mask`` is the union of the masks of all other
objects (for a negative ``exist`` question: all objects), minus ``target_mask``.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

IMAGE_SIZE = 168
PATCH = 14
GRID = IMAGE_SIZE // PATCH  # 12
N_PATCHES = GRID * GRID  # 144

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 175, 60),
    "blue": (45, 80, 225),
    "yellow": (235, 210, 40),
    "purple": (150, 55, 190),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
QTYPES: tuple[str, ...] = ("color", "shape", "exist")

MIN_OBJECTS, MAX_OBJECTS = 2, 5
MIN_RADIUS, MAX_RADIUS = 14, 22
MASK_THRESHOLD = 0.1  # fraction of a patch an object must cover to be in its mask
LABEL_THRESHOLD = 0.3  # fraction of a patch an object must cover to label it (stage-1 labels)
TRAIN_SEED_START = 1_000_000

_YX = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) + 0.5  # pixel centres, [2,H,W]


@dataclass
class SceneObject:
    """One shape in a scene.

    ``coverage`` is a float array [144]: the fraction of each patch's pixels the object covers.
    """

    shape: str
    color: str
    cx: float
    cy: float
    radius: float
    coverage: np.ndarray = field(repr=False)

    def mask(self, threshold: float = MASK_THRESHOLD) -> np.ndarray:
        """Bool [144]: patches covered by more than ``threshold``."""
        return self.coverage > threshold


@dataclass
class Scene:
    """A rendered scene. ``image`` is a 168x168 RGB PIL image."""

    seed: int
    image: Image.Image
    objects: list[SceneObject]

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


def _background(rng: np.random.Generator) -> np.ndarray:
    """Float [H, W, 3]: blocky low-saturation texture plus pixel noise."""
    block = int(rng.integers(6, 15))
    n = -(-IMAGE_SIZE // block)
    grey = rng.uniform(70, 170, size=(n, n, 1))
    tint = rng.uniform(-12, 12, size=(n, n, 3))
    coarse = np.repeat(np.repeat(grey + tint, block, 0), block, 1)[:IMAGE_SIZE, :IMAGE_SIZE]
    return coarse + rng.normal(0, 10, size=(IMAGE_SIZE, IMAGE_SIZE, 3))


def make_scene(seed: int) -> Scene:
    """Render the scene of ``seed``: 2-5 non-overlapping shapes on a textured background."""
    rng = np.random.default_rng([seed, 0])
    pixels = _background(rng)
    n_objects = int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1))
    placed: list[tuple[float, float, float]] = []
    objects: list[SceneObject] = []
    color_names = list(COLORS)
    for _ in range(200):  # rejection sampling of positions
        if len(objects) == n_objects:
            break
        r = float(rng.uniform(MIN_RADIUS, MAX_RADIUS))
        cx, cy = (float(v) for v in rng.uniform(r + 1, IMAGE_SIZE - r - 1, size=2))
        if any((cx - px) ** 2 + (cy - py) ** 2 < (r + pr + 3) ** 2 for px, py, pr in placed):
            continue
        placed.append((cx, cy, r))
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        color = color_names[int(rng.integers(len(color_names)))]
        pix = _shape_mask(shape, cx, cy, r)
        shade = np.array(COLORS[color], dtype=np.float64) * rng.uniform(0.9, 1.05)
        pixels[pix] = shade + rng.normal(0, 8, size=(int(pix.sum()), 3))
        objects.append(SceneObject(shape, color, cx, cy, r, _patch_coverage(pix)))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    return Scene(seed=seed, image=image, objects=objects)


def _union(objects: list[SceneObject]) -> np.ndarray:
    """Bool [144]: union of the objects' masks."""
    out = np.zeros(N_PATCHES, dtype=bool)
    for o in objects:
        out |= o.mask()
    return out


def _question(scene: Scene, text: str, answer: str, qtype: str,
              targets: list[SceneObject]) -> Question:
    target = _union(targets)
    other = _union([o for o in scene.objects if all(o is not t for t in targets)]) & ~target
    return Question(text, answer, qtype, target, other)


def _candidates(scene: Scene, qtype: str, rng: np.random.Generator) -> list[Question]:
    """All questions of one type that are well-posed for ``scene`` (exist: one coin flip)."""
    objs = scene.objects
    if qtype == "color":
        return [_question(scene, f"what color is the {s} ?", o.color, qtype, [o])
                for s in SHAPES for o in objs if o.shape == s
                and sum(p.shape == s for p in objs) == 1]
    if qtype == "shape":
        return [_question(scene, f"what shape is the {c} object ?", o.shape, qtype, [o])
                for c in COLORS for o in objs if o.color == c
                and sum(p.color == c for p in objs) == 1]
    present = {(o.color, o.shape) for o in objs}
    if rng.random() < 0.5:
        return [_question(scene, f"is there a {c} {s} ?", "yes", qtype,
                          [o for o in objs if (o.color, o.shape) == (c, s)])
                for c, s in sorted(present)]
    colors, shapes = {c for c, _ in present}, {s for _, s in present}
    hard = [(c, s) for c in COLORS for s in SHAPES
            if (c, s) not in present and (c in colors or s in shapes)]
    return [_question(scene, f"is there a {c} {s} ?", "no", qtype, []) for c, s in hard]


def make_questions(scene: Scene, seed: int, n: int | None = None) -> list[Question]:
    """Sample ``n`` questions about ``scene`` (default: one per type), types balanced.

    Types cycle in a seeded random order; a type with no well-posed question for this
    scene is skipped. Questions may repeat when ``n`` exceeds the distinct candidates.
    """
    rng = np.random.default_rng([seed, 1])
    n = len(QTYPES) if n is None else n
    order = [QTYPES[i] for i in rng.permutation(len(QTYPES))]
    out: list[Question] = []
    i = 0
    while len(out) < n:
        qtype = order[i % len(order)]
        i += 1
        cands = _candidates(scene, qtype, rng)
        if cands:  # 'exist' always has candidates on a positive coin flip, so this ends
            out.append(cands[int(rng.integers(len(cands)))])
    return out


def heldout_items(seeds: range, per_scene: int) -> Iterator[tuple[Scene, Question]]:
    """Yield (scene, question) pairs for held-out seeds (all must be < TRAIN_SEED_START)."""
    if seeds.start < 0 or max(seeds, default=0) >= TRAIN_SEED_START:
        raise ValueError(f"held-out seeds must lie in [0, {TRAIN_SEED_START})")
    for seed in seeds:
        scene = make_scene(seed)
        for q in make_questions(scene, seed, per_scene):
            yield scene, q


def export_examples(folder: str, seeds: range = range(600_000, 600_006)) -> list[dict]:
    """Write held-out example scenes as PNGs plus ``scenes.json`` (file, seed, prompt, answer,
    qtype); question types rotate over the scenes."""
    import json
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, seed in enumerate(seeds):
        scene = make_scene(seed)
        wanted = QTYPES[i % len(QTYPES)]
        questions = make_questions(scene, seed, 3 * len(QTYPES))
        q = next((q for q in questions if q.qtype == wanted), questions[0])
        name = f"scene_{seed}.png"
        scene.image.save(out / name)
        entries.append({"file": name, "seed": seed, "prompt": q.text, "answer": q.answer,
                        "qtype": q.qtype})
    (out / "scenes.json").write_text(json.dumps(entries, indent=1) + "\n")
    return entries


if __name__ == "__main__":
    import sys

    export_examples(sys.argv[1] if len(sys.argv) > 1 else "assets/examples")
