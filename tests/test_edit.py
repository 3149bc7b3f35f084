"""The page's image editor (app/edit.py): its composite takes the checked path of an upload, an unedited value is
the upload itself (ground truth kept), and a run on an edited image is compared with the run on the original."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from app_model import ROOT
from PIL import Image

from app.edit import EditDiff, image_input
from hap import views
from hap.runs.inputs import InputLimits
from hap.runs.trace import Group

SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the triangle ?"


def file(path) -> dict:
    return {"path": str(path), "orig_name": path.name, "meta": {"_type": "gradio.FileData"}}


def editor(background, composite) -> dict:
    return {"background": background and file(background), "layers": [], "composite": composite and file(composite)}


def painted(tmp_path, name: str = "composite.png"):
    """The scene with a black square painted over its top-left quarter, saved as the editor saves a composite."""
    pixels = np.asarray(Image.open(SCENE).convert("RGBA")).copy()
    pixels[: pixels.shape[0] // 2, : pixels.shape[1] // 2] = (0, 0, 0, 255)
    Image.fromarray(pixels).save(tmp_path / name)
    return tmp_path / name


def test_an_unedited_value_is_the_upload_itself(uploads):
    same = uploads / "composite.png"
    Image.open(SCENE).convert("RGBA").save(same)  # the canvas re-encodes: no metadata, same pixels
    picture = image_input(editor(SCENE, same), InputLimits())
    assert (picture.source, picture.name, picture.edited) == (str(SCENE), SCENE.name, False)
    assert image_input(file(SCENE), InputLimits()).source == str(SCENE)  # a plain upload, as the API sends it


def test_an_edited_composite_is_checked_like_an_upload(uploads):
    tmp_path = uploads.resolve()
    picture = image_input(editor(SCENE, painted(tmp_path)), InputLimits())
    assert (picture.source, picture.original, picture.name) == (str(tmp_path / "composite.png"), str(SCENE),
                                                              f"{SCENE.name} (edited)")
    cropped = tmp_path / "cropped.png"
    Image.open(SCENE).crop((0, 0, 100, 90)).save(cropped)
    assert image_input(editor(SCENE, cropped), InputLimits()).edited  # a crop is an edit
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(ValueError, match=r"image 'scene_600000.png \(edited\)': not a readable image"):
        image_input(editor(SCENE, tmp_path / "broken.png"), InputLimits())
    with pytest.raises(ValueError, match="megapixels"):
        image_input(editor(SCENE, painted(tmp_path)), InputLimits(max_pixels=100))
    with pytest.raises(ValueError, match="no image: upload one"):
        image_input(editor(None, None), InputLimits())


IN_UPLOADS = ("symlink-loop", "missing-upload")  # kinds naming a path inside the upload cache that is no file


def outside_paths(root: Path, uploads: Path) -> dict[str, str]:
    """Paths a request must not name, by kind: files outside the upload cache (`uploads`) and the examples (made in
    `root/outside`), `..` out of either, a symlink out of the cache, and what is not a readable file."""
    outside = root / "outside"
    outside.mkdir()
    Image.open(SCENE).save(outside / "private.png")
    (outside / "notes.txt").write_text("not an image")
    (uploads / "link.png").symlink_to(outside / "private.png")
    (uploads / "loop.png").symlink_to(uploads / "loop.png")
    up = "/".join([".."] * (len(uploads.resolve().parts) - 1))  # from the cache up to /
    return {"image": str(outside / "private.png"), "text": str(outside / "notes.txt"), "folder": str(outside),
            "missing": str(outside / "missing.png"), "system": "/etc/hostname",
            "relative": "assets/tiny-llava/config.json", "dotdot-upload": f"{uploads}/{up}{outside}/private.png",
            "dotdot-example": f"{SCENE.parent}/../../app/app.py", "symlink": str(uploads / "link.png"),
            "symlink-loop": str(uploads / "loop.png"), "missing-upload": str(uploads / "gone.png")}


def test_a_path_outside_the_uploads_and_examples_is_refused_with_one_message(tmp_path, monkeypatch):
    """Every path that is not a file in the upload cache or the examples, in a plain upload or the editor's background
    or composite, with gradio's meta or without: the one message REFUSED, which says nothing of what the path names."""
    from app.uploads import REFUSED

    uploads = tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(uploads))
    odd = {"null-byte": f"{uploads}/a\x00.png", "not-text": 7}
    for kind, path in {**outside_paths(tmp_path, uploads), **odd}.items():
        for meta in ({}, {"meta": {"_type": "gradio.FileData"}}):
            value = {"path": path, "orig_name": "x.png", **meta}
            for request in (value, {"background": value, "layers": [], "composite": None},
                            {"background": file(SCENE), "layers": [], "composite": value}):
                with pytest.raises(ValueError) as err:
                    image_input(request, InputLimits())
                assert str(err.value) == REFUSED, (kind, meta, request)
    (uploads / "kept.png").write_bytes(SCENE.read_bytes())
    kept = image_input({"path": f"{uploads}/sub/../kept.png"}, InputLimits()).source
    assert kept == str(uploads.resolve() / "kept.png")
    assert image_input({"path": str(SCENE)}, InputLimits()).source == str(SCENE)  # an example, without meta too


