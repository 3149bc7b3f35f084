"""Shared test set-up: offline, quiet, one torch thread (see the README's 'Tests and layout')."""
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def uploads(tmp_path, monkeypatch):
    """`tmp_path` as gradio's upload cache (GRADIO_TEMP_DIR): the one folder, with the examples, whose files the app
    takes (app/uploads.py)."""
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    return tmp_path
