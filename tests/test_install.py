"""`pip install .` gives a working CLI outside the checkout: the package ships everything the CLI draws,
and imports nothing from `analysis` or `app` (built offline into a temporary --target folder)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hap.views import VIEWS
from tiny_models import noise_image, tiny_llava

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A folder holding only the installed `hap` package (built from a copy of the sources)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(ROOT / "hap", src / "hap", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)], check=True)
    return site


def outside(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_package_imports_nothing_from_analysis_or_app(installed, tmp_path):
    code = ("import sys, hap, hap.__main__, hap.views, hap.runs.compare; print(hap.__file__); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'analysis', 'app'}))")
    out = outside(installed, tmp_path, "-c", code)
    assert out.returncode == 0, out.stderr
    where, upward = out.stdout.splitlines()
    assert Path(where).is_relative_to(installed) and upward == "[]"


def test_the_installed_cli_writes_the_json_and_every_view(installed, tmp_path):
    model, processor = tiny_llava(layers=6, kv_heads=None)
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    noise_image(5).save(tmp_path / "scene.png")
    out = outside(installed, tmp_path, "-m", "hap", "run", "--image", "scene.png", "--prompt", "what is red ?",
                  "--model", str(tmp_path / "model"), "--json", "out.json", "--figures", "figures",
                  "--max-new-tokens", "2")
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["num_layers"] == 6 and data["config"]["first_layers"] == 0 and data["target_retain"] == 0.25
    pngs = sorted(p.stem for p in (tmp_path / "figures").glob("*.png"))
    assert pngs == sorted(v.name for v in VIEWS) and len(pngs) >= 5
