"""What every sub-command shares: consoles, the ``--json`` contract and error handling."""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from mlaconv.errors import MlaconvError

# Progress bars and human-readable reports; stdout stays clean for ``--json``.
stderr = Console(stderr=True)
T = TypeVar("T")


@contextmanager
def rich_progress() -> Iterator:
    """A progress callback for the library: wraps an iterable in a rich bar on stderr."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=stderr, transient=True) as bars:

        def track(items: Iterable[T], description: str, total: int) -> Iterator[T]:
            task = bars.add_task(description, total=total)
            for item in items:
                yield item
                bars.advance(task)
            bars.remove_task(task)

        yield track


def report_console(json_out: bool) -> Console:
    """Where the human-readable report goes: stdout normally, stderr when stdout carries JSON."""
    return stderr if json_out else Console()


def emit_json(obj: dict[str, Any]) -> None:
    """Write exactly one JSON object (one line) to stdout."""
    sys.stdout.write(json.dumps(obj, allow_nan=True, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__fspath__"):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


@contextmanager
def handle_errors(debug: bool) -> Iterator[None]:
    """Turn failures into one line on stderr and a non-zero exit; ``--debug`` keeps the traceback.

    Warnings become one ``warning:`` line each too (the usual file:line dump under ``--debug``).
    """
    with warnings.catch_warnings():
        if not debug:
            warnings.showwarning = _warning_line
        try:
            yield
        except typer.Exit:
            raise
        except MlaconvError as exc:
            if debug:
                traceback.print_exc()
            stderr.print(f"[bold red]error:[/] {escape(_one_line(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            stderr.print("[bold red]interrupted[/]: nothing was written to the output", highlight=False)
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug, not bad input: still one line unless --debug
            if debug:
                traceback.print_exc()
            stderr.print(
                f"[bold red]error:[/] unexpected {type(exc).__name__}: {escape(_one_line(exc, first_only=True))} "
                "(rerun with --debug for the traceback)",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(2) from None


def _one_line(message: object, first_only: bool = False) -> str:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return (lines[0] if lines else "") if first_only else " ".join(lines)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001 - showwarning
    stderr.print(f"[yellow]warning:[/] {escape(_one_line(message))}", highlight=False, soft_wrap=True)


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout (the report goes to stderr).")
DEBUG_OPTION = typer.Option(False, "--debug", help="Show the full traceback on errors.")
