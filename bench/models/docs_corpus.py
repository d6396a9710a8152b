"""The bench models' text corpus, split into train, calibration and evaluation parts.

Corpus (everything ships with Python or an installed package, nothing is downloaded): the
``pydoc_data.topics`` reference pages, and the docstrings (module, class, function; at least
``MIN_DOC_CHARS`` long, exact duplicates dropped) of every ``.py`` file of the standard library and of
the installed ``numpy`` and ``pandas``, read with ``ast`` (no module is imported), test folders
excluded. A *unit* is one source file or one pydoc topic; sha256 of its name puts it in train
(94%), calibration (3%) or evaluation (3%), so the three parts never share a unit or a docstring.

``held_out_texts`` makes ``calib.txt`` and ``eval.txt`` of those held-out parts (``bench/models/train.py`` writes them
beside each model; ``bench/models/make_example.py`` cuts the bundled example's texts from the same parts).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import platform
import sysconfig
from pathlib import Path

from bench.models.overlap import SHINGLE, drop_overlapping, shared_shingles

PACKAGES = ("numpy", "pandas")
EXCLUDED_DIRS = {"test", "tests", "testing", "idle_test", "site-packages", "__pycache__"}
MIN_DOC_CHARS = 40
SPLITS = {"calib": range(0, 3), "eval": range(3, 6)}  # sha256 bucket (mod 100); the rest is train


def _docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one Python file, in ``ast.walk`` order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return [doc for doc in docs if doc and len(doc) >= MIN_DOC_CHARS]


def corpus_units() -> dict[str, list[str]]:
    """Unit name → its documents, in a fixed order; each distinct document appears once, in its first unit."""
    import pydoc_data.topics

    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    for name in PACKAGES:
        roots[name] = Path(importlib.util.find_spec(name).origin).parent
    units: dict[str, list[str]] = {}
    seen: set[str] = set()

    def add(unit: str, docs: list[str]) -> None:
        fresh = [doc for doc in docs if doc not in seen]
        seen.update(fresh)
        if fresh:
            units[unit] = fresh

    for topic in sorted(pydoc_data.topics.topics):
        add(f"pydoc:{topic}", [pydoc_data.topics.topics[topic].strip()])
    for label, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if not EXCLUDED_DIRS & set(rel.parts):
                add(f"{label}:{rel.as_posix()}", _docstrings(path))
    return units


def split_of(unit: str) -> str:
    bucket = int(hashlib.sha256(unit.encode()).hexdigest()[:8], 16) % 100
    return next((name for name, buckets in SPLITS.items() if bucket in buckets), "train")


def build_corpus() -> tuple[dict[str, list[str]], dict]:
    """Documents per split (train / calib / eval) and a manifest that pins down exactly what they are."""
    parts: dict[str, list[str]] = {"train": [], "calib": [], "eval": []}
    held_out: dict[str, list[str]] = {"calib": [], "eval": []}
    for unit, docs in corpus_units().items():
        split = split_of(unit)
        parts[split].extend(docs)
        if split in held_out:
            held_out[split].append(unit)
    manifest = {
        "python": platform.python_version(),
        "packages": {name: importlib.metadata.version(name) for name in PACKAGES},
        "sources": ["pydoc_data.topics", "stdlib docstrings", *(f"{name} docstrings" for name in PACKAGES)],
        "min_doc_chars": MIN_DOC_CHARS,
        "split_rule": "sha256(unit name) mod 100: 0-2 calib, 3-5 eval, else train; a unit is a file or a pydoc topic",
        "parts": {
            name: {"documents": len(docs), "chars": sum(map(len, docs)),
                   "sha256": hashlib.sha256(join(docs).encode()).hexdigest()}
            for name, docs in parts.items()
        },
        "held_out_units": held_out,
    }
    return parts, manifest


def join(docs: list[str]) -> str:
    return "\n\n".join(docs) + "\n"


def held_out_texts(parts: dict[str, list[str]]) -> tuple[dict[str, str], dict]:
    """calib.txt and eval.txt: the held-out parts, calibration without every document that shares a
    ``SHINGLE``-word run with the evaluation text; and a record of what was dropped."""
    evaluation = join(parts["eval"])
    calib, dropped = drop_overlapping(parts["calib"], evaluation)
    texts = {"calib": join(calib), "eval": evaluation}
    assert not shared_shingles(texts["calib"], evaluation)
    record = {
        "rule": f"calib.txt = the calib part without its documents that share a {SHINGLE}-word shingle "
                "(lower-cased \\w+ words) with eval.txt, bench/models/overlap.py; eval.txt = the eval part",
        "calib_documents_dropped": len(dropped),
        "calib_chars_dropped": sum(len(parts["calib"][k]) for k in dropped),
        "files": {f"{name}.txt": {"chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}
                  for name, text in texts.items()},
    }
    return texts, record


def write_held_out(out: Path, parts: dict[str, list[str]]) -> dict:
    texts, record = held_out_texts(parts)
    for name, text in texts.items():
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
    return record
