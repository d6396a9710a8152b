"""What every sub-command shares: consoles, progress, the ``--json`` contract and error handling.

With ``--json`` stdout carries exactly one JSON object: the report, or on any failure
``{"error": "<one line>", "kind": "input" | "usage" | "interrupted" | "internal"}``. The one-line
``error:`` message still goes to stderr and the exit status is 1 for bad input, 2 for a bad command
line or an unexpected failure (a bug), 130 when interrupted.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, TypeVar

import typer
from rich import progress as rich_progress
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from mlaconv.errors import MlaconvError
from mlaconv.progress import LineProgress, Progress, no_progress

T = TypeVar("T")
# click's base error, whether typer uses click itself or (newer typer) its own copy of it.
CLICK_ERROR = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException")
# Reports written to a file or a pipe are laid out this wide: never wrapped, no cell cut short.
PLAIN_WIDTH = 100_000


def is_terminal(stream) -> bool:
    """Whether ``stream`` really is a terminal (FORCE_COLOR, common in CI, does not make a log one)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def console(stderr: bool = False) -> Console:
    """A console on stdout or stderr as they are now: the terminal's width there, unlimited elsewhere."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if is_terminal(stream) else Console(stderr=stderr, width=PLAIN_WIDTH)


def report_console(json_out: bool) -> Console:
    """Where the human-readable report goes: stdout normally, stderr when stdout carries JSON."""
    return console(stderr=json_out)


def line(target: Console, text: str) -> None:
    """One report line (rich markup) that is never wrapped by rich: a terminal folds it, a log keeps it whole."""
    target.print(text, highlight=False, soft_wrap=True)


@contextmanager
def progress(quiet: bool) -> Iterator[Progress]:
    """The library's progress callback: rich bars on a terminal, plain timed lines on a redirected stderr
    (CI, nohup, ``2> log``), nothing with ``--quiet``."""
    if quiet:
        yield no_progress
    elif not is_terminal(sys.stderr):
        yield LineProgress(sys.stderr)
    else:
        columns = (rich_progress.TextColumn("{task.description}"), rich_progress.BarColumn(),
                   rich_progress.MofNCompleteColumn(), rich_progress.TimeElapsedColumn(),
                   rich_progress.TimeRemainingColumn())
        with rich_progress.Progress(*columns, console=console(stderr=True), transient=True) as bars:

            def track(items: Iterable[T], description: str, total: int) -> Iterator[T]:
                task = bars.add_task(description, total=total)
                try:
                    for item in items:
                        yield item
                        bars.advance(task)
                finally:
                    bars.remove_task(task)

            yield track


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


def fail(message: str, kind: str, code: int, json_out: bool) -> typer.Exit:
    """Print the one-line error on stderr (and the JSON error object on stdout with --json); the Exit to raise."""
    line(console(stderr=True), f"[bold red]error:[/] {escape(message)}" if kind != "interrupted"
         else f"[bold red]interrupted[/]: {escape(message)}")
    if json_out:
        emit_json({"error": message, "kind": kind})
    return typer.Exit(code)


@contextmanager
def handle_errors(debug: bool, json_out: bool = False) -> Iterator[None]:
    """Turn failures into one line on stderr (plus the JSON error object with ``--json``) and a non-zero
    exit; ``--debug`` keeps the traceback.

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
            raise fail(_one_line(exc), "input", 1, json_out) from None
        except KeyboardInterrupt:
            raise fail("nothing was written to the output", "interrupted", 130, json_out) from None
        except Exception as exc:  # a bug, not bad input: still one line unless --debug
            if debug:
                traceback.print_exc()
            message = f"unexpected {type(exc).__name__}: {_one_line(exc, first_only=True)}"
            raise fail(f"{message} (rerun with --debug for the traceback)", "internal", 2, json_out) from None


def _one_line(message: object, first_only: bool = False) -> str:
    lines = [text.strip() for text in str(message).splitlines() if text.strip()]
    return (lines[0] if lines else "") if first_only else " ".join(lines)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001 - showwarning
    console(stderr=True).print(f"[yellow]warning:[/] {escape(_one_line(message))}", highlight=False, soft_wrap=True)


class JsonErrorGroup(TyperGroup):
    """The root command: a command line click refuses (unknown option, missing argument, bad value) gets
    click's usual message and exit status 2, plus the JSON error object when ``--json`` is on it."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        given = {"prog_name": prog_name, "complete_var": complete_var, **extra}
        if not standalone_mode or "--json" not in args:
            return super().main(args, standalone_mode=standalone_mode, **given)
        try:
            code = super().main(args, standalone_mode=False, **given)
        except CLICK_ERROR as exc:
            exc.show()
            emit_json({"error": _one_line(exc.format_message()), "kind": "usage"})
            sys.exit(exc.exit_code)
        except typer.Abort:
            sys.exit(fail("aborted", "interrupted", 130, json_out=True).exit_code)
        sys.exit(code or 0)


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout (the report goes to stderr); on "
                                                 "failure {\"error\": …, \"kind\": …}.")
DEBUG_OPTION = typer.Option(False, "--debug", help="Show the full traceback on errors.")
QUIET_OPTION = typer.Option(False, "--quiet", "-q", help="No progress output (warnings, errors and the report still "
                                                         "print).")