def view(kept: list[list[int]], classes: list[list[str]], grid: tuple[int, int] = (2, 2)) -> views.ViewData:
    visual = grid[0] * grid[1]
    layers, heads = len(classes), len(classes[0])
    empty = np.zeros((layers, heads, visual))
    return views.ViewData(image=np.zeros((4 * grid[0], 4 * grid[1], 3), np.uint8), grid=grid, head_class=classes,
                          stats=np.zeros((layers, heads, 4)), head_maps=empty, head_attention=empty,
                          layer_maps=np.zeros((layers, visual)), group_maps=np.zeros((len(kept), visual)),
                          group_uniform=np.zeros((len(kept), visual)),
                          groups=[Group(i, (i, i + 1), [i], k, [], []) for i, k in enumerate(kept)])


def test_the_edit_diff_names_changed_heads_and_kept_tokens():
    before = view([[0, 1, 2], [0]], [["sink", "optimal"], ["", "dispersed"]])
    after = view([[0, 2, 3], [3]], [["optimal", "optimal"], ["sink", "dispersed"]])
    diff = EditDiff.of(before, after, ("purple", "black"))
    assert diff.classes == [(0, 0, "sink", "optimal")] and diff.scored_heads == 3  # layer 1 head 0 unscored before
    assert diff.kept == [({0, 2}, {1}, {3}), (set(), {0}, {3})]
    assert diff.to_json()["kept"][0] == {"group": 0, "both": 2, "only_original": [1], "only_edited": [3]}
    text = diff.text()
    assert "**purple**" in text and "**black**" in text and "1 of the 3 heads" in text and "no saved ground truth" in text
    figure = diff.figure()
    marks = [t for t in figure.data if t.type == "scatter"]
    assert [list(t.customdata) for t in marks] == [[3], [1], [3], [0]]


def test_a_crop_that_changes_the_grid_shows_the_kept_tokens_side_by_side():
    """On Qwen2-VL a crop changes the token grid (12 x 10 -> 8 x 8): token 100 covers different patches in the two
    runs (row 10 of the original, row 12 of an 8-row grid), so the kept tokens are never intersected by index: each
    run's are shown over its own image and grid, and the text and JSON say so."""
    before = view([[5, 100, 119]], [["optimal", "sink"]], grid=(12, 10))
    after = view([[3, 60]], [["optimal", "optimal"]], grid=(8, 8))
    diff = EditDiff.of(before, after, ("red", "red"))
    assert diff.kept is None and diff.classes == [(0, 1, "sink", "optimal")]
    report = diff.to_json()
    assert report["kept"] is None and report["grids"] == {"original": [12, 10], "edited": [8, 8]}
    assert report["kept_by_run"] == [{"group": 0, "original": [5, 100, 119], "edited": [3, 60]}]
    text = diff.text()
    assert "changed the token grid (12 x 10 tokens on the original, 8 x 8 on the edited image" in text
    assert "side by side, not compared" in text and "3 of 120 tokens kept on the original, 2 of 64" in text
    assert "kept tokens in both runs" not in text and "only on the edited" not in text
    figure = diff.figure()
    assert not [t for t in figure.data if t.type == "scatter"]  # no + / x marker, none off an image
    masks = [np.asarray(t.z) for t in figure.data if t.type == "heatmap"]
    assert [m.shape for m in masks] == [(12, 10), (8, 8)]
    assert sorted(np.flatnonzero(masks[0])) == [5, 100, 119] and sorted(np.flatnonzero(masks[1])) == [3, 60]
    assert (tuple(figure.layout.yaxis.range), tuple(figure.layout.yaxis2.range)) == ((11.5, -0.5), (7.5, -0.5))
