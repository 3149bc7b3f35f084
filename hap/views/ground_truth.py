"""Ground truth of a synthetic scene against what the pruner saw: grounding of heads, recall of cuts.

A scene PNG written by `analysis.scenes.save_scene` carries its description in the text metadata
(`METADATA_KEY`): objects with their patches and, for the question it was saved
with, the answering patches. These functions work on plain arrays:

  * head grounding = a head's share of visual attention on the answering patches divided by their
    share of the area (1 = no preference, > 1 = the head looks where the answer is);
  * kept recall = the share of the answering patches a cut keeps.

`scene_truth` applies them to one run as the views hold it (`hap.views.ViewData`), for the page and
the `/analyze` JSON (`truth_json`). The truth is about the question the scene was saved with: a
prompt that asks something else gets none (the page names the saved question instead).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from hap.causal import paq_spearman
from hap.views import Truth, ViewData

METADATA_KEY = "hap-scene"  # PNG text chunk holding a scene's description (JSON)
GRID = 12  # a scene's patches per side (analysis.scenes draws on this grid)
N_PATCHES = GRID * GRID  # 144: the visual tokens of a scene, row-major


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


def answering_cut(dist: np.ndarray, target: np.ndarray) -> np.ndarray:
    """`dist [layers, heads, V]` (NaN where a token was not in the layer's input, or the layer not captured) and bool
    `target [V]` -> bool `[layers]`: the captured layers whose input held none of the answering patches (an
    earlier cut removed them all), where grounding is unknown rather than 0."""
    present = np.isfinite(np.asarray(dist, float)).any(axis=1)  # [layers, V]
    return present.any(-1) & ~(present & target).any(-1)


def kept_recall(kept: np.ndarray, target: np.ndarray) -> float | None:
    """Share of the answering patches among the kept original visual indices `kept [k]`; None
    with no answering patch."""
    if not target.any():
        return None
    return float(target[np.asarray(kept, dtype=int)].sum() / target.sum())


def file_metadata(source: str | Path | Image.Image) -> dict | None:
    """`read_metadata` of the file as uploaded (its PNG text chunks, before any conversion) or of a PIL image."""
    if isinstance(source, Image.Image):
        return read_metadata(source)
    with Image.open(source) as image:  # the header and text chunks only
        return read_metadata(image)


def _words(text: str) -> str:
    return " ".join(text.lower().split())


def question_for(meta: dict | None, prompt: str, visual: int) -> tuple[dict | None, str]:
    """(the saved question when `prompt` asks it and the model's grid is the scene's, else None; why not, for the
    page). Prompts are compared by their words, case aside."""
    if meta is None:
        return None, ("this image carries no scene description (only the synthetic scenes of assets/examples, "
                      "written by analysis.scenes.save_scene, have one), so there is no ground truth to compare with")
    question = meta.get("question")
    if question is None:
        return None, "the scene description holds objects but no question, so no patch is known to answer this prompt"
    if _words(question["text"]) != _words(prompt):
        return None, (f"the ground truth of this scene is for \"{question['text']}\"; ask exactly that to see which "
                      "patches answer it")
    if visual != N_PATCHES:
        return None, f"the scene's truth is on its {N_PATCHES}-patch grid; this model sees {visual} visual tokens"
    return question, ""


def scene_truth(question: dict, data: ViewData) -> Truth:
    """The truth of `question` about one run: its answering patches, every scored head's grounding on them
    (NaN for heads not scored, and unknown: NaN, for the layers whose input no longer held any answering patch),
    the Spearman of grounding and PAQ over the heads with a grounding, each group's recall."""
    target = patch_mask(question["answering_patches"], data.shape[2])
    grounding = head_grounding(data.head_attention, target)
    rho, cut = None, None
    if grounding is not None:
        paq = data.stats[..., 0]
        cut = answering_cut(data.head_attention, target)
        grounding = np.where(np.isnan(paq) | cut[:, None], np.nan, grounding)
        rho = paq_spearman(paq, grounding)
    return Truth(question["text"], target, grounding, rho, [kept_recall(g.kept, target) for g in data.groups], cut)


def truth_json(truth: Truth) -> dict:
    """The `ground_truth` entry of the `/analyze` JSON: queried patch indices, head grounding [layers][heads]
    (null where not scored, where the answering patches were cut before the layer, or with no answering patch), the
    Spearman with PAQ, each group's kept recall."""
    grounding = None if truth.grounding is None else [
        [None if np.isnan(v) else float(v) for v in row] for row in truth.grounding]
    return {"queried": np.flatnonzero(truth.patches).tolist(), "head_grounding": grounding,
            "spearman": truth.spearman, "kept_recall": truth.kept_recall}
