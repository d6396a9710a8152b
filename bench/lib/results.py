"""Bench results as data: one JSON file per bench run under ``bench/results/``, and its Markdown table.

A result file holds::

    {"bench": "fidelity",                     # the bench folder it belongs to (bench/fidelity/)
     "title": "…",                            # optional: what the table shows, one line
     "commit": "14aad92",                     # the code that measured it
     "machine": "2-core x86_64 CPU, …",       # what it ran on
     "load": "load average 3–15 …",           # what else ran (wall times on a shared machine depend on it)
     "command": "python -m bench.fidelity.run …",
     "columns": [["drift", "{drift:+.1%}"], …],  # the table: a title and a str.format template over a row
     "rows": [{"model": "llama-docs", "drift": 0.006, …}, …],
     "notes": "…"}

``python -m bench.tables`` renders every ``<!-- table: NAME -->`` block of the bench READMEs from
``bench/results/NAME.json``. This module imports no torch (``bench.conversion.memory``'s driver stays small).
"""

from __future__ import annotations

import json
import os
import platform
import string
import subprocess
import sys
from pathlib import Path

from bench.lib import REPO, RESULTS

MISSING = "—"  # a cell whose row lacks a value: not measured


def _load() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


LOAD_AT_START = _load()  # when the bench imported this module, i.e. about when it started


def commit() -> str:
    """The checkout's short commit, ``-dirty`` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                      else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(device: str | None = None) -> str:
    """What ran it, in words: cores, architecture, the CPU's model, the device, torch's version when loaded.

    The model matters: this project's 2-core machines have been of more than one CPU model, and one source
    forward pass took 85 s on one and about 200 s on another.
    """
    torch = sys.modules.get("torch")
    words = f"{os.cpu_count()}-core {platform.machine()} {device or 'CPU'}"
    model = cpu_model()
    words += f" ({model})" if model else ""
    return words + (f", torch {torch.__version__}" if torch is not None else "")


def cpu_model() -> str | None:
    """The CPU's model name as the kernel reports it (Linux), else the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip() or None
    except OSError:
        pass
    return platform.processor() or None


class _Row(string.Formatter):
    def get_value(self, key, args, kwargs):
        value = kwargs.get(key) if isinstance(key, str) else args[key]
        if value is None:
            raise LookupError(key)
        return value


def cell(template: str, row: dict) -> str:
    """``template`` formatted with ``row``; ``MISSING`` where a value it names is absent or null."""
    try:
        return _Row().format(template, **row).replace("|", "\\|")
    except LookupError:
        return MISSING


def markdown_table(columns: list[list[str]], rows: list[dict]) -> str:
    """A Markdown table: one column per ``[title, template]``, one line per row."""
    lines = ["| " + " | ".join(title.replace("|", "\\|") for title, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(template, row) for _, template in columns) + " |" for row in rows]
    return "\n".join(lines)


def render(result: dict) -> str:
    """A result file as Markdown: where and how it was measured, then its table."""
    head = f"*{result['bench']}, commit {result['commit']}; {result['machine']}; {result['load']}.*"
    if result.get("title"):
        head = f"**{result['title']}** " + head
    parts = [head, "", f"    {result['command']}", "", markdown_table(result["columns"], result["rows"])]
    if result.get("notes"):
        parts += ["", result["notes"]]
    return "\n".join(parts)


def read_result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def load_span() -> str:
    """The load average when the bench started and now, in words (what else ran beside it)."""
    return f"load average {LOAD_AT_START} at the start, {_load()} at the end"


def write_result(name: str, bench: str, rows: list[dict], columns: list[list[str]], notes: str = "",
                 title: str = "", device: str | None = None) -> Path:
    """Write ``bench/results/NAME.json`` for this run (this commit, this machine, the load then, this command)."""
    result = {"bench": bench, "title": title, "commit": commit(), "machine": machine(device),
              "load": load_span(),
              "command": " ".join(["python -m", sys.modules["__main__"].__spec__.name, *sys.argv[1:]])
              if getattr(sys.modules["__main__"], "__spec__", None) else " ".join(["python", *sys.argv]),
              "columns": columns, "rows": rows, "notes": notes}
    return write_json(name, result)


def write_json(name: str, result: dict) -> Path:
    """Write ``result`` to ``bench/results/NAME.json`` and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
