"""Compose ``src/mlaconv/data/general.txt``, the calibration text ``convert`` uses when given none.

Inputs (``--raw DIR``): the public-domain and PSF-licensed texts named in ``src/mlaconv/data/general.md``, extracted
from the Debian and PyPI packages listed there (the Jargon File's entries by ``tools/jargon_file.py``). Each source
contributes its first ``SOURCES[name]`` characters (cut at a blank line); the sources are interleaved in blocks of
about ``BLOCK`` × that share / 100,000 characters, so that any calibration window holds several kinds of text
(narrative, dialogue, code, expository).

    python tools/general_text.py --raw /work/texts/shipped_raw

``--unpack DIR`` writes each source's share back out of the shipped text (the inverse of composing, checked by
composing it again), so that a source can be added without extracting the others anew.
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


def block_size(share: int) -> int:
    """A source's block, in proportion to its share (``BLOCK`` for a share of 100,000)."""
    return BLOCK * share // 100_000


def compose(raw: Path) -> str:
    queues = [blocks(raw.joinpath(name).read_text(encoding="utf-8"), share, block_size(share))
              for name, share in SOURCES.items()]
    out = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return "\n\n".join(out) + "\n"


def unpack(text: str, raw: Path) -> None:
    """Write into ``raw`` the share of each source that ``compose`` interleaved into ``text``."""
    body, pieces, taken = text.removesuffix("\n"), {name: [] for name in SOURCES}, dict.fromkeys(SOURCES, 0)
    start = 0
    while start < len(body):
        for name, share in SOURCES.items():
            if start >= len(body) or taken[name] >= share:
                continue
            end = body.find("\n\n", start + block_size(share))
            end = len(body) if end < 0 else end
            pieces[name].append(body[start:end])
            taken[name] += end + 2 - start
            start = end + 2
    raw.mkdir(parents=True, exist_ok=True)
    for name, parts in pieces.items():
        raw.joinpath(name).write_text("\n\n".join(parts), encoding="utf-8")
    if compose(raw) != text:
        raise SystemExit(f"{raw}: the unpacked sources do not compose the text again (SOURCES changed since?)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--raw", type=Path, help="compose the text from the sources in this folder")
    group.add_argument("--unpack", type=Path, help="write the shipped text's sources into this folder")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.unpack:
        unpack(args.out.read_text(encoding="utf-8"), args.unpack)
        print(args.unpack, sorted(p.name for p in args.unpack.iterdir()))
        return
    args.out.write_text(compose(args.raw), encoding="utf-8")
    print(args.out, args.out.stat().st_size)


if __name__ == "__main__":
    main()
