"""``mlaconv convert SRC OUT``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from mlaconv.cli import app
from mlaconv.cli._common import (DEBUG_OPTION, JSON_OPTION, QUIET_OPTION, emit_json, handle_errors, line, progress,
                                 report_console)
from mlaconv.conversion.options import cli_parameters, with_options
from mlaconv.report import ConversionReport
from mlaconv.report.record import Failure


@app.command()
@with_options(cli_parameters())
def convert(
    src: Optional[str] = typer.Argument(None, help="Source model: a local folder or a Hugging Face hub id (from the local cache). With --recipe and one argument, the recipe's source is used and the argument is OUT."),
    out: Optional[Path] = typer.Argument(None, help="Output folder (written atomically)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="A recipes/*.yaml file of settings; explicit flags override it."),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
    **flags,
) -> None:
    """Convert an MHA/GQA checkpoint into a native DeepSeek-V3 MLA checkpoint.

    --json prints the report (also OUT/mlaconv.json); its keys are listed in docs/report.md ("convert").
    """
    with handle_errors(debug, json_out):
        from mlaconv.conversion.run import convert as run_convert
        from mlaconv.errors import MlaconvError
        from mlaconv.conversion.options import ConvertOptions, given_options

        settings = given_options(flags)
        options = ConvertOptions.from_recipe(recipe, **settings) if recipe is not None else ConvertOptions(**settings)
        if options.recipe is not None:
            if out is None and src is not None:  # one positional argument with a recipe: it is OUT
                src, out = None, Path(src)
            src = src or options.recipe.source
        if src is None or out is None:
            raise MlaconvError("give SRC and OUT (SRC may come from --recipe)")
        with progress(quiet) as track:
            report = run_convert(src, out, options, progress=track)
        render_report(report, report_console(json_out))
        if json_out:
            emit_json(report.to_json())


def render_report(report: ConversionReport, console) -> None:
    kv = report.kv_elements_per_token_per_layer
    line(console, f"[bold green]converted[/] {escape(report.source)} → {escape(report.output)}  "
                  f"({report.architecture} → DeepseekV3ForCausalLM, {report.dtype})")
    line(console, f"KV cache per token and layer: {kv.source} → {kv.converted} elements "
                  f"({report.kv_keep:.1%} kept; r = {report.kv_lora_rank}, R = {report.qk_rope_head_dim}, "
                  f"rope stride {report.rope_stride}); {escape(report.shape_choice)}")
    if report.shape_search and report.shape_search.candidates:
        line(console, "splits measured: " + ", ".join(
            f"{c.kv_lora_rank} + {c.qk_rope_head_dim}: {c.mean_attention_error:.4f}" for c in report.shape_search.candidates
        ) + " (mean attention error)")
    if report.calibration_data:
        line(console, f"calibration data: {escape(report.calibration_data)}")
    calibration = report.calibration
    table = Table(title="per layer" + (", measured on the audit windows" if calibration else ""), show_lines=False)
    columns = ["layer", "latent energy", "RoPE energy kept", "key error", "value error"]
    for column in columns + (["attention error", "variant"] if calibration else []):
        table.add_column(column, justify="left" if column == "variant" else "right", overflow="fold")
    energy = report.energy_retained.per_layer
    for i, values in enumerate(zip(energy, report.rope_energy_kept, report.key_error, report.value_error)):
        cells = [f"{v:.4f}" for v in values]
        if calibration:
            cells += [f"{report.attention_error[i]:.4f}", report.layer_variant[i]]
        table.add_row(str(i), *cells)
    table.add_row("mean", f"{report.energy_retained.mean:.4f}", f"{report.rope_energy_kept_mean:.4f}",
                  *([""] * (len(table.columns) - 3)))
    console.print(table)
    if calibration:
        steps = ""
        if calibration.refine_steps:
            at = f", each error at {calibration.refine_queries} positions a window" if calibration.refine_queries else ""
            drawn = f" drawn from {calibration.refine_windows} fit windows" if calibration.refine_windows else ""
            steps = f" ({calibration.refine_steps} steps of {calibration.refine_batch} windows a layer{drawn}{at})"
        sets = calibration.window_sets
        line(console, f"calibration: {calibration.windows} windows of {calibration.window} tokens "
                      f"({len(sets.fit)} fit, {len(sets.select)} select, {len(sets.audit)} audit); refinement: "
                      f"{escape(calibration.refinement)}{steps}")
        if sets.note:
            line(console, f"[yellow]note:[/] {escape(sets.note)}")
        whole = calibration.whole_model
        models = "; ".join(f"{name} KL {figures.kl:.4g}, top-1 {figures.top1:.2%}"
                           for name, figures in (("closed form", whole.closed_form), ("refined", whole.refined))
                           if figures)
        line(console, f"whole model on the {whole.windows} audit windows ({whole.tokens} tokens): {models}; "
                      f"written: {whole.written} ({escape(whole.reason)})")
    if isinstance(report.heal, Failure):
        line(console, f"[yellow]heal:[/] {escape(report.heal.error)} (the converted model was kept, unhealed)")
    elif report.heal is not None:
        from mlaconv.cli.heal import render_healing

        render_healing(report.heal, console)
    _render_checks(report, console)
    target = report.target
    line(console, f"target {target.name}: {', '.join(target.engines)}")
    for note in (target.note, (target.rope_rewrite or {}).get("note")):
        if note:
            line(console, f"[yellow]note:[/] {escape(note)}")
    for warning in report.serving.warnings:
        line(console, f"[yellow]note:[/] {escape(warning)}")


def _render_checks(report: ConversionReport, console) -> None:
    """The built-in check's and the evaluation's lines."""
    check = report.verify
    if isinstance(check, Failure):
        line(console, f"[yellow]check:[/] {escape(check.error)} (the checkpoint was kept)")
    elif check and check.skipped is None:
        line(console, f"check ({check.loader}, {check.windows}×{check.tokens // check.windows} tokens, "
                      f"{check.dtype}): max |Δlogit| {check.max_abs_logit_diff:.3g}, KL {check.kl:.3g}, "
                      f"top-1 {check.top1:.2%}")
        for name, figures in (check.engines or {}).items():
            if "kl" in figures:
                line(console, f"  as {name} computes it: KL {figures['kl']:.3g}, top-1 {figures['top1']:.2%} "
                              f"({escape('; '.join(figures['differences']))})")
            elif "refused" in figures:
                line(console, f"  {name}: refuses it ({escape(figures['refused'])})")
            elif "same_as" in figures:
                line(console, f"  {name}: same as {figures['same_as']}")
            if "shape_refused" in figures:
                line(console, f"  {name}: [yellow]will not run it[/]: {escape(figures['shape_refused'])}")
    elif check:
        line(console, f"check skipped: {escape(check.skipped)}")
    result = report.eval
    if isinstance(result, Failure):
        line(console, f"[yellow]eval:[/] {escape(result.error)} (the checkpoint was kept)")
    elif result:
        agreement = (f", KL {result.kl_per_token:.3g}, top-1 {result.top1_agreement:.2%}"
                     if result.kl_per_token is not None else " (KL and top-1 not measured: the two models "
                     "did not fit in memory together)")
        line(console, f"eval ({escape(result.data)}, {result.windows} windows of {result.window}): KV cache "
                      f"{report.kv_keep:.1%} of the source's; PPL {result.ppl:.4g} vs source "
                      f"{result.baseline_ppl:.4g} (drift {result.drift:+.2%}){agreement}")
    retrieval = report.retrieval
    if isinstance(retrieval, Failure):
        line(console, f"[yellow]retrieval:[/] {escape(retrieval.error)} (the checkpoint was kept)")
    elif retrieval:
        line(console, "passkey retrieval (source → converted): " + ", ".join(
            f"{length.length:,} tokens {length.baseline_accuracy:.0%} → {length.accuracy:.0%}"
            for length in retrieval.lengths))
    verdict = report.verdict
    if verdict is not None:
        colour = {"close": "green", "degraded": "yellow", "broken": "bold red"}.get(verdict.level, "yellow")
        line(console, f"[{colour}]verdict:[/] {escape(verdict.message)}")
