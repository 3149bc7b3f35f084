"""The model the app tests drive: the shipped `assets/tiny-llava`, or a random stand-in of its shape."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tiny_models import tiny_llava

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = "assets/tiny-llava"


def default_model(tmp_dir: Path) -> str:
    """The shipped model's repo-relative name when it exists, else a random 6-layer tiny LLaVA saved in `tmp_dir`.

    The stand-in is a local folder, which the app loads only with HAP_APP_ALLOW_LOCAL=1: set here for
    the demos these tests build (the shipped model is always allowed).
    """
    if (ROOT / SHIPPED / "config.json").is_file():
        return SHIPPED
    os.environ["HAP_APP_ALLOW_LOCAL"] = "1"
    model, processor = tiny_llava(layers=6)
    model.save_pretrained(tmp_dir)
    processor.save_pretrained(tmp_dir)
    return str(tmp_dir)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
