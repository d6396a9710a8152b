"""Render the tables of the bench READMEs and of the project's README from the result files.

Every block of those READMEs between ``<!-- table: NAME -->`` and ``<!-- /table -->`` is the rendering of
``bench/results/NAME.json`` (``bench.lib.results.render``): where and how it was measured, then the table.

    python -m bench.tables            # rewrite the blocks of README.md and every bench/**/README.md
    python -m bench.tables --check    # exit 1 if a block differs from its result file (nothing written)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bench.lib import REPO, RESULTS
from bench.lib.results import read_result, render

BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.DOTALL)


def readmes() -> list[Path]:
    """The files whose table blocks are rendered: the project's README ("What to expect") and the bench READMEs."""
    return [REPO / "README.md"] + sorted((REPO / "bench").glob("README.md")) + sorted((REPO / "bench").glob("*/README.md"))


def rendered(text: str) -> str:
    """``text`` with every table block rendered afresh from its result file."""
    return BLOCK.sub(lambda m: f"{m.group(1)}{render(read_result(m.group('name')))}\n{m.group(4)}", text)


def shown() -> set[str]:
    """The result files some README renders."""
    return {m.group("name") for path in readmes() for m in BLOCK.finditer(path.read_text(encoding="utf-8"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report READMEs whose tables are out of date")
    args = parser.parse_args()
    stale = []
    for path in readmes():
        text = path.read_text(encoding="utf-8")
        new = rendered(text)
        if new != text:
            stale.append(path.relative_to(REPO))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    tables = sorted(p.stem for p in RESULTS.glob("*.json") if "columns" in read_result(p.stem))
    if unshown := [name for name in tables if name not in shown()]:
        print("result files with a table no README shows: " + ", ".join(unshown), file=sys.stderr)
    if args.check and stale:
        sys.exit("out of date (python -m bench.tables): " + ", ".join(map(str, stale)))
    for path in stale:
        print(f"rendered {path}")


if __name__ == "__main__":
    main()
