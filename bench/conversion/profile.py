#!/usr/bin/env python
"""Where a calibrated conversion spends its time (issue 16), next to one plain forward pass of the source.

Runs ``mlaconv.conversion.run.convert`` in this process with timers wrapped around its stages (this script only
wraps functions; it changes nothing they compute), then times one forward pass of the source through
transformers' own ``AutoModelForCausalLM`` over the same calibration windows (batches of
``--calib-batch-size``, float32, no cache): the yardstick of the issue, ``total ≤ 5× forward``.

Stages are timed exclusively (a stage nested in another is counted under ``outer/inner``, not twice):

    tokens               reading and tokenizing the calibration text
    search               the (r, R) split search (its own statistics, factorizations, measurements)
    stats                E[x xᵀ] and the attention profile on the fit windows (source forward)
    factor[variant]      each variant's factorization (+ assembling the MLA layer)
    held pairs           the source attention outputs on the select/audit windows
    measure[select|audit]  converted layers measured on those windows
    refinement data      the fit windows' inputs and source outputs for the refinement
    refine               the refinement (steps and its select-window checks)
    advance              the source forward through the layer (+ the followed converted models)
    whole-model check    KL to the source on the audit windows
    write                writing tensors;  verify: the built-in check after writing

    python -m bench.conversion.profile --model bench/_work/models/llama-docs --kv-keep 0.5
    python -m bench.conversion.profile --model bench/_work/models/qwen2-docs --kv-keep 0.25 --json out.json
    python -m bench.conversion.profile --synthetic 2,1024,16,4,64,2816,32000 --calib-window 512 --calib-tokens 32768

``--synthetic LAYERS,HIDDEN,HEADS,KV_HEADS,HEAD_DIM,INTERMEDIATE,VOCAB`` profiles a random bf16 Llama of that shape
(``bench.conversion.memory.make_checkpoint``) calibrated on random token windows: wider layers than the bench models', where
the refinement's share of the work differs; the weights are random, so only its times mean anything.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from mlaconv.calibration import streamer as calibrate
from mlaconv.conversion import calibrated
from mlaconv.conversion import plan as plan_module
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.evaluate import verify as verify_module
from mlaconv.target.layout import LayerWriter


class Timer:
    """Exclusive wall and CPU time per (stage path, layer)."""

    def __init__(self):
        self.stack: list[str] = []
        self.times: dict[tuple[str, int | None], float] = defaultdict(float)
        self.cpu: dict[tuple[str, int | None], float] = defaultdict(float)
        self.calls: dict[tuple[str, int | None], int] = defaultdict(int)
        self.layer: int | None = None
        self.last, self.last_cpu = time.perf_counter(), time.process_time()

    def _charge(self) -> None:
        now, now_cpu = time.perf_counter(), time.process_time()
        if self.stack:
            self.times[("/".join(self.stack), self.layer)] += now - self.last
            self.cpu[("/".join(self.stack), self.layer)] += now_cpu - self.last_cpu
        self.last, self.last_cpu = now, now_cpu

    def wrap(self, owner, name: str, stage, layer_arg: int | None = None) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            label = stage(*args, **kwargs) if callable(stage) else stage
            self._charge()
            if layer_arg is not None and len(args) > layer_arg and isinstance(args[layer_arg], int):
                self.layer = args[layer_arg]
            self.stack.append(label)
            self.calls[("/".join(self.stack), self.layer)] += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._charge()
                self.stack.pop()

        setattr(owner, name, timed)


def variant(src, shape, options, stats=None):
    if stats is None:
        return "factor[weights-only]"
    return "factor[attention-weighted]" if options.latent_weighting == "attention" else "factor[calibrated]"


def instrument(timer: Timer) -> None:
    streamer = calibrate.SourceStreamer
    timer.wrap(calibrated, "calibration_tokens", "tokens")
    timer.wrap(calibrated, "search_shapes", "search")
    timer.wrap(plan_module, "rope_strides", "rope strides")
    timer.wrap(calibrated, "rope_strides", "rope strides")
    timer.wrap(streamer, "stats", "stats", layer_arg=1)
    timer.wrap(calibrated, "factor_attention", variant)
    timer.wrap(calibrated, "assemble", "assemble")
    timer.wrap(calibrated, "convert_attention", lambda src, shape, options, stats=None: variant(src, shape, options, stats))
    timer.wrap(streamer, "held_pairs", "held pairs", layer_arg=1)
    timer.wrap(streamer, "attention_error", lambda self, *a, windows="select", **k: f"measure[{windows}]", layer_arg=1)
    timer.wrap(calibrated, "latent_errors", "latent errors")
    timer.wrap(streamer, "refinement_data", "refinement data", layer_arg=1)
    timer.wrap(calibrated, "refine", "refine")
    timer.wrap(streamer, "advance", "advance", layer_arg=1)
    timer.wrap(streamer, "agreement", "whole-model check")
    for name in ("outer", "layer", "choose"):
        timer.wrap(LayerWriter, name, "write")
    timer.wrap(verify_module, "verify", "verify")


def source_forward(model: Path, tokens: torch.Tensor, batch: int) -> tuple[float, float]:
    """Wall and CPU seconds of one forward pass of the source (transformers, float32) over the [B, S] windows."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    started, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for start in range(0, tokens.shape[0], batch):
            net(tokens[start : start + batch], use_cache=False)
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--synthetic", help="LAYERS,HIDDEN,HEADS,KV_HEADS,HEAD_DIM,INTERMEDIATE,VOCAB: a random Llama")
    parser.add_argument("--kv-keep", type=float, default=0.5)
    parser.add_argument("--calib", type=Path, help="calibration text (default: MODEL/calib.txt)")
    parser.add_argument("--calib-tokens", type=int, default=16384, help="default: the fidelity bench's 64 × 256")
    parser.add_argument("--calib-window", type=int, default=256)
    parser.add_argument("--calib-batch-size", type=int, default=4)
    parser.add_argument("--refine-steps", type=int, default=None)
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if (args.model is None) == (args.synthetic is None):
        parser.error("give one of --model and --synthetic")
    with tempfile.TemporaryDirectory() as work:
        if args.synthetic:
            from bench.conversion.memory import Shape, make_calibration, make_checkpoint

            layers, hidden, heads, kv_heads, head_dim, intermediate, vocab = map(int, args.synthetic.split(","))
            shape = Shape(f"synthetic-{args.synthetic}", layers, hidden, heads, kv_heads, head_dim, intermediate,
                          vocab, True)
            args.model = Path(work) / shape.name
            make_checkpoint(args.model, shape, shard_bytes=2**31)
            args.calib = args.model / "calib.jsonl"
            make_calibration(args.calib, vocab, args.calib_tokens // args.calib_window, args.calib_window)
        profile(args)


def profile(args: argparse.Namespace) -> None:
    options = ConvertOptions(kv_keep=args.kv_keep, calib=[str(args.calib or args.model / "calib.txt")],
                             calib_tokens=args.calib_tokens, calib_window=args.calib_window,
                             calib_batch_size=args.calib_batch_size, refine_steps=args.refine_steps,
                             verify=not args.no_verify, force=True)
    timer = Timer()
    instrument(timer)
    tokens_seen: list[torch.Tensor] = []
    original_tokens = calibrated.calibration_tokens

    def keep_tokens(*a, **k):
        tokens = original_tokens(*a, **k)
        tokens_seen.append(tokens)
        return tokens

    calibrated.calibration_tokens = keep_tokens
    with tempfile.TemporaryDirectory() as tmp:
        started, cpu = time.perf_counter(), time.process_time()
        report = convert(str(args.model), Path(tmp) / "out", options)
        total, total_cpu = time.perf_counter() - started, time.process_time() - cpu
    timer._charge()
    tokens = tokens_seen[0]
    forward, forward_cpu = source_forward(args.model, tokens, args.calib_batch_size)

    stages: dict[str, float] = defaultdict(float)
    stages_cpu: dict[str, float] = defaultdict(float)
    for (stage, _), seconds in timer.cpu.items():
        stages_cpu[stage] += seconds
    stages_cpu["other"] = total_cpu - sum(stages_cpu.values())
    layers: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (stage, layer), seconds in timer.times.items():
        stages[stage] += seconds
        if layer is not None and not stage.startswith("search"):
            layers[layer][stage.split("/")[0]] += seconds
    stages["other"] = total - sum(stages.values())
    calibration = report.calibration
    whole = calibration.whole_model
    result = {
        "model": str(args.model), "kv_keep": args.kv_keep, "windows": list(tokens.shape),
        "threads": torch.get_num_threads(), "total_s": total, "source_forward_s": forward,
        "ratio": total / forward,
        "total_cpu_s": total_cpu, "source_forward_cpu_s": forward_cpu, "cpu_ratio": total_cpu / forward_cpu, "stages_s": dict(sorted(stages.items(), key=lambda kv: -kv[1])),
        "stages_cpu_s": dict(stages_cpu),
        "layers_s": {i: dict(v) for i, v in sorted(layers.items())},
        "refinement": calibration.refinement, "refine_steps": calibration.refine_steps, "written": whole.written,
        "kl": {calibrated.CLOSED: whole.closed_form.kl, calibrated.REFINED: whole.refined.kl if whole.refined else None},
        "shapes": [report.kv_lora_rank, report.qk_rope_head_dim],
    }
    print(f"{args.model.name} --kv-keep {args.kv_keep}: {tokens.shape[0]}×{tokens.shape[1]} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"  wall: total {total:8.1f} s   one source forward {forward:6.2f} s   ratio {total / forward:6.1f}×")
    print(f"  CPU:  total {total_cpu:8.1f} s   one source forward {forward_cpu:6.2f} s   ratio {total_cpu / forward_cpu:6.1f}×")
    print(f"  {'stage':<40} {'wall s':>8} {'wall %':>6} {'CPU s':>8} {'CPU %':>6}")
    for stage, seconds in result["stages_s"].items():
        cpu = stages_cpu[stage]
        print(f"  {stage:<40} {seconds:8.1f} {100 * seconds / total:6.1f} {cpu:8.1f} {100 * cpu / total_cpu:6.1f}")
    names = sorted({s for v in layers.values() for s in v})
    print("  per layer (s): " + " ".join(f"{n[:12]:>12}" for n in names))
    for i, v in sorted(layers.items()):
        print(f"  layer {i:<8}" + " ".join(f"{v.get(n, 0.0):12.1f}" for n in names))
    print(f"  refinement: {result['refinement']} ({result['refine_steps']} steps); written: {result['written']}; "
          f"KL closed {result['kl'][calibrated.CLOSED]} refined {result['kl'][calibrated.REFINED]}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
