"""Ground truth of a synthetic scene against what the pruner saw: grounding of heads, recall of cuts.

A scene PNG written by `analysis.scenes.save_scene` carries its description in the text metadata
(`analysis.scenes.METADATA_KEY`): objects with their patches and, for the question it was saved
with, the answering patches. These functions work on plain arrays:

  * head grounding = a head's share of visual attention on the answering patches divided by their
    share of the area (1 = no preference, > 1 = the head looks where the answer is);
  * kept recall = the share of the answering patches a cut keeps.
"""
from __future__ import annotations

import json

import numpy as np
from PIL import Image

from analysis.scenes import METADATA_KEY, N_PATCHES


def read_metadata(image: Image.Image) -> dict | None:
    """The scene description stored in a PNG's text chunk, or None when the image has none (or it
    is not a valid description: an object list and, if present, a question with answering patches
    inside the 144-patch grid)."""
    raw = image.info.get(METADATA_KEY)  # PNG text chunks land in `info` (kept by `convert`)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
        patches = meta.get("question", {}).get("answering_patches", [])
        if not isinstance(meta.get("objects"), list) or not all(
                isinstance(p, int) and 0 <= p < N_PATCHES for p in patches):
            return None
    except (ValueError, AttributeError):
        return None
    return meta


def patch_mask(patches: list[int], n: int = N_PATCHES) -> np.ndarray:
    """Bool [n] with the listed patch indices set."""
    mask = np.zeros(n, dtype=bool)
    mask[np.asarray(patches, dtype=int)] = True
    return mask


def head_grounding(dist: np.ndarray, target: np.ndarray) -> np.ndarray | None:
    """`dist [..., V]` (each head's visual attention, summing to 1 over the tokens present; NaN where
    a token was pruned) and bool `target [V]` -> grounding `[...]`, or None with no answering patch."""
    if not target.any():
        return None
    share = np.nansum(np.asarray(dist, float) * target, axis=-1)
    return share / (target.sum() / target.size)


def kept_recall(kept: np.ndarray, target: np.ndarray) -> float | None:
    """Share of the answering patches among the kept original visual indices `kept [k]`; None
    with no answering patch."""
    if not target.any():
        return None
    return float(target[np.asarray(kept, dtype=int)].sum() / target.sum())
