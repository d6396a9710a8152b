"""The progress callback the library takes: wrap an iterable, describe it, give its length."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
Progress = Callable[[Iterable[T], str, int], Iterator[T]]


def no_progress(items: Iterable[T], description: str, total: int) -> Iterator[T]:  # noqa: ARG001
    """The silent default."""
    yield from items
