"""The maps' image sent once per response, not once per panel.

Every map of a run is drawn over the same image (`hap.views.panels_plotly`: each panel a layout image under its
token map, the dimmed patches drawn over it), and a figure carries it as a data URI. A response holds a dozen such
figures, so the page would receive the image a few dozen times. `serve_images` writes each distinct image once to a
file that gradio serves (its upload folder) and points every panel at that file's URL, which the browser fetches
once and caches; the figures keep everything else. The URL is relative to the page (`gradio_api/file=<path>`), so an
API client prefixes the server's address to fetch it (docs/app.md).

The result shown on arrival (`app.arrival`) is drawn once and shown to every visitor: its images are `pinned` (written
while `pinning`), kept out of the KEEP most recent ones' eviction and written again by `restore` if they went missing.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from contextlib import contextmanager
from pathlib import Path
from uuid import uuid4

from gradio.utils import get_upload_folder

FOLDER = "hap-views"  # under gradio's upload folder
KEEP = 256  # images kept on disk (the least recently written removed first): the last runs' figures stay drawable
PREFIX = "data:image/jpeg;base64,"
PINNED: dict[Path, bytes] = {}  # files never evicted (the arrival's), with their bytes
_RECORDING = threading.local()  # this thread's `pinning` block, if any: the files it writes or names


@contextmanager
def pinning():
    """A block whose served images (in this thread) are pinned: never evicted, written again by `restore`."""
    _RECORDING.paths = paths = []
    try:
        yield
    finally:
        _RECORDING.paths = None
        PINNED.update((path, path.read_bytes()) for path in paths if path.is_file())


def restore() -> None:
    """Write again every pinned image that is no longer on disk."""
    for path, data in list(PINNED.items()):
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def serve_images(outputs: dict[str, object]) -> dict[str, object]:
    """`outputs` with every plotly figure's data-URI layout images replaced, in place, by the URL of a file holding
    that image, written once per distinct image."""
    for value in outputs.values():
        serve_figure(value)
    return outputs


def serve_figure(figure):
    """`figure` (a plotly figure, else returned as is) with its data-URI layout images served (`serve_images`)."""
    import plotly.graph_objects as go

    if isinstance(figure, go.Figure):
        for image in figure.layout.images:
            if isinstance(image.source, str) and image.source.startswith(PREFIX):
                image.source = image_url(image.source)
    return figure


def image_url(uri: str) -> str:
    """The page-relative URL of a file holding the JPEG of the data URI `uri`, named by its hash (written once)."""
    folder = Path(get_upload_folder()) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(uri.encode()).hexdigest()[:32]}.jpg"
    if not path.is_file():
        partial = path.with_name(f"{path.stem}.{uuid4().hex}.part")  # requests may write the same image at once
        partial.write_bytes(base64.b64decode(uri[len(PREFIX):]))
        partial.replace(path)
        unpinned = [p for p in folder.glob("*.jpg") if p not in PINNED]
        for old in sorted(unpinned, key=lambda p: p.stat().st_mtime)[:-KEEP]:
            old.unlink(missing_ok=True)
    if getattr(_RECORDING, "paths", None) is not None:
        _RECORDING.paths.append(path)
    return f"gradio_api/file={path.resolve()}"
