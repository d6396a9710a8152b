"""Text overlap by word shingles: do two texts share a run of ``n`` words (13 by default)?

A 13-word shingle is the unit of the usual contamination checks (GPT-3's 13-gram overlap): words are
runs of letters, digits and underscores, compared lower-cased, so punctuation, spacing and case do not
hide a copy. ``drop_overlapping`` removes the documents of one text that share any shingle with another,
including shingles that straddle two documents once they are joined.

    from bench.models.overlap import drop_overlapping, shared_shingles
    kept, dropped = drop_overlapping(calib_docs, eval_text)
    assert not shared_shingles(join(kept), eval_text)
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SHINGLE = 13
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive words of ``text``."""
    tokens = words(text)
    return {tuple(tokens[k : k + n]) for k in range(len(tokens) - n + 1)}


def shared_shingles(a: str, b: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    """The ``n``-word runs that occur in both texts (empty: they share none)."""
    return shingles(a, n) & shingles(b, n)


def drop_overlapping(docs: Sequence[str], reference: str, n: int = SHINGLE) -> tuple[list[str], list[int]]:
    """``docs`` without every document that shares an ``n``-word run with ``reference``; and the dropped indices.

    The documents are read as one word stream (as they are when joined), so a run that crosses from one
    document into the next drops both; dropping makes new neighbours, so this repeats until nothing matches.
    """
    banned = shingles(reference, n)
    kept = list(range(len(docs)))
    doc_words = [words(doc) for doc in docs]
    while True:
        stream = [(w, k) for k in kept for w in doc_words[k]]  # word, index of its document
        hit = {owner for start in range(len(stream) - n + 1)
               if tuple(w for w, _ in stream[start : start + n]) in banned
               for _, owner in stream[start : start + n]}
        if not hit:
            return [docs[k] for k in kept], sorted(set(range(len(docs))) - set(kept))
        kept = [k for k in kept if k not in hit]
