"""The ``mlaconv`` command line: a thin Typer layer over the library."""

from __future__ import annotations

import logging
import os
import warnings

import typer

from mlaconv.cli._common import JsonErrorGroup

app = typer.Typer(
    name="mlaconv",
    cls=JsonErrorGroup,
    help="Convert MHA/GQA checkpoints (Llama, Mistral, Qwen2/3, Phi-3/4, Granite, SmolLM3 and kin) into native "
         "DeepSeek-V3 MLA checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
inspect_app = typer.Typer(help="Look at a model before converting it.", no_args_is_help=True)
eval_app = typer.Typer(help="Measure a model, side by side with its source.", no_args_is_help=True)
app.add_typer(inspect_app, name="inspect")
app.add_typer(eval_app, name="eval")


def _print_version(value: bool) -> None:
    if value:
        from mlaconv import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                       callback=_print_version)) -> None:
    del version  # _print_version answers it


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torch's OpenMP threads spin while waiting: on 2 busy cores a 1B-shaped weights-only conversion took 170 s
    # that way and 45 s with passive waiting, writing the same bytes (issue 16). Set before torch is imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    app()


def _register_commands() -> None:
    """Import the sub-command modules; each registers itself on the apps above."""
    import importlib

    for name in ("convert", "inspect", "evaluate", "bench", "export"):
        importlib.import_module(f"mlaconv.cli.{name}")


_register_commands()
