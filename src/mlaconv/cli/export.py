"""``mlaconv export gguf OUT [FILE.gguf]``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mlaconv.cli import app
from mlaconv.cli._common import (DEBUG_OPTION, JSON_OPTION, QUIET_OPTION, emit_json, handle_errors, line, progress,
                                 report_console)

export_app = typer.Typer(help="Write a converted model in another engine's format.", no_args_is_help=True)
app.add_typer(export_app, name="export")


@export_app.command("gguf")
def gguf(
    out: Path = typer.Argument(..., help="A folder written by `mlaconv convert` (dense DeepSeek-V3)."),
    file: Optional[Path] = typer.Argument(None, help="The GGUF file to write (default: OUT-OUTTYPE.gguf beside OUT)."),
    outtype: str = typer.Option("f32", "--outtype", help="Tensor type of the weights: f32, bf16, f16 or q8_0 (norms stay f32; a tensor that the type cannot hold is kept f32)."),
    no_tokenizer: bool = typer.Option(False, "--no-tokenizer", help="Write no vocabulary (llama.cpp's no-vocab mode: token ids in, logits out)."),
    force: bool = typer.Option(False, "--force", help="Replace FILE if it exists."),
    json_out: bool = JSON_OPTION,
    quiet: bool = QUIET_OPTION,
    debug: bool = DEBUG_OPTION,
) -> None:
    """Write OUT as a llama.cpp GGUF (architecture deepseek2, MLA cache of r + R values per token and layer).

    JSON keys (--json): output, source, architecture, outtype, bytes, tensors,
    tensor_types (GGML type → count), kept_float32 (tensors written f32
    because the type lost a row), worst_row_error, row_error_limit, vocab
    (model, pre, tokens), kv_lora_rank, qk_rope_head_dim,
    kv_cache_elements_per_token_per_layer, rope_scaling, q_scale_folded,
    llama_cpp_checked, seconds.
    """
    with handle_errors(debug, json_out):
        from mlaconv.errors import MlaconvError

        try:
            from mlaconv.target.gguf import export_gguf
        except ModuleNotFoundError as exc:
            if exc.name != "gguf":
                raise
            raise MlaconvError("export gguf needs the gguf package: pip install gguf") from None
        if not out.is_dir():
            raise MlaconvError(f"no such folder: {out}")
        target = file if file is not None else out.resolve().parent / f"{out.resolve().name}-{outtype}.gguf"
        with progress(quiet) as track:
            report = export_gguf(out, target, outtype=outtype.lower(), force=force, use_tokenizer=not no_tokenizer,
                                 progress=track)
        kept = f"; kept float32: {', '.join(report['kept_float32'])}" if report["kept_float32"] else ""
        vocab = report["vocab"]
        line(report_console(json_out),
             f"[bold green]wrote[/] {report['output']} ({report['bytes'] / 2**20:.1f} MiB, deepseek2, {report['outtype']}; "
             f"vocab {vocab['model']}{' / ' + vocab['pre'] if vocab['pre'] else ''}, {vocab['tokens']} tokens; "
             f"MLA cache {report['kv_cache_elements_per_token_per_layer']} values per token and layer{kept})")
        if json_out:
            emit_json(report)

