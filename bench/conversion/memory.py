#!/usr/bin/env python
"""Conversion memory and speed (issue 7): peak RSS and wall time of ``mlaconv convert`` next to a plain copy.

Builds a synthetic bf16 checkpoint with the exact shapes of Llama-3.2-1B (random weights, written shard by shard so
this script stays small), then runs as subprocesses, each measured on its own with ``os.wait4`` (wall time and the
child's peak RSS; this script never imports torch, since a child's peak RSS includes its parent's at the fork):

    copytree   python -c 'shutil.copytree(SRC, DST)'
    cp -r      cp -r SRC DST
    convert    mlaconv convert SRC OUT --rank 512 --rope-dim 64 --no-verify
    floor      bench/conversion/io_floor.py (issue 16): the source read with safetensors, the output's shard sizes written
    calibrated the same with --calib 8×256 random token ids --calib-window 256 --refine-steps 0
    refined    the same with --calib 32×256 random token ids --calib-window 256 and the default refinement
               plan (32 windows: 16 fit, all of which the refinement trains on, 8 select, 8 audit; on a CPU
               the plan for this shape is the reduced one, steps of one window for about 30 min by estimate)

and prints the per-stage memory model with what it predicts for this shape and for Llama-3-70B.

    python -m bench.conversion.memory                 # default work folder bench/_work/convert_memory
    python -m bench.conversion.memory --repeats 3 --json
    python -m bench.conversion.memory --skip calibrated,refined   # convert against its floor, as a CLI user runs it
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.conversion.io_floor import shard_data_bytes  # no torch imported: this driver stays small
from bench.lib import REPO, WORK
from mlaconv.report import ConversionReport
GB = 10**9
PROFILE_SCORES = 2**25  # mlaconv.mla.forward.attention_by_distance's max_scores


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool


LLAMA_32_1B = Shape("Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, True)
LLAMA_3_70B = Shape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, False)


def config_for(shape: Shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "tie_word_embeddings": shape.tied, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


def attention_elements(shape: Shape) -> int:
    """One layer's q, k, v and o weights."""
    return 2 * (shape.heads + shape.kv_heads) * shape.head_dim * shape.hidden


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint, in file order."""
    H, N, K, d, F = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    names = [("model.embed_tokens.weight", (shape.vocab, H))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        names += [(p + "self_attn.q_proj.weight", (N * d, H)), (p + "self_attn.k_proj.weight", (K * d, H)),
                  (p + "self_attn.v_proj.weight", (K * d, H)), (p + "self_attn.o_proj.weight", (H, N * d)),
                  (p + "mlp.gate_proj.weight", (F, H)), (p + "mlp.up_proj.weight", (F, H)),
                  (p + "mlp.down_proj.weight", (H, F)), (p + "input_layernorm.weight", (H,)),
                  (p + "post_attention_layernorm.weight", (H,))]
    names.append(("model.norm.weight", (H,)))
    if not shape.tied:
        names.append(("lm_head.weight", (shape.vocab, H)))
    return names


def make_checkpoint(folder: Path, shape: Shape, shard_bytes: int, seed: int = 0) -> None:
    """Random bf16 weights (std 0.02, norms near 1), saved shard by shard with an index."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    def random(dims: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(dims, dtype=torch.bfloat16)
        if len(dims) == 1:
            return out.copy_(1 + 0.1 * torch.randn(dims, generator=generator))
        rows = max(1, 2**24 // dims[1])  # fill 64 MB of float32 at a time
        for start in range(0, dims[0], rows):
            out[start:start + rows] = 0.02 * torch.randn(min(rows, dims[0] - start), dims[1], generator=generator)
        return out

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensor_shapes(shape):
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append((name, dims))
        size += nbytes
    weight_map, total = {}, 0
    for number, members in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random(dims) for name, dims in members}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({name: file for name in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config_for(shape), indent=2) + "\n")


