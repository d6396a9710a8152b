"""Decode latency of ONE attention layer at long context: source KV cache vs MLA, expanded vs absorbed.

For a 7B-shaped layer (random weights, batch 1) and a context of T tokens, one decode step takes the
new token's hidden state x [1, 1, H], appends its cache entry at position T−1 and attends all T tokens:

  (a) source    GQA/MHA with its full cache K, V [n_kv, T, d] (SDPA)          reads 2·n_kv·d·T values
  (b) expanded  MLA as transformers runs it: per-head K/V rebuilt from the   reads (r+R)·T values but
                latent cache with kv_b_proj every step, then SDPA           computes N·(P+V)·r·T MACs
  (c) absorbed  MLA on the latent cache with the absorbed weights of        reads (r+R)·T values
                ``mlaconv.target.absorb`` (q_latent [N, r, H], o_latent [H, N·r])
  (c′) factored the same attention on the latent, but W^UK / W^UV applied as per-head products at run
                time (vLLM's layout), from q_proj, kv_b_proj and o_proj: fewer weight bytes when r > P

The ideal speedup of (c) over (a) is the ratio of cache bytes read per token. Each timed step is
"cold" by default: a buffer twice the last-level cache is written before it, as in a real model
where the other layers' weights and caches pass through the cache between two steps of a layer.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from mlaconv.devices import DTYPES
from mlaconv.errors import MlaconvError
from mlaconv.mla.layer import AttentionShape, MLAAttention, MLAShape
from mlaconv.mla.rope import rope_cos_sin, rotate_half, rotate_interleaved
from mlaconv.progress import Progress, no_progress
from mlaconv.runtime.attention import (absorbed_attention, attend_latent, expanded_attention, latent_rows,
                                       standard_latent_rows)
from mlaconv.target.absorb import absorb_attention

TIMED_DTYPES = {name: DTYPES[name] for name in ("float32", "bfloat16")}  # the dtypes timed
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
ROPE_THETA = 10000.0


SHAPES = {  # name: (label, the source layer's shape)
    "llama2-7b": ("Llama-2-7B MHA", AttentionShape(4096, 32, 32, 128)),
    "llama3-8b": ("Llama-3-8B GQA", AttentionShape(4096, 32, 8, 128)),
}
# Both convert to the FlashMLA shape: r = 512, R = 64, P = V = d = 128.
MLA_SHAPE = MLAShape(hidden=4096, heads=32, rank=512, rope_dim=64, nope_dim=128, v_dim=128)


def _randn(*size: int, dtype: torch.dtype, device: str, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*size, generator=generator) * scale).to(device=device, dtype=dtype)


class SourceDecodeLayer:
    """(a) Llama attention at decode: q/k/v projections, rotate-half RoPE, full K/V cache, SDPA, o_proj."""

    def __init__(self, shape: AttentionShape, context: int, dtype: torch.dtype, device: str, generator: torch.Generator):
        H, N, G, d = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
        w = H**-0.5
        self.shape = shape
        self.wq = _randn(N * d, H, dtype=dtype, device=device, generator=generator, scale=w)
        self.wk = _randn(G * d, H, dtype=dtype, device=device, generator=generator, scale=w)
        self.wv = _randn(G * d, H, dtype=dtype, device=device, generator=generator, scale=w)
        self.wo = _randn(H, N * d, dtype=dtype, device=device, generator=generator, scale=w)
        self.keys = _randn(1, G, context, d, dtype=dtype, device=device, generator=generator)  # [1, n_kv, T, d]
        self.values = _randn(1, G, context, d, dtype=dtype, device=device, generator=generator)
        freqs = ROPE_THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        self.cos, self.sin = (t.to(device) for t in rope_cos_sin(torch.tensor([context - 1]), freqs, dtype))  # [1, d/2]
        self.query = _randn(1, N, 1, d, dtype=dtype, device=device, generator=generator)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        return rotate_half(x, self.cos, self.sin)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        N, G, d = s.heads, s.kv_heads, s.head_dim
        q = self._rope(F.linear(x, self.wq).view(1, 1, N, d).transpose(1, 2))  # [1, N, 1, d]
        k = self._rope(F.linear(x, self.wk).view(1, 1, G, d).transpose(1, 2))  # [1, n_kv, 1, d]
        self.keys[:, :, -1:] = k
        self.values[:, :, -1:] = F.linear(x, self.wv).view(1, 1, G, d).transpose(1, 2)
        out = self.core(q)  # [1, N, 1, d]
        return F.linear(out.transpose(1, 2).reshape(1, 1, N * d), self.wo)

    def core(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, self.keys, self.values, enable_gqa=self.shape.kv_heads != self.shape.heads)

    def core_step(self) -> torch.Tensor:
        return self.core(self.query)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wq, self.wk, self.wv, self.wo))

    def core_flops(self) -> int:
        """q·k and p·v over T cached tokens: 2 FLOPs per multiply-add, N·d of each per token."""
        return 4 * self.shape.heads * self.shape.head_dim * self.keys.shape[2]

    def cache_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


def random_mla_weights(shape: MLAShape, generator: torch.Generator) -> MLAAttention:
    """A random DeepSeek-V3 layer (float32); timings do not depend on the values, only on the shapes."""
    H, N, r, R, P, V = shape.hidden, shape.heads, shape.rank, shape.rope_dim, shape.nope_dim, shape.v_dim
    w = H**-0.5
    return MLAAttention(
        q_proj=torch.randn(N * (P + R), H, generator=generator) * w,
        kv_a_proj=torch.randn(r + R, H, generator=generator) * w,
        kv_a_norm=torch.full((r,), 1e-3),  # w/√ε = 1: the absorbed latent keeps the O(1) scale of c
        kv_b_proj=torch.randn(N * (P + V), r, generator=generator) * r**-0.5,
        o_proj=torch.randn(H, N * V, generator=generator) * (N * V) ** -0.5,
        input_norm=torch.ones(H),
    )


class MLALayers:
    """(b), (c) and (c′) for one MLA layer, sharing its random weights and latent cache."""

    def __init__(self, shape: MLAShape, std: MLAAttention, context: int, dtype: torch.dtype, device: str,
                 generator: torch.Generator):
        N, r, R, P, V = shape.heads, shape.rank, shape.rope_dim, shape.nope_dim, shape.v_dim
        self.shape = shape
        self.standard = MLAAttention(**{k: (t.to(device=device, dtype=dtype) if t is not None else None)
                                             for k, t in vars(std).items()})
        self.absorbed = absorb_attention(std, shape).to(dtype, device)
        kv_b = self.standard.kv_b_proj.view(N, P + V, r)
        self.up_key = kv_b[:, :P].contiguous()  # W^UK [N, P, r]
        self.up_value_t = kv_b[:, P:].transpose(1, 2).contiguous()  # W^UVᵀ [N, r, V]
        self.cache = _randn(1, context, r + R, dtype=dtype, device=device, generator=generator)  # [1, T, r+R]
        inv_freq = ROPE_THETA ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
        self.cos, self.sin = (t.to(device) for t in rope_cos_sin(torch.tensor([context - 1]), inv_freq, dtype))
        self.query = _randn(1, N, 1, r + R, dtype=dtype, device=device, generator=generator)

    def expanded_step(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[:, -1:] = standard_latent_rows(self.standard, x, self.cos, self.sin, self.shape, linear_norm=False)
        return expanded_attention(self.standard, x, self.cache, self.cos, self.sin, self.shape)

    def absorbed_step(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[:, -1:] = latent_rows(self.absorbed, x, self.cos, self.sin, self.shape.rank)
        return absorbed_attention(self.absorbed, x, self.cache, self.cos, self.sin, self.shape)

    def factored_step(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        N, r, R, P = s.heads, s.rank, s.rope_dim, s.nope_dim
        self.cache[:, -1:] = latent_rows(self.absorbed, x, self.cos, self.sin, r)
        q = F.linear(x, self.standard.q_proj).view(N, P + R)  # [N, P+R]
        q_latent = torch.bmm(q[:, None, :P], self.up_key)  # [N, 1, r]
        query = torch.cat([q_latent[:, 0], rotate_interleaved(q[:, P:], self.cos, self.sin)], dim=-1)
        o_latent = attend_latent(query.view(1, N, 1, r + R), self.cache, r, s.softmax_scale)  # [1, N, 1, r]
        values = torch.bmm(o_latent.view(N, 1, r), self.up_value_t)  # [N, 1, V]
        return F.linear(values.reshape(1, 1, -1), self.standard.o_proj)

    def core_step(self) -> torch.Tensor:
        return attend_latent(self.query, self.cache, self.shape.rank, self.shape.softmax_scale)

    def weight_bytes(self, variant: str) -> int:
        tensors = {
            "expanded": [self.standard.q_proj, self.standard.kv_a_proj, self.standard.kv_b_proj, self.standard.o_proj],
            "absorbed": list(self.absorbed.tensors().values()),
            "factored": [self.standard.q_proj, self.standard.kv_a_proj, self.standard.kv_b_proj, self.standard.o_proj],
        }[variant]
        return sum(t.numel() * t.element_size() for t in tensors)

    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def core_flops(self) -> int:
        """Scores N·(r+R) and output N·r multiply-adds per cached token, 2 FLOPs each."""
        s = self.shape
        return 2 * s.heads * (2 * s.rank + s.rope_dim) * self.cache.shape[1]


def last_level_cache_bytes(device: str) -> int:
    """L2 of the GPU, or the largest CPU cache the kernel reports (256 MiB when unknown)."""
    if device.startswith("cuda"):
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20))
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        factor = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * factor)
    return max(sizes) if sizes else 256 * 2**20


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class Timer:
    """Median time of several callables after warm-up, timed round-robin so that a drifting machine
    load hits them alike; optionally with the caches flushed before each call.

    The ``wall`` clock is the latency a user sees. The ``cpu`` clock (this process's CPU time) leaves
    out the time other processes held the cores: on a shared machine, with one thread, it estimates
    the latency of an idle core (memory-bandwidth contention still counts).
    """

    def __init__(self, device: str, repeats: int, warmup: int, cold: bool, clock: str = "wall"):
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.clock = CLOCKS[clock]
        self.flush_buffer = (torch.empty(2 * last_level_cache_bytes(device) // 4, device=device) if cold else None)

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def medians(self, steps: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
        """Median seconds of each callable."""
        times: dict[str, list[float]] = {name: [] for name in steps}
        with torch.inference_mode():
            for i in range(self.warmup + self.repeats):
                for name, step in steps.items():
                    if self.flush_buffer is not None:
                        self.flush_buffer.fill_(float(i))
                    self._sync()
                    start = self.clock()
                    step()
                    self._sync()
                    if i >= self.warmup:
                        times[name].append(self.clock() - start)
        return {name: statistics.median(values) for name, values in times.items()}


@dataclass(frozen=True)
class BenchOptions:
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    shapes: tuple[str, ...] = tuple(SHAPES)
    dtypes: tuple[str, ...] = tuple(TIMED_DTYPES)
    devices: tuple[str, ...] | None = None  # default: cpu, and cuda when present
    repeats: int = 5
    warmup: int = 1
    cold: bool = True
    clock: str = "wall"  # or "cpu" (see Timer)
    threads: int | None = None  # torch threads; default: torch's choice (the core count)
    expanded: bool = True  # (b) is by far the slowest: it rebuilds N·(P+V)·T values every step
    seed: int = 0


def run_decode_bench(options: BenchOptions, progress: Progress = no_progress) -> dict:
    """Time every (device, dtype, context, shape); return ``{"environment": …, "rows": [...]}`` (JSON-able).

    For one (device, dtype, context) every variant is built first and then timed round-robin. The MLA
    layer is the same for both source shapes (r = 512, R = 64, P = V = 128, N = 32, H = 4096).
    """
    devices = options.devices or (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    if options.clock == "cpu" and any(d.startswith("cuda") for d in devices):
        raise MlaconvError("the cpu clock cannot time CUDA kernels; use the wall clock with --devices cuda")
    if options.threads is not None:
        torch.set_num_threads(options.threads)

    def settings():
        for device in devices:
            timer = Timer(device, options.repeats, options.warmup, options.cold, options.clock)
            for dtype_name in options.dtypes:
                generator = torch.Generator().manual_seed(options.seed)
                std = random_mla_weights(MLA_SHAPE, generator)
                for context in options.contexts:
                    yield timer, device, dtype_name, generator, std, context

    rows = []
    total = len(devices) * len(options.dtypes) * len(options.contexts)
    for timer, device, dtype_name, generator, std, context in progress(settings(), "timing decode steps", total):
        dtype = TIMED_DTYPES[dtype_name]
        mla = MLALayers(MLA_SHAPE, std, context, dtype, device, generator)
        sources = {name: SourceDecodeLayer(SHAPES[name][1], context, dtype, device, generator)
                   for name in options.shapes}
        x = _randn(1, 1, MLA_SHAPE.hidden, dtype=dtype, device=device, generator=generator)
        steps = {"absorbed": lambda: mla.absorbed_step(x), "factored": lambda: mla.factored_step(x),
                 "absorbed_core": mla.core_step}
        if options.expanded:
            steps["expanded"] = lambda: mla.expanded_step(x)
        for name, source in sources.items():
            steps[name] = lambda source=source: source.step(x)
            steps[name + "_core"] = source.core_step
        times = timer.medians(steps)
        for name, source in sources.items():
            rows.append(_row(name, SHAPES[name][0], device, dtype_name, context, source, mla, times))
        del mla, sources, steps
    return {"environment": environment(devices, options), "rows": rows}


def _row(shape_name: str, label: str, device: str, dtype_name: str, context: int, source: SourceDecodeLayer,
         mla: MLALayers, times: dict[str, float]) -> dict:
    ideal = source.cache_bytes() / mla.cache_bytes()
    speedup = times[shape_name] / times["absorbed"]
    core_speedup = times[shape_name + "_core"] / times["absorbed_core"]
    return {
        "shape": shape_name, "label": label, "device": device, "dtype": dtype_name, "context": context,
        "cache_bytes_read_per_token": {"source": source.cache_bytes(), "mla": mla.cache_bytes()},
        "weight_bytes": {"source": source.weight_bytes(),
                         **{variant: mla.weight_bytes(variant) for variant in ("expanded", "absorbed", "factored")}},
        "ms": {"source": times[shape_name] * 1e3,
               "expanded": times["expanded"] * 1e3 if "expanded" in times else None,
               "absorbed": times["absorbed"] * 1e3, "factored": times["factored"] * 1e3},
        "core_ms": {"source": times[shape_name + "_core"] * 1e3, "absorbed": times["absorbed_core"] * 1e3},
        "core_gflop_per_s": {"source": source.core_flops() / times[shape_name + "_core"] / 1e9,
                             "absorbed": mla.core_flops() / times["absorbed_core"] / 1e9},
        "core_cache_gb_per_s": {"source": source.cache_bytes() / times[shape_name + "_core"] / 1e9,
                                "absorbed": mla.cache_bytes() / times["absorbed_core"] / 1e9},
        "ideal_speedup": ideal,
        "speedup_absorbed": speedup,
        "fraction_of_ideal": speedup / ideal,
        "speedup_factored": times[shape_name] / times["factored"],
        "core_speedup": core_speedup,
        "core_fraction_of_ideal": core_speedup / ideal,
    }


def environment(devices: tuple[str, ...], options: BenchOptions) -> dict:
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "devices": list(devices), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "last_level_cache_bytes": {d: last_level_cache_bytes(d) for d in devices},
        "cold": options.cold, "clock": options.clock, "repeats": options.repeats, "warmup": options.warmup,
        "mla_shape": vars(MLA_SHAPE),
    }

