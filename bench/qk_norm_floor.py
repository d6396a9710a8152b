"""What a linear stand-in of QK-norm costs before any compression: per layer, the share of the normalised
queries' and keys' energy the least-squares stand-in (``mla.qk_norm``, fitted on the calibration's fit
windows) leaves unexplained, the relative attention-output error of the uncompressed stand-in layer against
the true QK-normed layer, and how much the key norm's per-token factor 1/rms varies (std/mean over tokens, per
KV head), all on the select windows (calibration text only, never eval.txt).

    python bench/qk_norm_floor.py                     # bench/_work/models/qwen3-docs
    python bench/qk_norm_floor.py --model PATH
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from eval_lib import calibration_ids  # noqa: E402

from mlaconv.calibrate import CalibrationOptions, SourceStreamer  # noqa: E402
from mlaconv.pipeline import read_attention  # noqa: E402
from mlaconv.plan import load_source  # noqa: E402
from mlaconv.reference import query_key, rms_norm, source_attention  # noqa: E402


def relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).double().pow(2).sum() / exact.double().pow(2).sum()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=HERE / "_work" / "models" / "qwen3-docs")
    args = parser.parse_args()
    _, spec, reader = load_source(str(args.model))
    streamer = SourceStreamer(reader, spec, CalibrationOptions(calibration_ids(args.model)))
    select = list(streamer.split.select)
    print("| layer | q unexplained | k unexplained | attention-output error, uncompressed stand-in | key 1/rms std/mean |")
    print("|---|---|---|---|---|")
    for i in range(spec.num_layers):
        true = read_attention(reader, spec, i)
        linear = streamer.stand_in(i, true, streamer.stats(i, true)).cast(dtype=torch.float32)
        true32 = true.cast(dtype=torch.float32)
        angles = streamer.rotated_angles if true.rotated else torch.zeros_like(streamer.rotated_angles)
        with torch.no_grad():
            x = rms_norm(streamer.hidden[select], true32.input_norm, spec.rms_norm_eps).float()
            (q, k), (q_lin, k_lin) = query_key(x, true32, streamer.heads), query_key(x, linear, streamer.heads)
            out = relative(source_attention(x, linear, streamer.heads, angles),
                           source_attention(x, true32, streamer.heads, angles))
            raw = (x @ true32.k.T + (0 if true32.k_bias is None else true32.k_bias)).unflatten(-1, (spec.num_kv_heads, spec.head_dim))  # [B, S, n_kv, d]
            factor = raw.pow(2).mean(-1).add(spec.rms_norm_eps).rsqrt().flatten(0, 1)  # [tokens, n_kv]
            spread = ", ".join(f"{v:.2f}" for v in (factor.std(0) / factor.mean(0)).tolist())
        print(f"| {i} | {relative(q_lin, q):.4f} | {relative(k_lin, k):.4f} | {out:.4f} | {spread} |", flush=True)
        streamer.advance(i, true)
    reader.close()


if __name__ == "__main__":
    main()
