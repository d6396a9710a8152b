"""``mlaconv heal OUT --source SRC``."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from mlaconv.cli import app
from mlaconv.cli._common import (DEBUG_OPTION, JSON_OPTION, QUIET_OPTION, emit_json, handle_errors, line, progress,
                                 report_console)
from mlaconv.heal.distill import CHECK_EVERY, CPU_SECONDS, CPU_TOKENS, CUDA_TOKENS, DEFAULT_BATCH, DEFAULT_LR, \
    DEFAULT_SCHEDULE, DEFAULT_TOP_K, DEFAULT_WINDOW, POSITION_SPAN, WRITTEN_TOKENS
from mlaconv.report.conversion import HealReport


@app.command()
def heal(
    model: Path = typer.Argument(..., help="A folder `mlaconv convert` wrote."),
    source: str = typer.Option(..., "--source", help="The model it was converted from (a folder or a cached hub id)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the healed model here (default: MODEL itself, "
                                                           "which needs --force)."),
    calib: List[str] = typer.Option([], "--calib", help="Text file (or .jsonl of token ids) to heal on; repeatable "
                                                        "(default: mlaconv's bundled general text)."),
    calib_dataset: Optional[str] = typer.Option(None, "--calib-dataset", help="… or a Hugging Face dataset "
                                                                              "NAME[:CONFIG[:SPLIT]] (local cache)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help=f"Training tokens (default: on a GPU {CUDA_TOKENS:,}; "
                                         f"on a CPU as many as a model of its size takes in {CPU_SECONDS // 60} "
                                         f"minutes on 2 cores, at most {CPU_TOKENS:,})."),
    window: int = typer.Option(DEFAULT_WINDOW, "--window", help="Tokens per training window."),
    batch: int = typer.Option(DEFAULT_BATCH, "--batch", help="Windows per step."),
    lr: float = typer.Option(DEFAULT_LR, "--lr", help="Adam's step relative to each row's RMS."),
    lr_schedule: str = typer.Option(DEFAULT_SCHEDULE, "--lr-schedule", help="constant, or linear: Adam's step "
                                                                          "falls linearly from --lr to 0."),
    top_k: int = typer.Option(DEFAULT_TOP_K, "--top-k", help="Source log-probabilities kept per position."),
    written: Optional[int] = typer.Option(None, "--written", help="Also train on this many tokens of text the "
                                          f"source writes itself (sampled from it, seeded; default {WRITTEN_TOKENS:,}, "
                                          "at most as many as the calibration tokens trained on; 0: none)."),
    position_span: Optional[int] = typer.Option(None, "--position-span", help="Place each training window at "
                                                "positions spread over this many, in two chunks with a seeded skip "
                                                "between (PoSE), so short windows train long distances "
                                                f"(default {POSITION_SPAN:,}, or the model's context where "
                                                "shorter; 0: none)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="What the forward passes multiply in: float32, "
                                            "or bfloat16 (the trained tensors stay float32; default bfloat16 where "
                                            "the device computes it natively, else float32)."),
    check_every: int = typer.Option(CHECK_EVERY, "--check-every", help="Steps between measurements on the select "
                                                                       "windows (the best is kept)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when torch sees a GPU)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT (or MODEL itself) if it exists."),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
) -> None:
    """Heal a converted model: train its new attention tensors end to end towards the source's next-token
    distributions (KL), everything else frozen; written atomically, with the report, check and card updated.

    --json prints the heal report; its keys are listed in docs/report.md ("convert.heal").
    """
    with handle_errors(debug, json_out):
        from mlaconv.errors import MlaconvError
        from mlaconv.heal import HealOptions, heal as run_heal
        from mlaconv.devices import check_device, default_device
        from mlaconv.conversion.options import ConvertOptions
        from mlaconv.conversion.plan import calibration_data
        from mlaconv.source.spec import load_source

        check_device(device)
        if not model.is_dir():
            raise MlaconvError(f"no such folder: {model}")
        source_folder, _, reader = load_source(source)
        reader.close()
        data = calibration_data(source_folder, ConvertOptions(calib=list(calib), calib_dataset=calib_dataset))
        if data is None:
            raise MlaconvError(f"{source} has no tokenizer to read the bundled text with: give --calib FILE.jsonl")
        options = HealOptions(tokens=tokens, window=window, batch=batch, lr=lr, schedule=lr_schedule, top_k=top_k,
                              check_every=check_every, device=device or default_device(), written_tokens=written,
                              position_span=position_span, precision=precision)
        with progress(quiet) as track:
            report = run_heal(model, source, out or model, data, options, force=force, progress=track)
        render_report(report, report_console(json_out))
        if json_out:
            emit_json(report.to_json())


def render_report(report: HealReport, console) -> None:
    render_healing(report, console)
    if report.verdict is not None:
        colour = {"close": "green", "degraded": "yellow", "broken": "bold red"}.get(report.verdict.level, "yellow")
        line(console, f"[{colour}]verdict:[/] {escape(report.verdict.message)}")


def render_healing(report: HealReport, console) -> None:
    """What healing did and measured (also a part of ``convert --heal-tokens``' report)."""
    before, after = report.held_out_before, report.held_out_after
    line(console, f"[bold green]healed[/] on {escape(report.calibration_data)}: {report.tokens:,} tokens in "
                  f"{report.steps} steps of {report.batch} × {report.window} (best step {report.best_step}), "
                  f"{report.seconds / 60:.1f} min (estimated {report.estimated_seconds / 60:.1f})")
    line(console, f"healing's held-out windows ({after.tokens:,} predictions): drift {before.drift:+.2%} → "
                  f"{after.drift:+.2%}, KL {before.kl:.4g} → {after.kl:.4g}, top-1 {before.top1:.2%} → {after.top1:.2%}")
    line(console, f"tiny latent: max mean(c²)/ε {report.latent_bound:.3g} over all tokens (proven bound)"
                  + (f"; rescaled in layers {report.rescaled_layers}" if report.rescaled_layers else ""))
    for note in report.notes:
        line(console, f"[yellow]note:[/] {escape(note)}")
