"""app.deploy: the Space's file set keeps the Hub's rules, holds what the app needs and nothing else, and the app
starts from exactly that set in a fresh folder; the upload is one commit that adds the set and deletes the rest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from gradio_client import Client, handle_file

from app import deploy
from app.deploy import SpaceFile, check_hub_rules, space_files
from app_model import ROOT, free_port

MB = 1_000_000


def test_the_file_set_keeps_the_hubs_rules_and_holds_only_what_the_space_needs():
    files = space_files()
    paths = {f.path for f in files}
    assert check_hub_rules(files) == []
    assert {"README.md", "requirements.txt", ".gitattributes", "app/app.py", "hap/__init__.py",
            "assets/tiny-llava/model.safetensors", "assets/examples/scene_600000.png"} <= paths
    for path in paths:
        assert not path.startswith((".venv/", "results/", "tests/", ".ci/", "analysis/training/", "runs/")), path
    assert "app/gpu_check.py" not in paths and not any(p.endswith(".pyc") for p in paths)
    model = next(f for f in files if f.path == "assets/tiny-llava/model.safetensors")
    assert model.binary and model.lfs and model.size > deploy.BINARY_LIMIT
    assert all(f.lfs for f in files if f.binary), [f.path for f in files if f.binary and not f.lfs]



def test_the_rules_refuse_a_large_binary_or_any_huge_file_outside_large_file_storage():
    files = [SpaceFile("a.bin", 2 * MB, True, False), SpaceFile("b.bin", 2 * MB, True, True),
             SpaceFile("small.bin", MB // 2, True, False), SpaceFile("big.txt", 11 * MB, False, False),
             SpaceFile("ok.txt", 9 * MB, False, False), SpaceFile("huge.safetensors", 11 * MB, True, True)]
    problems = check_hub_rules(files)
    assert [p.split(":")[0] for p in problems] == ["a.bin", "big.txt"]
    assert "binary file of 2,000,000 bytes" in problems[0] and "filter=lfs" in problems[0]


def test_gitattributes_patterns_follow_gits_rules(tmp_path):
    (tmp_path / ".gitattributes").write_text("# comment\n*.png filter=lfs diff=lfs merge=lfs -text\n"
                                             "docs/*.pdf filter=lfs -text\n*.md text\n")
    patterns = deploy.lfs_patterns(tmp_path)
    assert patterns == ["*.png", "docs/*.pdf"]
    assert deploy._lfs("assets/examples/a.png", patterns)  # no slash: the name in any folder
    assert deploy._lfs("docs/x.pdf", patterns) and not deploy._lfs("other/x.pdf", patterns)
    assert not deploy._lfs("README.md", patterns)


def test_the_dry_run_lists_every_file_and_uploads_nothing(capsys, monkeypatch):
    monkeypatch.setattr(deploy, "publish", lambda *a, **k: pytest.fail("a dry run must not upload"))
    assert deploy.main(["someone/hap", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    files = space_files()
    assert len(out) == len(files) + 1 and out[-1].startswith(f"{len(files)} files, ")
    assert any(line.split()[1:] == ["lfs", "assets/tiny-llava/model.safetensors"] for line in out)


@pytest.mark.parametrize("space_id", ["hap", "a/b/c", "/hap", "me/"])
def test_a_malformed_space_id_is_refused_by_name(space_id, capsys):
    with pytest.raises(SystemExit):
        deploy.main([space_id, "--dry-run"])
    assert "USER/SPACE must be an owner and a name" in capsys.readouterr().err


def test_publish_is_one_commit_adding_the_set_and_deleting_what_the_space_holds_outside_it():
    calls = {}

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            calls["create"] = (repo_id, kw)

        def list_repo_files(self, repo_id, repo_type):
            return [".gitattributes", "README.md", "old/stale.py", "results/x.json"]

        def create_commit(self, repo_id, operations, repo_type, commit_message):
            calls["commit"] = (repo_id, operations, repo_type)
            return SimpleNamespace(commit_url="https://example.invalid/commit/1")

    files = [SpaceFile("README.md", 10, False, False), SpaceFile(".gitattributes", 10, False, False),
             SpaceFile("assets/tiny-llava/model.safetensors", 8 * MB, True, True)]
    url = deploy.publish(FakeApi(), "me/hap", files, private=True)
    assert url.endswith("/commit/1")
    assert calls["create"] == ("me/hap", dict(repo_type="space", space_sdk="gradio", private=True, exist_ok=True))
    repo_id, operations, repo_type = calls["commit"]
    assert (repo_id, repo_type) == ("me/hap", "space")
    added = [op.path_in_repo for op in operations if type(op).__name__ == "CommitOperationAdd"]
    deleted = [op.path_in_repo for op in operations if type(op).__name__ == "CommitOperationDelete"]
    assert added == [f.path for f in files] and deleted == ["old/stale.py", "results/x.json"]
    model = next(op for op in operations if op.path_in_repo.endswith(".safetensors"))
    assert Path(model.path_or_fileobj) == ROOT / "assets/tiny-llava/model.safetensors"


def _wait_for(url: str, proc: subprocess.Popen, seconds: float) -> Client:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the app exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            return Client(url, verbose=False)
        except Exception:  # not serving yet
            time.sleep(1)
    raise AssertionError(f"the app did not serve {url} within {seconds} s")


@pytest.mark.slow
def test_the_app_starts_from_exactly_the_file_set_and_answers(tmp_path):
    """Copy the set into a fresh folder (no .git, no tests, no results), start `python -m app` there as a Space
    would, and call /analyze on a shipped scene."""
    space = tmp_path / "space"
    for f in space_files():
        (space / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f.path, space / f.path)
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=space, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        client = _wait_for(f"http://127.0.0.1:{port}/", proc, 120)
        from app.present import OUTPUTS

        out = dict(zip(OUTPUTS, client.predict(image=handle_file(str(space / "assets/examples/scene_600000.png")),
                                               prompt="what color is the square ?", model_name="assets/tiny-llava",
                                               api_name="/analyze")))
        assert out["summary"]["answer"] == "yellow", out["summary"]
    finally:
        proc.terminate()
        proc.wait(30)
