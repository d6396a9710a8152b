"""``mlaconv eval perplexity MODEL [--baseline SRC]`` and ``mlaconv eval retrieval MODEL [--baseline SRC]``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from mlaconv.cli import eval_app
from mlaconv.cli._common import (DEBUG_OPTION, JSON_OPTION, QUIET_OPTION, emit_json, handle_errors, line, progress,
                                 report_console)
from mlaconv.io.text import token_counts
from mlaconv.report import EvalReport, RetrievalReport
from mlaconv.report.evaluation import DepthBucket, RetrievalLength


@eval_app.command("perplexity")
def perplexity(
    model: str = typer.Argument(..., help="Model to measure: a local folder or a hub id from the local cache."),
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="Source model to compare with, on the same token ids."),
    text: Optional[Path] = typer.Option(None, "--text", help="A UTF-8 text file, tokenized once as one stream."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="NAME[:CONFIG[:SPLIT]] via `datasets` (local cache offline); "
                                                                   "`wikitext` = WikiText-2 raw test, joined with blank lines."),
    tokens: Optional[Path] = typer.Option(None, "--tokens", help="Pre-tokenized JSON lines {\"input_ids\": [...]}; each line is "
                                                                 "its own sequence, one window if shorter than --window."),
    window: Optional[int] = typer.Option(None, "--window", help="Tokens per window (default 2048, or the models' context if shorter)."),
    max_windows: Optional[int] = typer.Option(None, "--max-windows", help="Score only the first N windows."),
    batch_size: int = typer.Option(1, "--batch-size", help="Windows per forward pass."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16 (both models; float16 is refused when either is an MLA checkpoint)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu (default), cuda, cuda:1, mps …"),
    device_map: Optional[str] = typer.Option(None, "--device-map", help="`auto` spreads each model over this machine's GPUs (accelerate)."),
    engine: str = typer.Option("transformers", "--engine", help="Score MODEL as this engine computes it: transformers, vllm, sglang or llamacpp (its dropped tensors, rope rewrite, ε and softmax scale applied to the transformers forward; refused where the engine would not run it)."),
    position_buckets: Optional[str] = typer.Option(None, "--position-buckets", help="Also report the figures per bucket of positions in the window: boundaries such as 512,2k give [0, 512), [512, 2048), [2048, window)."),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
) -> None:
    """Perplexity as the papers measure it, side by side with the source: drift, KL, top-1 agreement, KV cache.

    --json prints the report; its keys are listed in docs/report.md ("eval").
    """
    with handle_errors(debug, json_out):
        from mlaconv.evaluate.perplexity import evaluate_perplexity
        from mlaconv.io.text import TokenSource

        source = TokenSource(text=text, dataset=dataset, tokens=tokens)
        buckets = None if position_buckets is None else token_counts(position_buckets, "--position-buckets")
        with progress(quiet) as track:
            report = evaluate_perplexity(model, baseline, source=source, window=window, max_windows=max_windows,
                                         batch_size=batch_size, dtype=dtype, device=device, device_map=device_map,
                                         progress=track, engine=engine, position_buckets=buckets)
        render_report(report, report_console(json_out))
        if json_out:
            emit_json(report.to_json())


def render_report(report: EvalReport, console) -> None:
    """The evaluation report as a table (one column per model) and a comparison line."""
    windows, predictions = report.windows, report.tokens
    lengths = (f"× {predictions // windows + 1} tokens" if predictions % windows == 0
               else f"of at most {report.window} tokens")
    line(console, f"{escape(report.data)}: {windows} windows {lengths}, {predictions} predictions scored "
                  f"({report.dropped_tokens} tokens dropped), {report.dtype} on {report.device}")
    line(console, f"tokenizer: {escape(report.tokenizer or 'none (pre-tokenized ids)')}")
    differences = report.engine_differences
    line(console, f"model as {report.engine} computes it"
                  + (f" ({escape('; '.join(differences))})" if differences else
                     " (the same as transformers)" if report.engine != "transformers" else ""))
    columns = {"model": (report.model, report.ppl, report.ppl_stderr, report.nll)}
    if report.baseline:
        columns = {"baseline": (report.baseline, report.baseline_ppl, report.baseline_ppl_stderr,
                                report.baseline_nll)} | columns
    table = Table(title="perplexity")
    table.add_column("", overflow="fold")
    for role, (folder, *_) in columns.items():
        table.add_column(f"{role}\n{escape(folder)}", justify="right", overflow="fold")
    table.add_row("perplexity", *(_with_error(ppl, stderr, "{:.4f}") for _, ppl, stderr, _ in columns.values()))
    table.add_row("mean NLL", *(f"{nll:.5f}" for *_, nll in columns.values()))
    table.add_row("KV cache elements / token", *(f"{report.kv_elements_per_token[r]:,}" for r in columns))
    table.add_row("KV cache bytes / token", *(f"{report.kv_bytes_per_token[r]:,}" for r in columns))
    console.print(table)
    if report.baseline:
        line(console, f"drift {_with_error(report.drift, report.drift_stderr, '{:+.2%}')} in perplexity "
                      f"with {report.kv_kept:.1%} of the KV cache")
        if report.kl_per_token is not None:
            line(console, f"KL(baseline ‖ model) {report.kl_per_token:.4g} per token, "
                          f"top-1 agreement {report.top1_agreement:.2%}")
    if report.by_position:
        console.print(_by_position_table(report))
    for note in report.notes:
        line(console, f"[yellow]note:[/] {escape(note)}")


@eval_app.command("retrieval")
def retrieval(
    model: str = typer.Argument(..., help="Model to measure: a local folder or a hub id from the local cache."),
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="Source model to compare with, on the same prompts (written with its tokenizer)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Prompt lengths in tokens, answer included (k = 1024), none over the models' context (default: those of 1k,2k,4k,8k within it)."),
    trials: int = typer.Option(10, "--trials", help="Prompts per length; trial k of N hides the key at depth (k + 0.5) / N of the filler."),
    seed: int = typer.Option(0, "--seed", help="Seed of the keys."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16 (both models; float16 is refused when either is an MLA checkpoint)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu (default), cuda, cuda:1, mps …"),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
) -> None:
    """Passkey retrieval at several lengths, side by side with the source: a 5-digit key hidden in filler text,
    answered greedily; accuracy per length and per depth of the key.

    --json prints the report; its keys are listed in docs/report.md ("retrieval").
    """
    with handle_errors(debug, json_out):
        from mlaconv.evaluate.retrieval import evaluate_retrieval

        asked = None if lengths is None else token_counts(lengths, "--lengths")
        with progress(quiet) as track:
            report = evaluate_retrieval(model, baseline, lengths=asked, trials=trials, seed=seed, dtype=dtype,
                                        device=device, progress=track)
        render_retrieval(report, report_console(json_out))
        if json_out:
            emit_json(report.to_json())


def render_retrieval(report: RetrievalReport, console) -> None:
    """Right answers per length and depth of the key, one row per model, and the totals."""
    line(console, f"passkey retrieval: {report.trials} prompts per length (keys from seed {report.seed}), greedy "
                  f"answers of {report.new_tokens} tokens, {report.dtype} on {report.device}")
    line(console, f"tokenizer: {escape(report.tokenizer)}")
    roles = {"baseline": report.baseline, "model": report.model} if report.baseline else {"model": report.model}
    table = Table(title="passkey: right answers")
    for header in ("length", "prompt tokens", "", "all depths",
                   *(f"depth {b.start * 100:.0f}–{b.end:.0%}" for b in report.lengths[0].by_depth)):
        table.add_column(header, justify="left" if header == "" else "right", overflow="fold")
    for length in report.lengths:
        for role in roles:
            first = role == next(iter(roles))
            table.add_row(f"{length.length:,}" if first else "",
                          "–".join(f"{n:,}" for n in sorted(set(length.prompt_tokens))) if first else "", role,
                          _right(_accuracy(length, role), report.trials),
                          *(_right(_accuracy(b, role), b.trials) for b in length.by_depth),
                          end_section=role == "model")
    console.print(table)
    total = report.trials * len(report.lengths)
    line(console, "all lengths: " + "; ".join(f"{role} {escape(folder)} {_right(_accuracy(report, role), total)}"
                                              for role, folder in roles.items()))


def _by_position_table(report: EvalReport) -> Table:
    """The figures per bucket of positions in the window."""
    table = Table(title="by position in the window")
    compared = report.baseline is not None
    headers = ["positions", "predictions", *(["baseline PPL"] if compared else []), "PPL",
               *(["drift", "KL / token", "top-1"] if compared else [])]
    for header in headers:
        table.add_column(header, justify="right")
    for b in report.by_position:
        figures = [f"{b.ppl:.4f}"]
        if compared:
            figures = [f"{b.baseline_ppl:.4f}", *figures, _with_error(b.drift, b.drift_stderr, "{:+.2%}"),
                       "—" if b.kl is None else f"{b.kl:.4g}", "—" if b.top1 is None else f"{b.top1:.2%}"]
        table.add_row(f"[{b.start:,}, {b.end:,})", f"{b.predictions:,}", *figures)
    return table


def _accuracy(figures: RetrievalReport | RetrievalLength | DepthBucket, role: str) -> float:
    """The share of right answers of ``role`` ("model" or "baseline") in a report, a length or a depth bucket."""
    return figures.baseline_accuracy if role == "baseline" else figures.accuracy


def _right(accuracy: float, trials: int) -> str:
    """``right/trials (percent)``."""
    return f"{round(accuracy * trials)}/{trials} ({accuracy:.0%})"


def _with_error(value: float, stderr: float | None, fmt: str) -> str:
    return fmt.format(value) if stderr is None else f"{fmt.format(value)} ± {fmt.format(stderr).lstrip('+')}"
