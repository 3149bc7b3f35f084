"""The tree stays small and readable: size guards on what git tracks, the README's length and first commands,
and the layout rule that `analysis/` (the statistics and figures) never imports the app."""

from __future__ import annotations

import ast
import re

from app.deploy import tracked_files
from app_model import ROOT

MB = 1_000_000
FILES = {p: (ROOT / p).stat().st_size for p in tracked_files(ROOT)}


def test_no_tracked_file_is_over_10_mb():
    assert [p for p, size in FILES.items() if size > 10 * MB] == []


def test_results_stay_under_5_mb_and_the_tree_under_25_mb():
    results = sum(size for p, size in FILES.items() if p.startswith("results/"))
    assert results <= 5 * MB, f"results/ holds {results:,} bytes"
    assert sum(FILES.values()) <= 25 * MB, f"the tracked tree holds {sum(FILES.values()):,} bytes"


def test_the_readme_is_at_most_250_lines_with_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert blocks and [line.split("#")[0].strip() for line in blocks[0].strip().splitlines()] == [
        "bash run.sh app", "bash run.sh test"]
    status = text[text.index("## Status"):]
    status = status[:status.index("\n## ", 1)] if "\n## " in status[1:] else status
    assert len(status.strip().splitlines()) <= 16  # the heading and at most 15 lines


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_of_analysis_imports_the_app():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "analysis").rglob("*.py") if "app" in _imports(p)]
    assert offenders == []


def test_hap_and_the_app_never_import_the_training_code():
    for folder in ("hap", "app"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "gpu_check.py":  # borrows tiny_vlm's offline tokenizer for its random models
                continue
            text = path.read_text()
            assert "analysis.training" not in text, path