def make_calibration(path: Path, vocab: int, windows: int, window: int, seed: int = 0) -> None:
    import random

    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(window)]}) + "\n"
                            for _ in range(windows)))


def measure(command: list[str], cleanup: Path | None = None) -> dict:
    """Run ``command``; return wall seconds and the child's own peak RSS (os.wait4), after a clean sync."""
    if cleanup is not None and cleanup.exists():
        shutil.rmtree(cleanup)
    os.sync()  # earlier runs' dirty pages are not this run's work
    load = Path("/proc/loadavg").read_text().split()[:3]  # the 2 cores are shared: what else ran
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    stderr = process.stderr.read() if process.stderr else b""
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}): {stderr.decode(errors='replace')[-2000:]}")
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "loadavg": load, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3]}


def fastest(trials: list[dict]) -> dict:
    """The fastest trial, with the median and every trial's wall seconds, peak RSS and load averages beside it."""
    return min(trials, key=lambda t: t["seconds"]) | {"median_seconds": statistics.median(t["seconds"] for t in trials),
                                                       "all_seconds": [t["seconds"] for t in trials],
                                                       "all_peak_rss_bytes": [t["peak_rss_bytes"] for t in trials],
                                                       "all_loadavg": [t["loadavg"] for t in trials]}


# --- the memory model ------------------------------------------------------------------------------------


def probe_attention(shape: Shape, rank: int, rope_dim: int) -> None:
    """(In a child process.) Peak RSS added by converting one attention layer of ``shape``, weights only."""
    import torch

    from mlaconv.mla.attention import convert_attention
    from mlaconv.mla.layer import AttentionShape, LayerOptions, SourceAttention

    H, N, K, d = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    src = SourceAttention(q=0.02 * torch.randn(N * d, H), k=0.02 * torch.randn(K * d, H),
                          v=0.02 * torch.randn(K * d, H), o=0.02 * torch.randn(H, N * d), input_norm=torch.ones(H))
    src = src.cast(dtype=torch.bfloat16)
    before = _hwm()
    convert_attention(src, AttentionShape(H, N, K, d), LayerOptions(rank=rank, rope_dim=rope_dim,
                                                                     rope_theta=500000.0, rope_stride=1))
    print(json.dumps({"added_peak_bytes": _hwm() - before}))


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


WRITE_AHEAD = 64 * 2**20  # mlaconv.conversion.weights_only.WRITE_AHEAD_BYTES
LAYER_MEMORY = 2**30  # mlaconv.conversion.weights_only.LAYER_MEMORY


