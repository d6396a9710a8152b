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


@app.command()
def convert(
    src: Optional[str] = typer.Argument(None, help="Source model: a local folder or a Hugging Face hub id (from the local cache). With --recipe and one argument, the recipe's source is used and the argument is OUT."),
    out: Optional[Path] = typer.Argument(None, help="Output folder (written atomically)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="A recipes/*.yaml file of settings; explicit flags override it."),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Latent rank r (kv_lora_rank)."),
    kv_keep: Optional[float] = typer.Option(None, "--kv-keep", help="Fraction of the source KV cache to keep, in (0, 1]; picks r and R."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", help="Shared RoPE key dims R (qk_rope_head_dim); default min(64, head_dim)."),
    rope_stride: Optional[int] = typer.Option(None, "--rope-stride", help="Keep source frequencies 0, s, 2s, … (default: chosen from the weights)."),
    calib: Optional[list[str]] = typer.Option(None, "--calib", help="Calibration text file (or .jsonl of token ids); repeatable."),
    calib_dataset: Optional[str] = typer.Option(None, "--calib-dataset", help="Calibration from a Hugging Face dataset NAME[:CONFIG[:SPLIT]] (local cache when offline)."),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", help="Calibration tokens (default 65536)."),
    calib_window: Optional[int] = typer.Option(None, "--calib-window", help="Calibration window length (default 2048, capped at the context)."),
    weights_only: bool = typer.Option(False, "--weights-only", help="Ignore a recipe's calibration settings."),
    device: Optional[str] = typer.Option(None, "--device", help="Where calibration and refinement run (default: cuda when torch sees a GPU, else cpu), and, when given, the --eval-* evaluation too: cpu, cuda, cuda:1 …"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Output dtype: float32 or bfloat16 (default: the source's)."),
    shard_size: Optional[str] = typer.Option(None, "--shard-size", help="Largest output shard, e.g. 5GB (default) or 500MB."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    verify: Optional[bool] = typer.Option(None, "--verify/--no-verify", help="Compare OUT with the source through AutoModelForCausalLM (default on)."),
    verify_windows: Optional[int] = typer.Option(None, "--verify-windows", help="Windows the built-in check runs (default 4)."),
    verify_window: Optional[int] = typer.Option(None, "--verify-window", help="Tokens per check window (default 128)."),
    allow_sliding_window: Optional[bool] = typer.Option(None, "--allow-sliding-window", help="Convert a sliding-window model with full attention."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision when SRC is a hub id."),
    absorbed: Optional[bool] = typer.Option(None, "--absorbed", help="Also write absorbed inference weights (W^UK in the query, W^UV in o_proj) to OUT/absorbed."),
    refine_steps: Optional[int] = typer.Option(None, "--refine-steps", help="With calibration: gradient steps per layer on its measured attention error, kept only if it measures better on held-out windows (default: 75 steps of 4 windows on CUDA, or on a CPU where that is estimated under 30 min; else as many steps of 1 window as fit in 30 min, at least 25; 0 = closed form only)."),
    target: Optional[str] = typer.Option(None, "--target", help="Serving target: portable (default: the same function on transformers, vLLM, SGLang and llama.cpp: no bias tensors, a rope_scaling they all compute), transformers (biases and the source's rope_scaling kept), vllm, sglang, llamacpp."),
    eval_text: Optional[str] = typer.Option(None, "--eval-text", help="After converting, run `mlaconv eval perplexity` on this text file against the source."),
    eval_dataset: Optional[str] = typer.Option(None, "--eval-dataset", help="… or on this dataset (wikitext = WikiText-2 raw test)."),
    eval_tokens: Optional[str] = typer.Option(None, "--eval-tokens", help="… or on these token ids (JSON lines of input_ids)."),
    eval_window: Optional[int] = typer.Option(None, "--eval-window", help="Evaluation window (default 2048 or the context)."),
    eval_max_windows: Optional[int] = typer.Option(None, "--eval-max-windows", help="Evaluate at most this many windows."),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
) -> None:
    """Convert an MHA/GQA checkpoint into a native DeepSeek-V3 MLA checkpoint.

    --json prints the report (also OUT/mlaconv.json). Among its keys: target {name, engines, biases_written,
    biases_left_out, rope_rewrite (null, or {from, to, max_relative_frequency_gap, slots_differing, slots,
    note}), note}; verify (transformers' max_abs_logit_diff, max_rel_logit_diff, kl, top1, dtype, windows,
    tokens, loader) with verify.engines.{transformers, vllm, sglang, llamacpp}: each {same_as, reason} or
    {refused} or its own max_abs_logit_diff, max_rel_logit_diff, kl, top1 and differences, and checked (the
    engine version the emulation mirrors); eval (the keys of mlaconv eval perplexity, as transformers computes it).
    """
    with handle_errors(debug, json_out):
        from mlaconv.conversion import ConvertOptions, convert as run_convert
        from mlaconv.errors import MlaconvError
        from mlaconv.io import parse_size

        given = {
            "rank": rank, "kv_keep": kv_keep, "rope_dim": rope_dim, "rope_stride": rope_stride,
            "calib": calib or None, "calib_dataset": calib_dataset, "calib_tokens": calib_tokens,
            "calib_window": calib_window, "device": device, "dtype": dtype,
            "shard_size": parse_size(shard_size) if shard_size else None, "verify": verify,
            "verify_windows": verify_windows, "verify_window": verify_window,
            "allow_sliding_window": allow_sliding_window, "revision": revision, "eval_text": eval_text,
            "eval_dataset": eval_dataset, "eval_tokens": eval_tokens, "eval_window": eval_window,
            "eval_max_windows": eval_max_windows, "absorbed": absorbed, "refine_steps": refine_steps, "target": target,
        }
        settings = {key: value for key, value in given.items() if value is not None}
        if recipe is not None:
            from mlaconv.recipes import load_recipe, merge_options

            loaded = load_recipe(recipe)
            settings = merge_options(loaded.options, given)
            if out is None and src is not None:  # one positional argument with a recipe: it is OUT
                src, out = None, Path(src)
            src = src or loaded.source
            settings["recipe"] = str(recipe)
        if weights_only:
            settings.pop("calib", None)
            settings.pop("calib_dataset", None)
        if src is None or out is None:
            raise MlaconvError("give SRC and OUT (SRC may come from --recipe)")
        with progress(quiet) as track:
            report = run_convert(src, out, ConvertOptions(force=force, **settings), progress=track)
        render_report(report, report_console(json_out))
        if json_out:
            emit_json(report)


def render_report(report: dict, console) -> None:
    kv = report["kv_elements_per_token_per_layer"]
    line(console, f"[bold green]converted[/] {escape(str(report['source']))} → {escape(str(report['output']))}  "
                  f"({report['architecture']} → DeepseekV3ForCausalLM, {report['dtype']})")
    line(console, f"KV cache per token and layer: {kv['source']} → {kv['converted']} elements "
                  f"({report['kv_keep']:.1%} kept; r = {report['kv_lora_rank']}, R = {report['qk_rope_head_dim']}, "
                  f"rope stride {report['rope_stride']}); {escape(report['shape_choice'])}")
    search = report.get("shape_search") or {}
    if search.get("candidates"):
        line(console, "splits measured: " + ", ".join(
            f"{c['kv_lora_rank']} + {c['qk_rope_head_dim']}: {c['mean_attention_error']:.4f}" for c in search["candidates"]
        ) + " (mean attention error)")
    calibrated = report.get("calibration") is not None
    table = Table(title="per layer" + (", measured on the audit windows" if calibrated else ""), show_lines=False)
    columns = ["layer", "latent energy", "RoPE energy kept", "key error", "value error"]
    for column in columns + (["attention error", "variant"] if calibrated else []):
        table.add_column(column, justify="left" if column == "variant" else "right", overflow="fold")
    energy = report["energy_retained"]["per_layer"]
    for i, values in enumerate(zip(energy, report["rope_energy_kept"], report["key_error"], report["value_error"])):
        cells = [f"{v:.4f}" for v in values]
        if calibrated:
            cells += [f"{report['attention_error'][i]:.4f}", report["layer_variant"][i]]
        table.add_row(str(i), *cells)
    table.add_row("mean", f"{report['energy_retained']['mean']:.4f}", f"{report['rope_energy_kept_mean']:.4f}",
                  *([""] * (len(table.columns) - 3)))
    console.print(table)
    if calibrated:
        calibration = report["calibration"]
        steps = f" ({calibration['refine_steps']} steps a layer)" if calibration["refine_steps"] else ""
        sets = calibration["window_sets"]
        line(console, f"calibration: {calibration['windows']} windows of {calibration['window']} tokens "
                      f"({len(sets['fit'])} fit, {len(sets['select'])} select, {len(sets['audit'])} audit); refinement: "
                      f"{escape(calibration['refinement'])}{steps}")
        if sets["note"]:
            line(console, f"[yellow]note:[/] {escape(sets['note'])}")
        whole = calibration["whole_model"]
        models = "; ".join(f"{name} KL {whole[name]['kl']:.4g}, top-1 {whole[name]['top1']:.2%}"
                           for name in ("closed form", "refined") if whole[name])
        line(console, f"whole model on the {whole['windows']} audit windows ({whole['tokens']} tokens): {models}; "
                      f"written: {whole['written']} ({escape(whole['reason'])})")
    check = report.get("verify")
    if check and "error" in check:
        line(console, f"[yellow]check:[/] {escape(check['error'])} (the checkpoint was kept)")
    elif check and "skipped" not in check:
        line(console, f"check ({check['loader']}, {check['windows']}×{check['tokens'] // check['windows']} tokens, "
                      f"{check['dtype']}): max |Δlogit| {check['max_abs_logit_diff']:.3g}, KL {check['kl']:.3g}, "
                      f"top-1 {check['top1']:.2%}")
        for name, figures in (check.get("engines") or {}).items():
            if "kl" in figures:
                line(console, f"  as {name} computes it: KL {figures['kl']:.3g}, top-1 {figures['top1']:.2%} "
                              f"({escape('; '.join(figures['differences']))})")
            elif "refused" in figures:
                line(console, f"  {name}: refuses it ({escape(figures['refused'])})")
            elif "same_as" in figures:
                line(console, f"  {name}: same as {figures['same_as']}")
    elif check:
        line(console, f"check skipped: {escape(check['skipped'])}")
    result = report.get("eval")
    if result and "error" in result:
        line(console, f"[yellow]eval:[/] {escape(result['error'])} (the checkpoint was kept)")
    elif result:
        agreement = (f", KL {result['kl_per_token']:.3g}, top-1 {result['top1_agreement']:.2%}"
                     if result.get("kl_per_token") is not None else " (KL and top-1 not measured: the two models "
                     "did not fit in memory together)")
        line(console, f"eval ({escape(result['data'])}, {result['windows']} windows of {result['window']}): KV cache "
                      f"{report['kv_keep']:.1%} of the source's; PPL {result['ppl']:.4g} vs source "
                      f"{result['baseline_ppl']:.4g} (drift {result['drift']:+.2%}){agreement}")
    chosen = report.get("target") or {}
    if chosen:
        line(console, f"target {chosen['name']}: {', '.join(chosen['engines'])}")
        for note in (chosen.get("note"), (chosen.get("rope_rewrite") or {}).get("note")):
            if note:
                line(console, f"[yellow]note:[/] {escape(note)}")
    for warning in report["serving"]["warnings"]:
        line(console, f"[yellow]note:[/] {escape(warning)}")
