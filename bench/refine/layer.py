#!/usr/bin/env python
"""One layer's refinement under different settings, on calibration data only (issue 16).

Streams the source to layer L over a bench model's calib.txt (the fidelity bench's 64 windows of 256), or, for a
model folder (a real model, e.g. bench/_work/models/smollm2-135m), over the calibration ``mlaconv convert`` reads
by default (the bundled general text, windows of 2,048); factors that layer in its calibrated variant at the
--kv-keep budget's default split, and runs ``refine`` with each setting given, printing the wall time and the
relative attention error on the select windows (which choose settings) and on the audit windows (reported only).
Never touches evaluation text.

    python -m bench.refine.layer llama-docs 0.5 2 "steps=75,batch=4;steps=150,queries=32"   # keywords of mlaconv.mla.refine.refine
    python -m bench.refine.layer llama-docs 0.5 2 "steps=150,queries=32" 16   # training on the first 16 fit windows
    python -m bench.refine.layer bench/_work/models/smollm2-135m 0.5 15 "steps=40,queries=256"
"""

import argparse
import time
from dataclasses import replace

import torch

from bench.lib import WORK
from mlaconv.conversion import calibrated
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipeline import source_layers
from mlaconv.conversion.plan import plan_conversion, with_rope_stride
from mlaconv.mla import refine as R
from mlaconv.mla.attention import factor_attention

MODELS = WORK / "models"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a bench model under bench/_work/models (e.g. llama-docs), or a model folder")
    parser.add_argument("kv_keep", type=float)
    parser.add_argument("layer", type=int)
    parser.add_argument("settings", help="';'-separated settings, each the keywords of mlaconv.mla.refine.refine")
    parser.add_argument("train_windows", type=int, nargs="?", help="fit windows to train on (default: convert's)")
    args = parser.parse_args()
    model, keep, layer_i, settings = args.model, args.kv_keep, args.layer, args.settings
    bench_model = (MODELS / model / "calib.txt").is_file()
    opts = (ConvertOptions(kv_keep=keep, calib=[str(MODELS / model / "calib.txt")], calib_tokens=16384,
                           calib_window=256) if bench_model else ConvertOptions(kv_keep=keep))
    plan = with_rope_stride(plan_conversion(str(MODELS / model) if bench_model else model, opts))
    tokens = calibrated.calibration_tokens(plan)
    streamer = calibrated.calibration_streamer(plan, tokens)
    train_windows = args.train_windows if args.train_windows else calibrated.training_windows(
        len(streamer.split.fit), tokens.shape[1], opts.refine_tokens)
    layer = next(layer for layer in source_layers(plan.reader, plan.spec, streamer) if layer.index == layer_i)
    src, stats = layer.attention, layer.stats
    run = calibrated.layer_run(plan.spec, plan.layer, tokens.shape[1])
    latent, _ = factor_attention(src, plan.shape, calibrated.calibrated_layer_options(plan.layer), stats)
    train, select = streamer.refinement_data(layer_i, src, train_windows)
    audit = streamer.held_pairs(layer_i, src, "audit")
    angles = torch.arange(tokens.shape[1], dtype=torch.float64)[:, None] * run.slot_frequencies[None, :]

    def error(layer, data) -> float:
        params = {name: t.float() for name, t in layer.trainable().items()}
        fixed = replace(layer, o=layer.o.float(), o_bias=None if layer.o_bias is None else layer.o_bias.float(),
                        k_rope_bias=None if layer.k_rope_bias is None else layer.k_rope_bias.float())
        with torch.no_grad():
            y = R.latent_attention(data[0], params, fixed, plan.shape, run.rope_dim, angles.cos().float(),
                                   angles.sin().float())
        return ((y - data[1]).pow(2).sum() / data[1].pow(2).sum()).item()

    print(f"{model} --kv-keep {keep} layer {layer_i}: closed form select {error(latent, select):.5f} "
          f"audit {error(latent, audit):.5f}")
    for setting in filter(None, settings.split(";")):
        kwargs = eval(f"dict({setting})")  # noqa: S307 (a bench's own command line)
        started = time.perf_counter()
        result = R.refine(latent, plan.shape, run.rope_dim, run.slot_frequencies, train, select, **kwargs)
        print(f"  {setting:<40} {time.perf_counter() - started:7.1f} s  select {result.after:.5f}  "
              f"audit {error(result.latent, audit):.5f}")


if __name__ == "__main__":
    main()
