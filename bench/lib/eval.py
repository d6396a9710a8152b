"""The bench's data and fidelity figures, on top of ``mlaconv.evaluate.perplexity`` and ``mlaconv.calibration.streamer``.

Both models of a comparison are loaded through ``AutoModelForCausalLM`` in float32 and scored on the
very same held-out ids, one batch of windows at a time (``mlaconv.evaluate.perplexity.evaluate_perplexity``):
PPL of each, drift = PPL ratio − 1, KL(source ‖ converted) per scored token, top-1 agreement.

    from bench.lib.eval import calibration_ids, eval_source, fidelity
    ids = calibration_ids("bench/_work/models/llama-docs")               # [64, 256] from calib.txt
    row = fidelity("bench/_work/models/llama-docs", "out/llama-svd50", eval_source("bench/_work/models/llama-docs"))
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.lib import WORK
from mlaconv.calibration.windows import load_calibration_tokens
from mlaconv.evaluate.perplexity import evaluate_perplexity
from mlaconv.io.text import TokenSource
from mlaconv.source.spec import load_source

WINDOW = 256
CALIB_WINDOWS = 64
BATCH = 16


def eval_source(model: str | Path) -> TokenSource:
    """Held-out ids of a bench model: ``samples.jsonl`` for stories260K, else the folder's ``eval.txt``."""
    folder = Path(model)
    samples = folder / "samples.jsonl"
    return TokenSource(tokens=samples) if samples.is_file() else TokenSource(text=folder / "eval.txt")


def calibration_file(model: str | Path) -> Path:
    """Calibration data of a bench model: ``calib.txt`` in its folder, or the sampled stories260K ids."""
    folder = Path(model)
    if (folder / "calib.txt").is_file():
        return folder / "calib.txt"
    return WORK / f"{folder.name}_calib.jsonl"


def calibration_ids(model: str | Path, windows: int = CALIB_WINDOWS, window: int = WINDOW,
                    seed: int = 0) -> torch.Tensor:
    """[windows, window] calibration ids, drawn exactly as ``mlaconv convert --calib FILE`` draws them."""
    folder, spec, reader = load_source(str(model))
    reader.close()
    return load_calibration_tokens(folder, spec, [str(calibration_file(folder))], None, windows * window, window, seed)


def fidelity(source: str | Path, converted: str | Path, tokens: TokenSource, window: int = WINDOW,
             max_windows: int | None = None, batch_size: int = BATCH) -> dict:
    """One table row: source and converted PPL, drift, KL per token and top-1 agreement on ``tokens``."""
    report = evaluate_perplexity(converted, source, source=tokens, window=window, max_windows=max_windows,
                                 batch_size=batch_size)
    return {"ppl_source": report.baseline_ppl, "ppl": report.ppl, "drift": report.drift, "kl": report.kl_per_token,
            "top1": report.top1_agreement, "windows": report.windows, "tokens": report.tokens,
            "kv_kept": report.kv_kept}
