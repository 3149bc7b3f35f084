"""The knob defaults the README states are `hap.knobs`' defaults (a stale README is a wrong manual)."""

import re
from pathlib import Path

from hap.knobs import KNOBS

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = {k.name: k.default for k in KNOBS}


def _defaults_paragraph() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("`HAPConfig` fields are the knobs")
    return text[start:text.index("defaults are the winners", start)]


def test_the_readme_states_the_knob_defaults():
    text = _defaults_paragraph()
    stated = {m[1]: m[2] for m in re.finditer(r"`(\w+)=([\w.]+)`", text) if m[1] in DEFAULTS}
    lists = {m[1]: m[2] for m in re.finditer(r"`(\w+)` \(`(\w+)` \|", text) if m[1] in DEFAULTS}  # first = default
    assert len(stated) >= 6 and len(lists) >= 5, (stated, lists)
    for name, value in stated.items():
        assert DEFAULTS[name] == type(DEFAULTS[name])(value), name
    for name, value in lists.items():
        assert DEFAULTS[name] == value, name
    methods = re.search(r"`method` \(([^)]*)\)", text)[1]
    assert re.findall(r"`(\w+)`", methods) == list(next(k for k in KNOBS if k.name == "method").choices)
    assert DEFAULTS["method"] == "hap"
