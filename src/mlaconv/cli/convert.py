"""``mlaconv convert SRC OUT``."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional, TypeVar

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from mlaconv.cli import app
from mlaconv.cli._common import DEBUG_OPTION, JSON_OPTION, emit_json, handle_errors, report_console, stderr

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


@app.command()
def convert(
    src: str = typer.Argument(..., help="Source model: a local folder or a Hugging Face hub id (from the local cache)."),
    out: Path = typer.Argument(..., help="Output folder (written atomically)."),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Latent rank r (kv_lora_rank)."),
    kv_keep: Optional[float] = typer.Option(None, "--kv-keep", help="Fraction of the source KV cache to keep, in (0, 1]; picks r and R."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", help="Shared RoPE key dims R (qk_rope_head_dim); default min(64, head_dim)."),
    rope_stride: Optional[int] = typer.Option(None, "--rope-stride", help="Keep source frequencies 0, s, 2s, … (default: chosen from the weights)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Output dtype: float32 or bfloat16 (default: the source's)."),
    shard_size: str = typer.Option("5GB", "--shard-size", help="Largest output shard, e.g. 5GB or 500MB."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Compare OUT with the source through AutoModelForCausalLM."),
    verify_windows: int = typer.Option(4, "--verify-windows", help="Windows the built-in check runs."),
    verify_window: int = typer.Option(128, "--verify-window", help="Tokens per check window."),
    allow_sliding_window: bool = typer.Option(False, "--allow-sliding-window", help="Convert a sliding-window model with full attention."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision when SRC is a hub id."),
    json_out: bool = JSON_OPTION,
    debug: bool = DEBUG_OPTION,
) -> None:
    """Convert an MHA/GQA checkpoint into a native DeepSeek-V3 MLA checkpoint."""
    with handle_errors(debug):
        from mlaconv.convert import ConvertOptions, convert as run_convert
        from mlaconv.io import parse_size

        options = ConvertOptions(
            rank=rank, kv_keep=kv_keep, rope_dim=rope_dim, rope_stride=rope_stride, dtype=dtype,
            shard_size=parse_size(shard_size), force=force, verify=verify, verify_windows=verify_windows,
            verify_window=verify_window, allow_sliding_window=allow_sliding_window, revision=revision,
        )
        with rich_progress() as track:
            report = run_convert(src, out, options, progress=track)
        render_report(report, report_console(json_out))
        if json_out:
            emit_json(report)


def render_report(report: dict, console) -> None:
    kv = report["kv_elements_per_token_per_layer"]
    console.print(
        f"[bold green]converted[/] {report['source']} → {report['output']}  "
        f"({report['architecture']} → DeepseekV3ForCausalLM, {report['dtype']})", highlight=False
    )
    console.print(
        f"KV cache per token and layer: {kv['source']} → {kv['converted']} elements "
        f"({report['kv_keep']:.1%} kept; r = {report['kv_lora_rank']}, R = {report['qk_rope_head_dim']}, "
        f"rope stride {report['rope_stride']}); {report['shape_choice']}", highlight=False
    )
    table = Table(title="per layer", show_lines=False)
    for column in ("layer", "latent energy", "RoPE energy kept", "key error", "value error"):
        table.add_column(column, justify="right")
    energy = report["energy_retained"]["per_layer"]
    for i, values in enumerate(zip(energy, report["rope_energy_kept"], report["key_error"], report["value_error"])):
        table.add_row(str(i), *(f"{v:.4f}" for v in values))
    table.add_row("mean", f"{report['energy_retained']['mean']:.4f}", f"{report['rope_energy_kept_mean']:.4f}", "", "")
    console.print(table)
    check = report.get("verify")
    if check and "skipped" not in check:
        console.print(
            f"check ({check['loader']}, {check['windows']}×{check['tokens'] // check['windows']} tokens, {check['dtype']}): "
            f"max |Δlogit| {check['max_abs_logit_diff']:.3g}, KL {check['kl']:.3g}, top-1 {check['top1']:.2%}",
            highlight=False,
        )
        if "biases_dropped" in check:
            dropped = check["biases_dropped"]
            console.print(f"  without attention biases (vLLM/SGLang): KL {dropped['kl']:.3g}, top-1 {dropped['top1']:.2%}",
                          highlight=False)
    elif check:
        console.print(f"check skipped: {check['skipped']}", highlight=False)
    for warning in report["serving"]["warnings"]:
        console.print(f"[yellow]note:[/] {warning}", highlight=False)
