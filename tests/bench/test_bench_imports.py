"""Every name a bench script imports from mlaconv exists: the benches run rarely, so a moved module shows here."""

from __future__ import annotations

import ast
import importlib

from helpers import ROOT


def mlaconv_imports() -> list[tuple[str, str, str]]:
    """(script, module, name) for every ``from mlaconv… import name`` in bench/, at any depth of a script."""
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlaconv":
                found += [(str(path.relative_to(ROOT)), node.module, alias.name) for alias in node.names]
    return found


def test_bench_scripts_import_what_mlaconv_has():
    imports = mlaconv_imports()
    assert len({script for script, _, _ in imports}) > 10  # the walk sees the scripts
    missing = []
    for script, module, name in imports:
        try:
            imported = importlib.import_module(module)
        except ImportError:
            missing.append(f"{script}: {module}")
            continue
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{script}: {module}.{name}")
    assert missing == []
