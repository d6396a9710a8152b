"""``mlaconv bench decode``: per-token decode latency of one attention layer, source cache vs MLA latent cache."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mlaconv.cli import app
from mlaconv.cli._common import (DEBUG_OPTION, JSON_OPTION, QUIET_OPTION, emit_json, handle_errors, line, progress,
                                 report_console)
from mlaconv.errors import MlaconvError

COLUMNS = ["source", "dtype", "ctx", "cache MB a→c", "(a) ms", "(b) ms", "(c) ms", "(c′) ms", "c/a", "ideal",
           "c/a÷ideal", "core c/a", "core÷ideal"]
LEGEND = ("(a) source K/V cache + SDPA; (b) MLA, K/V rebuilt from the latent each step (transformers); (c) MLA absorbed "
          "on the latent cache (mlaconv.target.absorb weights); (c′) the same attention, W^UK/W^UV applied per head at "
          "run time; cache MB = cache bytes read per decoded token; ideal = cache bytes (a) / (c); core = attention over "
          "the cache only (no projections), (a) vs (c)")

bench_app = typer.Typer(help="Measure decode speed.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _names(text: str, allowed, what: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise MlaconvError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(allowed)}")
    return names


def _contexts(text: str) -> tuple[int, ...]:
    contexts = []
    for part in (p.strip().upper() for p in text.split(",") if p.strip()):
        try:
            value = int(part[:-1]) * 1024 if part.endswith("K") else int(part)
        except ValueError:
            raise MlaconvError(f"cannot read the context {part!r} (try 1K,4K,16K or 1024)") from None
        if value < 1:
            raise MlaconvError(f"a context must be ≥ 1 token, got {part}")
        contexts.append(value)
    if not contexts:
        raise MlaconvError("give at least one context")
    return tuple(contexts)


@bench_app.command("decode")
def decode(
    contexts: str = typer.Option("1K,4K,16K,32K", "--contexts", help="Context lengths, e.g. 1K,4K,16K,32K."),
    shapes: str = typer.Option("llama2-7b,llama3-8b", "--shapes", help="Source layer shapes: llama2-7b (MHA), llama3-8b (GQA)."),
    dtypes: str = typer.Option("float32,bfloat16", "--dtypes", help="float32 and/or bfloat16."),
    devices: Optional[str] = typer.Option(None, "--devices", help="cpu and/or cuda (default: cpu, plus cuda when present)."),
    repeats: int = typer.Option(5, "--repeats", help="Timed steps per measurement (the median is reported)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed steps first."),
    cold: bool = typer.Option(True, "--cold/--warm", help="Flush the last-level cache before every timed step."),
    clock: str = typer.Option("wall", "--clock", help="wall (the latency a user sees) or cpu (this process's CPU "
                              "time: with --threads 1, a shared machine's best estimate of an idle core)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads (default: all cores)."),
    expanded: bool = typer.Option(True, "--expanded/--no-expanded", help="Also time (b), MLA with K/V rebuilt from the latent (slow)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and caches."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the table as Markdown (for bench/engines/README.md)."),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
) -> None:
    """Per-token decode latency of one 7B-shaped attention layer: (a) source K/V cache, (b) MLA expanded,
    (c) MLA absorbed on the latent cache, (c′) the same with W^UK/W^UV applied per head at run time."""
    with handle_errors(debug, json_out):
        import torch

        from mlaconv.runtime.bench import SHAPES, TIMED_DTYPES, BenchOptions, run_decode_bench

        device_names = _names(devices, ("cpu", "cuda"), "device") if devices else None
        if device_names and "cuda" in device_names and not torch.cuda.is_available():
            raise MlaconvError("--devices cuda: no CUDA device is available")
        if repeats < 1 or warmup < 0:
            raise MlaconvError("--repeats must be ≥ 1 and --warmup ≥ 0")
        if clock not in ("wall", "cpu"):
            raise MlaconvError(f"--clock must be wall or cpu, got {clock!r}")
        if threads is not None and threads < 1:
            raise MlaconvError(f"--threads must be ≥ 1, got {threads}")
        options = BenchOptions(contexts=_contexts(contexts), shapes=_names(shapes, tuple(SHAPES), "shape"),
                               dtypes=_names(dtypes, tuple(TIMED_DTYPES), "dtype"), devices=device_names,
                               repeats=repeats, warmup=warmup, cold=cold, clock=clock, threads=threads, expanded=expanded,
                               seed=seed)
        with progress(quiet) as track:
            result = run_decode_bench(options, progress=track)
        console = report_console(json_out)
        if markdown:
            console.print(render_markdown(result), highlight=False, markup=False, soft_wrap=True)
        else:
            render(result, console)
        if json_out:
            emit_json(result)


def render(result: dict, console: Console) -> None:
    """The environment line, the table and its legend."""
    env = result["environment"]
    line(console, escape(_environment_line(env)))
    devices = env["devices"]
    table = Table(title=f"decode step of one attention layer, batch 1, {'/'.join(devices)} (ms)")
    columns = COLUMNS[:2] + ["dev"] + COLUMNS[2:] if len(devices) > 1 else COLUMNS
    for column in columns:
        table.add_column(column, justify="right", overflow="fold")
    for row in result["rows"]:
        table.add_row(*_cells(row, with_device=len(devices) > 1))
    console.print(table)
    line(console, escape(LEGEND))


def render_markdown(result: dict) -> str:
    """The same table as Markdown, with the environment line above it."""
    env = result["environment"]
    with_device = len(env["devices"]) > 1
    columns = COLUMNS[:2] + ["dev"] + COLUMNS[2:] if with_device else COLUMNS
    lines = [_environment_line(env), "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cells(row, with_device)) + " |" for row in result["rows"]]
    return "\n".join(lines + ["", LEGEND])


def _environment_line(env: dict) -> str:
    return (f"torch {env['torch']}, {env['threads']} threads, {env['cpu']}{', ' + env['cuda'] if env['cuda'] else ''}; "
            f"{'cold' if env['cold'] else 'warm'} caches, {env['clock']} clock, median of {env['repeats']} after "
            f"{env['warmup']} warm-up; "
            f"load average {', '.join(f'{x:.1f}' for x in env['load_average'] or [])}")


def _cells(row: dict, with_device: bool) -> list[str]:
    cache, ms = row["cache_bytes_read_per_token"], row["ms"]
    cells = [
        row["label"], row["dtype"], _context_label(row["context"]),
        f"{cache['source'] / 1e6:.1f}→{cache['mla'] / 1e6:.1f}", f"{ms['source']:.2f}",
        f"{ms['expanded']:.1f}" if ms["expanded"] is not None else "–", f"{ms['absorbed']:.2f}",
        f"{ms['factored']:.2f}", f"{row['speedup_absorbed']:.2f}×", f"{row['ideal_speedup']:.2f}×",
        f"{row['fraction_of_ideal']:.0%}", f"{row['core_speedup']:.2f}×", f"{row['core_fraction_of_ideal']:.0%}",
    ]
    if with_device:
        cells.insert(2, row["device"])
    return cells


def _context_label(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)