def memory_model(shape: Shape, rank: int, rope_dim: int, attention_factor: float, calib_windows: int = 0,
                 calib_window: int = 0, calib_batch: int = 4, source_bytes: int = 2) -> dict[str, int]:
    """Bytes held at once in each stage of ``mlaconv convert`` (runtime excluded; output dtype = source dtype).

    Weights only (one-thread operators: OMP_NUM_THREADS=1, or the CLI's own choice on 2 cores):
    embeddings  2·V·H·b: the head (a tied one is the raw embedding) waits for the writer's thread while the
                embedding is read and rescaled in place
    attention   L·[(q+k+v+o)·b + c·(q+k+v+o)·8] + W: L layers factored at once (2 where a layer's float64 working
                set 5·(q+k+v+o)·8 is under 1 GiB, else 1), each its source tensors and the float64 working copies
                and products of convert_attention, c measured on one layer of the shape (``--probe``); W = 64 MiB
                of tensors waiting for the writer's thread
    mlp         F·H·b + W: one matrix at a time, rescaled in place, beside what waits for the writer
    Calibrated: embeddings V·H·b, attention L = 1 and mlp F·H·b, all without W (the writer writes as tensors come)
    calibration adds B·S·H·4 (the hidden states of all windows) + 2·A·S·H·4 (the closed-form and refined models'
                hidden states on the A = min(8, max(1, B/4)) audit windows) + 2·H²·8 (E[xxᵀ] of the fit and the
                audit windows) to every stage; the per-layer
                variant search holds two candidates (the best so far and the next), each as compact factors and
                assembled in float64, 4·M·8 with M the MLA weights' elements, and measures each with both
                layers in float32, (M + q+k+v+o)·4, against the select and audit windows' inputs and source
                outputs, kept for the layer: 2·2A·S·H·4; a stage of its own moves the windows through the layer:
                the layer in float32 (q+k+v+o + max(3·F·H, M))·4, one batch's activations b·S·(3F + 4H)·4
                and the attention-profile scores, computed a few heads at a time: at most max(2²⁵, b·S²)
                of them, ·4·3 (scores, mask, softmax)
    """
    H, N, d, F, V = shape.hidden, shape.heads, shape.head_dim, shape.intermediate, shape.vocab
    attention = attention_elements(shape)
    mla = N * (d + rope_dim) * H + (rank + rope_dim) * H + N * 2 * d * rank + H * N * d
    at_once = 2 if not calib_windows and 5 * attention * 8 <= LAYER_MEMORY else 1
    ahead = 0 if calib_windows else WRITE_AHEAD
    stages = {
        "embeddings": (1 if calib_windows else 2) * V * H * source_bytes,
        "attention": at_once * (attention * source_bytes + int(attention_factor * attention * 8)) + ahead,
        "mlp": F * H * source_bytes + ahead,
    }
    if calib_windows:
        B, S, b = calib_windows, calib_window, min(calib_batch, calib_windows)
        A = min(8, max(1, B // 4))
        kept = B * S * H * 4 + 2 * A * S * H * 4 + 2 * H * H * 8
        stages = {name: value + kept for name, value in stages.items()}
        stages["attention"] += 4 * mla * 8 + (mla + attention) * 4 + 2 * 2 * A * S * H * 4
        stages["calibration forward"] = (kept + mla * 8 + (attention + max(3 * F * H, mla)) * 4
                                         + b * S * (3 * F + 4 * H) * 4
                                         + min(b * N * S * S, max(PROFILE_SCORES, b * S * S)) * 4 * 3)
    return stages


# --- main ------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=WORK / "convert_memory")
    parser.add_argument("--source-shard-size", type=float, default=1.0, help="source shard size in GB (default 1)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each conversion (the fastest is kept)")
    parser.add_argument("--copy-repeats", type=int, default=3, help="runs of each copy (the fastest is kept)")
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--calib-windows", type=int, default=8)
    parser.add_argument("--calib-window", type=int, default=256)
    parser.add_argument("--refined-windows", type=int, default=32,
                        help="calibration windows of the 'refined' run (32: 16 fit windows to train on)")
    parser.add_argument("--skip", default="",
                        help="comma list of runs to skip: copytree,cp,convert,floor,calibrated,refined")
    parser.add_argument("--keep", action="store_true", help="keep the copies and outputs")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--generate", type=Path, help=argparse.SUPPRESS)  # internal: write the checkpoint, exit
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # internal: one attention layer
    args = parser.parse_args()
    if args.generate:
        make_checkpoint(args.generate, LLAMA_32_1B, int(args.source_shard_size * GB))
        return
    if args.probe:
        probe_attention(LLAMA_32_1B, args.rank, args.rope_dim)
        return

    work = args.work.resolve()  # the children run from the repository root (python -m bench.…)
    source = work / "llama-3.2-1b-synthetic"
    calib = work / "calib.jsonl"
    if not (source / "model.safetensors.index.json").is_file():
        print(f"writing the synthetic {LLAMA_32_1B.name} checkpoint to {source} …", file=sys.stderr)
        if source.exists():
            shutil.rmtree(source)
        # in a child process: this one stays small, since a child's peak RSS counts its parent's at fork
        subprocess.run([sys.executable, "-m", __spec__.name, "--generate", str(source), "--source-shard-size",
                        str(args.source_shard_size)], check=True, cwd=REPO)
    make_calibration(calib, LLAMA_32_1B.vocab, args.calib_windows, args.calib_window)
    refined_calib = work / "calib-refined.jsonl"
    make_calibration(refined_calib, LLAMA_32_1B.vocab, args.refined_windows, args.calib_window)
    source_bytes = sum(p.stat().st_size for p in source.iterdir())

    mlaconv = [sys.executable, "-m", "mlaconv", "convert", str(source)]
    weights_only = ["--rank", str(args.rank), "--rope-dim", str(args.rope_dim), "--no-verify", "--force"]
    runs = {
        "copytree": ([sys.executable, "-c", "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])",
                      str(source), str(work / "copytree")], work / "copytree"),
        "cp": (["cp", "-r", str(source), str(work / "cp")], work / "cp"),
        "convert": (mlaconv + [str(work / "out-weights")] + weights_only, work / "out-weights"),
        "calibrated": (mlaconv + [str(work / "out-calibrated")] + weights_only
                       + ["--calib", str(calib), "--calib-window", str(args.calib_window), "--refine-steps", "0"],
                       work / "out-calibrated"),
        "refined": (mlaconv + [str(work / "out-refined")] + weights_only
                    + ["--calib", str(refined_calib), "--calib-window", str(args.calib_window)], work / "out-refined"),
    }
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    results: dict = {}

    def floor_trial(shard_bytes: list[int]) -> dict:
        command = [sys.executable, "-m", "bench.conversion.io_floor", str(source), str(work / "floor"),
                   ",".join(map(str, shard_bytes))]
        return measure(command, work / "floor") | {"command": " ".join(command[:-1]) + " SIZES"}

    floors: list[dict] = []
    for name, (command, target) in runs.items():
        if name in skip:
            continue
        print(f"running {name} …", file=sys.stderr)
        repeats = args.copy_repeats if name in ("copytree", "cp") else args.repeats
        trials = []
        for _ in range(max(1, repeats)):
            trials.append(measure(command, target))
            if name == "convert" and "floor" not in skip:  # in turn with convert, writing its output's shard sizes
                print("running floor …", file=sys.stderr)
                floors.append(floor_trial(shard_data_bytes(target)))
        results[name] = fastest(trials) | {"command": " ".join(command)}
        report_file = target / "mlaconv.json"
        if report_file.is_file():  # what the calibrated runs chose: window sets, refinement plan, written model
            calibration = ConversionReport.from_json(json.loads(report_file.read_text())).calibration
            results[name]["calibration"] = None if calibration is None else {
                "windows": calibration.windows, "window": calibration.window, "refine_steps": calibration.refine_steps,
                "refine_batch": calibration.refine_batch, "refinement": calibration.refinement,
                "window_sets": {k: len(getattr(calibration.window_sets, k)) for k in ("fit", "select", "audit")},
                "written": calibration.whole_model.written}
        if not args.keep and target.exists():
            shutil.rmtree(target)
    if "floor" not in skip and not floors:  # no convert run: the source's own shard sizes
        floors = [floor_trial(shard_data_bytes(source)) for _ in range(max(1, args.repeats))]
    if floors:
        results["floor"] = fastest(floors)
        shutil.rmtree(work / "floor", ignore_errors=True)
    results["runtime"] = measure([sys.executable, "-c", "import mlaconv.cli.convert, mlaconv.conversion.run"])
    probe = subprocess.run([sys.executable, "-m", __spec__.name, "--probe", "--rank", str(args.rank), "--rope-dim",
                            str(args.rope_dim)], check=True, capture_output=True, text=True, cwd=REPO)
    added = json.loads(probe.stdout)["added_peak_bytes"]
    factor = added / (attention_elements(LLAMA_32_1B) * 8)
    results["attention_factor"] = factor

    models = {
        f"{LLAMA_32_1B.name}, weights only": memory_model(LLAMA_32_1B, args.rank, args.rope_dim, factor),
        f"{LLAMA_32_1B.name}, calibrated {args.calib_windows}×{args.calib_window}": memory_model(
            LLAMA_32_1B, args.rank, args.rope_dim, factor, args.calib_windows, args.calib_window),
        f"{LLAMA_3_70B.name}, weights only": memory_model(LLAMA_3_70B, 512, 64, factor),
        f"{LLAMA_3_70B.name}, calibrated {args.calib_windows}×{args.calib_window}": memory_model(
            LLAMA_3_70B, 512, 64, factor, args.calib_windows, args.calib_window),
        f"{LLAMA_3_70B.name}, calibrated with the defaults (32×2048)": memory_model(LLAMA_3_70B, 512, 64, factor,
                                                                                      32, 2048),
    }
    if "convert" in results and "floor" in results:
        results["convert_over_floor"] = results["convert"]["seconds"] / results["floor"]["seconds"]
    if args.json:
        print(json.dumps({"source_bytes": source_bytes, "results": results,
                          "memory_model": {name: stages | {"peak": max(stages.values())}
                                           for name, stages in models.items()}}))
        return
    report(source_bytes, results, models)


def report(source_bytes: int, results: dict, models: dict[str, dict[str, int]]) -> None:
    print(f"source: synthetic {LLAMA_32_1B.name}, bf16, {source_bytes / GB:.2f} GB")
    copy = min((results[n]["seconds"] for n in ("copytree", "cp") if n in results), default=None)
    print(f"{'run':<12} {'wall s':>8} {'× copy':>7} {'peak RSS GB':>12} {'CPU s':>8}  load average (1, 5, 15 min)")
    for name in ("copytree", "cp", "convert", "floor", "calibrated", "refined", "runtime"):
        if name in results:
            r = results[name]
            ratio = f"{r['seconds'] / copy:.2f}" if copy else "-"
            print(f"{name:<12} {r['seconds']:>8.2f} {ratio:>7} {r['peak_rss_bytes'] / GB:>12.2f} {r['cpu_seconds']:>8.1f}"
                  f"  {' '.join(r['loadavg'])}")
    if "convert" in results and "floor" in results:
        c, f = results["convert"], results["floor"]
        print(f"convert / floor: {c['seconds'] / f['seconds']:.2f}× the fastest, "  # the floor moves from trial to trial
              f"{c['median_seconds'] / f['median_seconds']:.2f}× the medians (of {len(c['all_seconds'])} each: convert "
              f"{', '.join(f'{t:.1f}' for t in c['all_seconds'])} s, floor {', '.join(f'{t:.1f}' for t in f['all_seconds'])}"
              f" s), {c['cpu_seconds'] / f['cpu_seconds']:.2f}× CPU; convert's peak RSS in every trial: "
              f"{', '.join(f'{b / GB:.2f}' for b in c['all_peak_rss_bytes'])} GB")
    for name in ("calibrated", "refined"):
        if "calibration" in results.get(name, {}):
            c = results[name]["calibration"]
            print(f"{name}: {c['windows']}×{c['window']} windows {c['window_sets']}; refinement {c['refine_steps']} "
                  f"steps of {c['refine_batch']} ({c['refinement']}); written: {c['written']}")
    runtime = results["runtime"]["peak_rss_bytes"]
    print(f"\nmemory model: bytes held at once per stage (see memory_model), beyond the runtime of {runtime / GB:.2f} GB "
          f"measured above; c = {results['attention_factor']:.2f} float64 copies of the attention weights, measured")
    for name, stages in models.items():
        parts = ", ".join(f"{stage} {value / GB:.2f}" for stage, value in stages.items())
        print(f"  {name}: {parts} GB → peak ≈ {(max(stages.values()) + runtime) / GB:.2f} GB")


if __name__ == "__main__":
    main()
