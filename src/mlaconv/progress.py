"""The progress callback the library takes: wrap an iterable, describe it, give its length.

``no_progress`` is the silent default; ``LineProgress`` writes plain lines for logs (a redirected
stderr, CI, nohup); the CLI draws rich bars instead when stderr is a terminal.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")
Progress = Callable[[Iterable[T], str, int], Iterator[T]]


def no_progress(items: Iterable[T], description: str, total: int) -> Iterator[T]:  # noqa: ARG001
    """The silent default."""
    yield from items


class LineProgress:
    """Progress as plain lines, each written and flushed at once, for a stream that is not a terminal.

    Per stage: a line when it starts, after its first and its last item, and in between at most one
    line every ``interval`` seconds: ``HH:MM:SS stage i/N (p%), elapsed m:ss, ~m:ss left``.
    """

    def __init__(self, stream: TextIO, interval: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.stream, self.interval, self.clock = stream, interval, clock

    def __call__(self, items: Iterable[T], description: str, total: int) -> Iterator[T]:
        started = last = self.clock()
        self.message(f"{description} 0/{total}")
        done = 0
        for item in items:
            yield item
            done += 1
            now = self.clock()
            if done in (1, total) or now - last >= self.interval:
                last = now
                elapsed = now - started
                if done >= total:
                    self.message(f"{description} {done}/{total} done in {_duration(elapsed)}")
                else:
                    left = elapsed / done * (total - done)
                    self.message(f"{description} {done}/{total} ({done / total:.0%}), elapsed {_duration(elapsed)}, "
                                 f"~{_duration(left)} left")

    def message(self, text: str) -> None:
        """One timestamped line, flushed."""
        self.stream.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
