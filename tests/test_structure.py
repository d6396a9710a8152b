"""The code's shape, as issue 15 fixed it: no import cycle, no module over 400 lines, one pass over the source's layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src"
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def runtime_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The mlaconv modules ``path`` imports at run time (lazy imports included; ``if TYPE_CHECKING:`` blocks not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
               for child in block.body for node in ast.walk(child)}
    imported = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                imported.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {name for name in imported if name in known}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    known = modules()
    graph = {name: {m for m in runtime_imports(path, known) if m != name and not name.startswith(m + ".")}
             for name, path in known.items()}
    assert "mlaconv.plan" in graph["mlaconv.conversion"]  # the graph is real
    assert cycles(graph) == []


def test_no_module_over_400_lines():
    long = {str(path.relative_to(SRC)): n for path in SRC.rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_one_pass_over_the_source_layers():
    """Only ``pipeline.source_layers`` iterates over a source's layers; every step plugs into it."""
    loop = re.compile(r"range\([\w.]*spec\.num_layers\)")
    looping = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if loop.search(path.read_text(encoding="utf-8")))
    assert looping == ["mlaconv/pipeline.py"]
