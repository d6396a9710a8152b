"""``mlaconv inspect spectra SRC``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from mlaconv.cli import inspect_app
from mlaconv.cli._common import (DEBUG_OPTION, JSON_OPTION, QUIET_OPTION, emit_json, handle_errors, line, progress,
                                 report_console)
from mlaconv.conversion.options import cli_parameters, given_options, with_options
from mlaconv.errors import MlaconvError
from mlaconv.report import SpectraReport
from mlaconv.report.spectra import SpectraRefinement


@inspect_app.command("spectra")
@with_options(cli_parameters(only_spectra=True))
def spectra(
    src: str = typer.Argument(..., help="Source model: a local folder or a Hugging Face hub id (from the local cache)."),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="Comma-separated latent ranks to report, e.g. 64,128,512 (default: powers of two and the full rank)."),
    energy: str = typer.Option("0.9,0.95,0.99", "--energy", help="Comma-separated energy targets in (0, 1]: the rank each one needs is reported."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the spectra and energy curves (needs the 'plot' extra)."),
    csv_out: Optional[Path] = typer.Option(None, "--csv", help="Write one CSV row per layer."),
    refine: bool = typer.Option(False, "--refine", help="With --calib and --kv-keep: also run convert's per-layer steps (its split, the variant it keeps, its refinement) and report, per layer, the closed form and the refined layer on the audit windows."),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
    **settings,
) -> None:
    """Per layer: how much of K/V the latent keeps at each rank, and how much RoPE energy the shared key keeps.

    The spectrum is that of the matrix convert truncates (the balanced
    [K_nope; V] in the input metric). Weights-only it is exactly what
    convert keeps, and `convert --rank r` reports the same energy. With
    --calib it is the plain calibrated variant at the default split
    (convert also tries other variants and splits on its select windows):
    energy_retained is measured on the audit windows as convert measures
    it, the spectrum is in-sample; "shows" says which. Weights are read one
    layer at a time. --kv-keep adds its recommended rank to the ranks.
    --refine runs convert's own per-layer steps and shows what refinement
    recovers: attention error and rotary figures, closed form vs refined.

    --json prints the report; its keys are listed in docs/report.md
    ("spectra"): "per rank" lists follow ranks, "per target" lists follow
    energy_targets.
    """
    with handle_errors(debug, json_out):
        from mlaconv.inspect.spectra import SpectraOptions, check_output_file, spectra as run_spectra, write_csv

        if plot is not None:
            from mlaconv.inspect.plot import require_matplotlib

            require_matplotlib()
            check_output_file(plot, ".png", "--plot")
        if csv_out is not None:
            check_output_file(csv_out, ".csv", "--csv")
        options = SpectraOptions(
            ranks=_parse_list(ranks, int, "--ranks") if ranks is not None else None,
            energy_targets=tuple(_parse_list(energy, float, "--energy")), refine=refine,
            **given_options(settings))
        with progress(quiet) as track:
            report = run_spectra(src, options, progress=track)
        console = report_console(json_out)
        render_report(report, console)
        if plot is not None:
            from mlaconv.inspect.plot import save_spectra_plot

            save_spectra_plot(report, plot)
            line(console, f"plot: {escape(str(plot))}")
        if csv_out is not None:
            write_csv(report, csv_out)
            line(console, f"csv: {escape(str(csv_out))}")
        if json_out:
            emit_json(report.to_json())


def _parse_list(text: str, kind: type, option: str) -> list:
    try:
        return [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise MlaconvError(f"{option} takes comma-separated {kind.__name__} values, got {text!r}") from None


def render_report(report: SpectraReport, console) -> None:
    """The human-readable report: a header, one table row per layer, summary rows, the budget advice."""
    full = report.full_rank
    line(console, f"[bold]spectra[/] of {escape(report.source)} ({report.architecture}, "
                  f"{report.num_layers} layers, {report.mode}): R = {report.qk_rope_head_dim} rope dims "
                  f"(stride {report.rope_stride}); latent matrix {report.matrix_rows}×{report.hidden_size}, "
                  f"full rank {full}")
    line(console, f"shows: {escape(report.shows)}")
    line(console, "energy retained at rank r, rank needed per energy target, RoPE energy kept")
    table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    for column in ["layer", *(f"r={r}" for r in report.ranks),
                   *(f"r@{t * 100:g}%" for t in report.energy_targets), "RoPE"]:
        table.add_column(column, justify="right", overflow="fold")
    for layer in report.layers:
        table.add_row(str(layer.layer), *(f"{e:.3f}" for e in layer.energy_retained),
                      *(str(r) for r in layer.rank_for_energy), f"{layer.rope_energy_kept:.3f}")
    summary = report.summary
    table.add_section()
    table.add_row("mean", *(f"{e:.3f}" for e in summary.energy_retained_mean),
                  *(f"{r:.1f}" for r in summary.rank_for_energy_mean), f"{summary.rope_energy_kept_mean:.3f}")
    table.add_row("worst", *(f"{e:.3f}" for e in summary.energy_retained_min),
                  *(str(r) for r in summary.rank_for_energy_max), f"{summary.rope_energy_kept_min:.3f}")
    console.print(table)
    shares = ", ".join(
        f"{_span([layer.rank_fraction_for_energy[j] for layer in report.layers])} for {t * 100:g}%"
        for j, t in enumerate(report.energy_targets)
    )
    line(console, f"rotation the shared key drops: mean score loss {summary.rope_score_loss_mean:.4f} of the "
                  f"query-weighted rotary key energy ({summary.rope_score_loss_without_mean_rotation_mean:.4f} "
                  "without the mean-rotation stand-in)")
    line(console, f"share of the {full} singular values that carries the energy (over layers): {shares}")
    where = ", measured on the audit windows" if report.window_sets is not None else ""
    line(console, f"rotary figures per layer{where} (score loss: a share of the query-weighted rotary scores; "
                  "pairs kept: those a rope slot turns at)")
    console.print(_rotary_table(report))
    if report.refinement is not None:
        _render_refinement(report.refinement, console)
    advice = report.recommendation
    if advice is not None:
        line(console, f"--kv-keep {advice.kv_keep:g}: r = {advice.kv_lora_rank}, R = {advice.qk_rope_head_dim} "
                      f"({advice.kv_elements_per_token_per_layer} of {report.kv_elements_per_token_per_layer} "
                      f"elements, {advice.kv_keep_actual:.1%}); mean latent energy "
                      f"{advice.energy_retained_mean:.4f}, mean RoPE energy kept "
                      f"{summary.rope_energy_kept_mean:.4f}; {escape(advice.reason)}")


def _span(fractions: list[float]) -> str:
    """min–max of fractions, as percentages."""
    low, high = f"{min(fractions):.0%}", f"{max(fractions):.0%}"
    return low if low == high else f"{low[:-1]}–{high}"


def _rotary_table(report: SpectraReport) -> Table:
    """Per layer: the rotary figures, and where the score loss lies among the pairs (kept in a slot or dropped)."""
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False)
    for column in ("layer", "key energy kept", "cost-weighted", "score loss", "without μ", "μ recovers",
                   "at pairs kept", "at pairs dropped", "worst pair"):
        table.add_column(column, justify="right", overflow="fold")
    for layer in report.layers:
        losses, kept = layer.rope_score_loss_per_frequency, set(layer.rope_frequencies)
        worst = max(range(len(losses)), key=losses.__getitem__)
        at_kept = sum(loss for j, loss in enumerate(losses) if j in kept)
        dropped = sum(loss for j, loss in enumerate(losses) if j not in kept)
        table.add_row(str(layer.layer), f"{layer.rope_energy_kept:.4f}", f"{layer.rope_loss_weighted_kept:.4f}",
                      f"{layer.rope_score_loss:.4f}", f"{layer.rope_score_loss_without_mean_rotation:.4f}",
                      f"{layer.rope_mean_rotation_recovers:.4f}", f"{at_kept:.4f}",
                      f"{dropped:.4f}", f"{worst}: {losses[worst]:.4f}")
    return table


def _render_refinement(refinement: SpectraRefinement, console) -> None:
    """Closed form → refined per layer, on the audit windows (— where the refinement was not kept)."""
    line(console, f"refinement per layer at r = {refinement.kv_lora_rank}, R = {refinement.qk_rope_head_dim}, "
                  "measured on the audit windows: closed form, then refined (— where not kept)")
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False)
    for column in ("layer", "attention error", "refined", "score loss", "refined", "key energy kept", "refined",
                   "variant"):
        table.add_column(column, justify="left" if column == "variant" else "right", overflow="fold")
    for layer in refinement.layers:
        closed, refined = layer.closed_form, layer.refined
        cells = []
        for name in ("attention_error", "rope_score_loss", "rope_energy_kept"):
            cells += [f"{getattr(closed, name):.4f}", f"{getattr(refined, name):.4f}" if refined else "—"]
        table.add_row(str(layer.layer), *cells, escape(layer.selection.kept))
    console.print(table)
    search = refinement.shape_search
    if search is not None and search.chosen:
        line(console, f"split: {escape(search.chosen)}")
    line(console, f"refinement: {escape(refinement.refinement)} ({refinement.refine_steps} steps of "
                  f"{refinement.refine_batch} windows a layer)")
