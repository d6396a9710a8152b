"""The ``mlaconv`` command line: a thin Typer layer over the library."""

from __future__ import annotations

import logging
import os
import warnings

# Set before anything imports torch (registering the sub-commands below does): OpenMP reads it once, when torch
# loads it. torch's threads otherwise spin while they wait, and beside other work on the cores a spinning thread
# takes the time its partner needs: a refinement step of the example model took 2-4x longer on 2 threads than on
# one with other jobs on the 2 cores, and about as long as on one with passive waiting (bench/results/conversion-threads.json).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer  # noqa: E402

from mlaconv.cli._common import JsonErrorGroup  # noqa: E402

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
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    app()


def _register_commands() -> None:
    """Import the sub-command modules; each registers itself on the apps above."""
    import importlib

    for name in ("convert", "heal", "inspect", "evaluate", "bench", "export"):
        importlib.import_module(f"mlaconv.cli.{name}")


_register_commands()
