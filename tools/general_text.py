"""Compose ``src/mlaconv/data/general.txt``, the calibration text ``convert`` uses when given none.

Inputs (``--raw DIR``): the public-domain and PSF-licensed texts named in ``src/mlaconv/data/general.md``, extracted
from the Debian and PyPI packages listed there (the Jargon File's entries by ``tools/jargon_file.py``). Each source contributes its first ``SHARE`` bytes (cut at a blank
line); the sources are interleaved in blocks of about ``BLOCK`` bytes, so that any calibration window holds several
kinds of text (narrative, dialogue, code, expository).

    python tools/general_text.py --raw /work/texts/shipped_raw
"""

from __future__ import annotations

import argparse
from pathlib import Path

BLOCK = 6000
SOURCES = {  # file in --raw → bytes it contributes
    "narrative_persuasion.txt": 60_000,
    "narrative_alice_in_wonderland.txt": 40_000,
    "dialogue_adventures_of_sherlock_holmes.txt": 60_000,
    "dialogue_as_you_like_it.txt": 40_000,
    "code_python_stdlib.txt": 100_000,
    "expository_python_tutorial.txt": 100_000,
    "expository_jargon_file.txt": 100_000,
}
OUT = Path(__file__).resolve().parent.parent / "src" / "mlaconv" / "data" / "general.txt"


def blocks(text: str, share: int, block: int) -> list[str]:
    """The first ``share`` characters of ``text`` in pieces of about ``block``, each ending at a blank line."""
    pieces, start = [], 0
    while start < min(share, len(text)):
        end = text.find("\n\n", start + block)
        end = len(text) if end < 0 else end + 2
        pieces.append(text[start:end].strip("\n"))
        start = end
    return pieces


def compose(raw: Path) -> str:
    queues = [blocks(raw.joinpath(name).read_text(encoding="utf-8"), share, BLOCK * share // 100_000)
              for name, share in SOURCES.items()]
    out = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return "\n\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.write_text(compose(args.raw), encoding="utf-8")
    print(args.out, args.out.stat().st_size)


if __name__ == "__main__":
    main()
