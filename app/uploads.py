"""Which files a request may name: files in gradio's upload cache and the shipped examples, nothing else.

The handlers take the raw request (`preprocess=False`, app/layout.py). gradio checks that a FileData dict's path lies
in its upload cache only when the dict carries `meta: {"_type": "gradio.FileData"}`; a dict without it (a plain
upload or an editor value's background or composite) reaches the handler as sent, so a raw POST could name any file
on the server. `allowed_path` checks every path itself: resolved (symlinks and `..` followed), it must be a regular
file inside the upload cache (GRADIO_TEMP_DIR, else <tmp>/gradio) or `assets/examples`. Every refusal has the one
message REFUSED, whatever the path names (an image, another file, a folder, nothing), so an answer never tells what
exists on the server.
"""

from __future__ import annotations

from pathlib import Path

from gradio.utils import get_upload_folder

from hap.runs.inputs import FORMATS

from .settings import EXAMPLES

REFUSED = (f"the image must be a file uploaded to this server or one of its examples ({FORMATS}; gradio_client: "
           "handle_file(path))")


def file_data(path: Path) -> dict:
    """A shipped file as the page sends an upload: gradio's FileData dict of `path`."""
    return {"path": str(path), "orig_name": path.name, "meta": {"_type": "gradio.FileData"}}


def allowed_roots() -> tuple[Path, ...]:
    """The folders a request's file may lie in, resolved: gradio's upload cache and the shipped examples."""
    return Path(get_upload_folder()).resolve(), EXAMPLES.resolve()


def allowed_path(path: object) -> str:
    """`path` resolved, when it names a regular file inside `allowed_roots()`; else ValueError(REFUSED)."""
    if not isinstance(path, str) or not path:
        raise ValueError(REFUSED)
    try:
        resolved = Path(path).resolve()
        inside = any(resolved.is_relative_to(root) for root in allowed_roots()) and resolved.is_file()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte, a name too long
        inside = False
    if not inside:
        raise ValueError(REFUSED)
    return str(resolved)
