"""Fidelity bench (issue 3): PPL drift, KL and top-1 agreement of four conversions at three KV cuts.

Methods, all written as stock DeepSeek-V3 checkpoints with the same shapes and the same exact
plumbing (tiny-latent norm, residual rescale), so that only the factorization differs:
  (a) joint-svd   plain joint weight SVD, head-averaged RoPE key (MHA2MLA's initialisation)
  (b) transmla    our re-implementation of TransMLA (activation PCA, RoRoPE, FreqFold, BKV); QK-norm dropped,
                  as TransMLA does
  (b') transmla-si the same on mlaconv's linear stand-ins of QK-normed heads (QK-norm models only)
  (c) mlaconv-w   mlaconv weights-only
  (d) mlaconv-c   mlaconv calibrated (same calibration windows as (b); --kv-keep split search)
Calibration and evaluation text never overlap (see bench/models/train.py). Models: stories260K
(bundled) and the trained bench models under bench/_work/models (python -m bench.models.train …).
A method that refuses a model (weights-only on QK-norm) gives a row with the one-line reason.

    python -m bench.fidelity.run                       # every model found, cuts 50/75/87.5%
    python -m bench.fidelity.run --models llama-docs --cuts 0.5 --methods mlaconv-c --refine-steps 0
    python -m bench.fidelity.run --models qwen3-docs --methods joint-svd,transmla,transmla-si,mlaconv-w,mlaconv-c
    python -m bench.fidelity.run --models llama-docs --methods mlaconv-c --refine-steps 25 --reduced-plan
    python -m bench.fidelity.run --models llama-docs,qwen2-docs --result fidelity-docs   # → bench/results/fidelity-docs.json

``--reduced-plan`` runs ``--refine-steps N`` exactly as mlaconv's reduced CPU plan runs N steps (one window a
step, one check on the select windows at the end, the plan's own learning rate ``REDUCED_REFINE_LR``);
plain ``--refine-steps N`` runs at the default rate with back-off, checked every ``--refine-check-every``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.baselines.methods import convert_joint_svd, convert_transmla
from bench.lib import REPO, WORK
from bench.lib.eval import CALIB_WINDOWS, WINDOW, calibration_file, calibration_ids, eval_source, fidelity
from bench.lib.results import markdown_table, write_result
from mlaconv.conversion import calibrated
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.mla.refine import CHECK_EVERY, REFINE_BATCH

MODELS = {
    "stories260K": REPO / "examples" / "stories260K",
    "llama-docs": WORK / "models" / "llama-docs",
    "qwen2-docs": WORK / "models" / "qwen2-docs",
    "qwen3-docs": WORK / "models" / "qwen3-docs",
    "qwen2-mha-docs": WORK / "models" / "qwen2-mha-docs",  # MHA: 4 heads = 4 KV heads (issue 18)
    "llama-mha-docs": WORK / "models" / "llama-mha-docs",  # MHA, no biases (issue 18)
}
METHOD_NAMES = {"joint-svd": "(a) joint SVD", "transmla": "(b) TransMLA (ours)",
                "transmla-si": "(b') TransMLA (ours), QK-norm stand-in", "mlaconv-w": "(c) mlaconv weights-only",
                "mlaconv-c": "(d) mlaconv calibrated"}
# The table of bench/fidelity/README.md, rendered from a result file's rows (bench/tables.py).
COLUMNS = [["model", "{model}"], ["method", "{method_name}"], ["KV cut", "{cut:.1%}"], ["r+R", "{r}+{R}"],
           ["PPL source → converted", "{ppl_source:.2f} → {ppl:.2f}"], ["drift", "{drift:+.1%}"],
           ["KL / token", "{kl:.4f}"], ["top-1", "{top1:.3f}"], ["convert s", "{convert_s:.1f}"]]
METHODS = ("joint-svd", "transmla", "mlaconv-w", "mlaconv-c")  # the default; transmla-si on request


def run_method(method: str, source: Path, out: Path, kv_keep: float, refine_steps: int | None,
               refine_batch: int = REFINE_BATCH, refine_check_every: int = CHECK_EVERY) -> dict:
    """Convert ``source`` with one method at one budget; return what the conversion chose."""
    if method == "joint-svd":
        report = convert_joint_svd(source, out, kv_keep=kv_keep)
        return {"r": report["kv_lora_rank"], "R": report["qk_rope_head_dim"]}
    if method in ("transmla", "transmla-si"):
        report = convert_transmla(source, out, calibration_ids(source), kv_keep=kv_keep,
                                  qk_norm="stand-in" if method == "transmla-si" else "dropped")
        return {"r": report["kv_lora_rank"], "R": report["qk_rope_head_dim"], "freqfold": report.get("freqfold")}
    calibration = {}
    if method == "mlaconv-c":
        calibration = dict(calib=[str(calibration_file(source))], calib_tokens=CALIB_WINDOWS * WINDOW,
                           calib_window=WINDOW, refine_steps=refine_steps, refine_batch=refine_batch,
                           refine_check_every=refine_check_every)
    report = convert(str(source), out, ConvertOptions(kv_keep=kv_keep, verify=False, dtype="float32", **calibration))
    calibration = report.calibration
    return {"r": report.kv_lora_rank, "R": report.qk_rope_head_dim, "variants": report.layer_variant,
            "refinement": calibration.refinement if calibration else None,
            "whole_model": calibration.whole_model.to_json() if calibration else None}


def use_reduced_rate(lr: float) -> None:
    """Make ``--refine-steps`` run at ``lr`` (the reduced plan's rate) instead of the default's: mlaconv has no
    option for the rate, so the plan ``convert`` asks for is wrapped here."""
    planned = calibrated.refinement_plan

    def plan_at_rate(*args, **kwargs):
        refinement = planned(*args, **kwargs)
        return replace(refinement, lr=lr, note=f"{refinement.note}, at the reduced plan's rate {lr:g}")

    calibrated.refinement_plan = plan_at_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--cuts", default="0.5,0.75,0.875", help="KV-cache cuts (1 − kv_keep)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated: " + ", ".join(METHODS) + ", transmla-si")
    parser.add_argument("--refine-steps", type=int, default=None,
                        help="mlaconv-c: layer-wise refinement steps (default: mlaconv's own default)")
    parser.add_argument("--refine-batch", type=int, default=REFINE_BATCH,
                        help="mlaconv-c: windows per step with --refine-steps")
    parser.add_argument("--refine-check-every", type=int, default=CHECK_EVERY,
                        help="mlaconv-c: steps between held-out measurements with --refine-steps")
    parser.add_argument("--work", type=Path, default=WORK / "fidelity", help="where checkpoints go")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--result", metavar="NAME", help="also write bench/results/NAME.json (commit, machine, load, "
                                                         "command, rows; the README tables are rendered from it)")
    parser.add_argument("--reduced-plan", action="store_true",
                        help="mlaconv-c: run --refine-steps N as the reduced CPU plan does (batch 1, one check, its rate)")
    args = parser.parse_args()
    if args.reduced_plan:
        if not args.refine_steps:
            parser.error("--reduced-plan needs --refine-steps N (N > 0)")
        args.refine_batch, args.refine_check_every = 1, args.refine_steps
        use_reduced_rate(calibrated.REDUCED_REFINE_LR)

    rows = []
    for name in args.models.split(","):
        source = MODELS[name]
        if not (source / "config.json").is_file():
            print(f"skipping {name}: {source} not found (python -m bench.models.train …)", file=sys.stderr)
            continue
        for cut in (float(c) for c in args.cuts.split(",")):
            for method in args.methods.split(","):
                out = args.work / name / f"{method}-{int(round(cut * 1000))}"
                shutil.rmtree(out, ignore_errors=True)
                started = time.perf_counter()
                try:
                    chosen = run_method(method, source, out, 1 - cut, args.refine_steps, args.refine_batch,
                                        args.refine_check_every)
                except MlaconvError as refusal:
                    rows.append({"model": name, "method": method, "method_name": METHOD_NAMES[method], "cut": cut,
                                 "refused": str(refusal)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    continue
                seconds = time.perf_counter() - started
                row = {"model": name, "method": method, "method_name": METHOD_NAMES[method], "cut": cut, **chosen,
                       "convert_s": round(seconds, 1),
                       **fidelity(source, out, eval_source(source))}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(markdown_table(COLUMNS + [["written", "{written}"]],
                         [row | {"written": (row.get("whole_model") or {}).get("written", "")} for row in rows]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.result:
        print(write_result(args.result, "fidelity", rows, COLUMNS, notes="175 windows × 256 of eval.txt "
                           "(stories260K: its 48 samples), transformers, both models in float32"))


if __name__ == "__main__":
    main()
