"""The core's shape (docs/method.md "Layout"): imports in `hap/` flow one way, the head lab and each method's module are
imported only from inside them, and no module outside `hap/pruners/` names a method in code.

Imports are read from the source (module level, inside functions and under TYPE_CHECKING alike: a type is a
dependency); `from P import x` depends on the module P.x where there is one, else on P.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hap.methods import BUILT_IN, NONE

ROOT = Path(__file__).resolve().parents[1] / "hap"
ENTRY_POINTS = {"hap", "hap.__main__"}  # the public facade (`hap.plant`) and the CLI (`--plant`): nothing imports them


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(module: str) -> set[str]:
    """The modules of `hap` that `module` imports anywhere in its source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


GRAPH = {module: imports(module) for module in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_hap():
    assert circles(GRAPH) == []


def test_the_graph_reads_imports_inside_functions_and_type_checking():
    assert "hap.config" in GRAPH["hap.pruners.base"]  # under TYPE_CHECKING only
    assert "hap.patch.processors" in GRAPH["hap.load"]  # inside a function only


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_only_the_lab_imports_the_lab():
    outside = {m: sorted(d for d in deps if inside(d, "hap.lab"))
               for m, deps in GRAPH.items() if not inside(m, "hap.lab") and m not in ENTRY_POINTS}
    assert {m: d for m, d in outside.items() if d} == {}


def test_no_method_module_is_imported_from_outside_the_pruners():
    methods = {f"hap.pruners.{name}" for name in BUILT_IN}
    assert methods <= set(MODULES)
    outside = {m: sorted(deps & methods) for m, deps in GRAPH.items() if not inside(m, "hap.pruners")}
    assert {m: d for m, d in outside.items() if d} == {}


def named_methods(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each string constant in code (docstrings aside) equal to a built-in method's name. `none` is
    left out: it is also the off value of other knobs (merge="none")."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    names = set(BUILT_IN) - {NONE}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings]


def test_the_method_name_finder_finds_a_comparison(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('"""hap"""\ndef f(config):\n    """autoprune"""\n    return config.method == "autoprune"\n')
    assert named_methods(source) == [(4, "autoprune")]


@pytest.mark.parametrize("module", [m for m in MODULES if not inside(m, "hap.pruners") and m != "hap.methods"])
def test_no_method_is_named_outside_the_pruners(module):
    assert named_methods(MODULES[module]) == []
