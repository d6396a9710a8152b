"""Extract the Jargon File 4.4.7 (public domain) from Debian ``dict-jargon`` 4.4.7-3.1 as plain text for
``tools/general_text.py``: its entries in order, each as its head word and its text (dedented, cross-reference
braces removed), only those of at least 400 characters (the lexicon's prose, not its one-line glosses).

    apt-get download dict-jargon && dpkg -x dict-jargon_4.4.7-3.1_all.deb x_dict-jargon
    python tools/jargon_file.py x_dict-jargon/usr/share/dictd/jargon.dict.dz RAW/expository_jargon_file.txt
"""

from __future__ import annotations

import argparse
import gzip
import re
import textwrap
from pathlib import Path

MIN_TEXT = 400


def entries(dictionary: str) -> list[str]:
    """The lexicon's entries after the database's own header entries, as ``head word\\n\\ntext``."""
    body = dictionary[dictionary.index("\n(TM)\n") + 1:]
    out = []
    for entry in re.split(r"\n(?=\S)", body):
        head, *lines = entry.strip("\n").split("\n")
        # a pronunciation line (/.../, short) under the head word is dropped
        kept = [line for line in lines if not re.fullmatch(r"\s*/.*/.*", line) or len(line) > 60]
        text = textwrap.dedent("\n".join(kept)).replace("{", "").replace("}", "").strip()
        text = re.sub(r"\n{3,}", "\n\n", text)
        if len(text) >= MIN_TEXT:
            out.append(f"{head.strip()}\n\n{text}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dictionary", type=Path, help="jargon.dict.dz")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    text = "\n\n".join(entries(gzip.open(args.dictionary, "rt", encoding="utf-8").read())) + "\n"
    args.out.write_text(text, encoding="utf-8")
    print(args.out, len(text))


if __name__ == "__main__":
    main()
