"""The stock DeepSeek-V3 checkpoint every baseline of ``bench.baselines.methods`` is written as: a baseline's per-layer
``Factorization`` goes through mlaconv's plumbing (``assemble``) as a ``LayerStep`` (``Baseline``) of a conversion
pipeline the method registers (``mlaconv.conversion.pipelines.register``), through mlaconv's own layer loop and writer
(``write_baseline``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mlaconv.calibration.streamer import CalibrationOptions, SourceStreamer
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipeline import LayerStep, SourceLayer, source_layers
from mlaconv.conversion.plan import Plan, ShapeChoice, layer_options, output_config, plan_shapes, residual_scale
from mlaconv.conversion.run import choose, write_layers
from mlaconv.devices import DTYPES
from mlaconv.io import atomic_output_dir
from mlaconv.mla.attention import scale_input
from mlaconv.mla.latent_norm import DEFAULT_DELTA, tiny_latent
from mlaconv.mla.layer import AttentionShape, LayerReport, MLAAttention, SourceAttention
from mlaconv.source.spec import SourceSpec, load_source
from mlaconv.target.layout import copy_tokenizer
from mlaconv.target.targets import target

WRITTEN_DTYPES = {name: DTYPES[name] for name in ("float32", "bfloat16")}  # the dtypes a baseline writes


@dataclass
class Factorization:
    """One layer in the DeepSeek key layout, before the stock plumbing (all float64, source coordinates).

    Scores become q_nope·k_nope + q_rope·k_rope with q_nope the source query, k_nope = up_k·c for the
    head's KV group, and c = down·x the cached latent.
    """

    q_rope: torch.Tensor  # [N, R, H] rope rows of each query head (interleaved pairs), before the scale fix
    k_rope: torch.Tensor  # [R, H] the shared rope key (interleaved pairs)
    k_rope_bias: torch.Tensor | None  # [R]
    down: torch.Tensor  # [r, H]
    up_k: torch.Tensor  # [n_kv, d, r] NoPE key of each KV head
    up_v: torch.Tensor  # [n_kv, d, r] value of each KV head


def assemble(src: SourceAttention, shape: AttentionShape, f: Factorization, residual_scale: float,
             delta: float = DEFAULT_DELTA) -> tuple[MLAAttention, list[str]]:
    """The stock tensors for one layer (mlaconv's plumbing) → (weights, bias terms no tensor can hold)."""
    N, G, d = shape.heads, shape.kv_heads, shape.head_dim
    R, r = f.k_rope.shape[0], f.down.shape[0]
    group_of_head = torch.arange(N) // shape.group
    gamma = src.input_norm.double()

    typical_rms = math.sqrt(max(((f.down * gamma) ** 2).sum().item(), 0.0) / r)
    tiny = tiny_latent(f.down, gamma, typical_rms, delta=delta)
    q = torch.cat([src.q.double().reshape(N, d, -1), f.q_rope], dim=1).reshape(N * (d + R), -1)
    kv_b = torch.stack([f.up_k, f.up_v], dim=1)[group_of_head].reshape(N * 2 * d, r)  # per head: d key, d value rows

    dropped = ["q_proj.bias"] if src.q_bias is not None and src.q_bias.abs().max() > 0 else []
    kv_a_bias = None
    if src.k_bias is not None:  # the NoPE part of a key bias adds q·b to every score of a query: softmax drops it
        kv_a_bias = torch.cat([torch.zeros(r, dtype=torch.float64), f.k_rope_bias])
    o_bias = None
    if src.v_bias is not None or src.o_bias is not None:  # Σ softmax = 1: a value bias adds W_o·b_v
        o_bias = torch.zeros(src.o.shape[0], dtype=torch.float64)
        if src.v_bias is not None:
            o_bias += src.o.double() @ src.v_bias.double().reshape(G, d)[group_of_head].reshape(N * d)
        if src.o_bias is not None:
            o_bias += src.o_bias.double()
        o_bias *= residual_scale
    mla = MLAAttention(
        q_proj=q * math.sqrt((d + R) / d),
        kv_a_proj=torch.cat([tiny.beta * f.down, f.k_rope]),
        kv_a_norm=torch.full((r,), tiny.norm_weight, dtype=torch.float64),
        kv_b_proj=kv_b * tiny.up_scale,
        o_proj=src.o.double() * residual_scale,
        input_norm=gamma,
        kv_a_bias=kv_a_bias,
        o_bias=o_bias,
    )
    return scale_input(mla, r, gamma**2), dropped


class Baseline(LayerStep):
    """A baseline as the ``LayerStep`` mlaconv's conversion plugs in: layer i is ``factorize(i, attention)`` in the
    stock plumbing (``assemble``); the attention is the checkpoint's own, or ``layers[i]`` when given."""

    def __init__(self, spec: SourceSpec, factorize: Callable[[int, SourceAttention], Factorization],
                 layers: list[SourceAttention] | None = None):
        self.shape, self.residual_scale = spec.attention_shape, residual_scale(spec)
        self.factorize, self.layers = factorize, layers
        self.dropped: set[str] = set()  # bias terms no tensor can hold
        self.reports: list[LayerReport] = []

    def __call__(self, layer: SourceLayer) -> dict[str, MLAAttention]:
        src = layer.attention if self.layers is None else self.layers[layer.index]
        mla, dropped = assemble(src, self.shape, self.factorize(layer.index, src), self.residual_scale)
        self.dropped.update(dropped)
        return {"baseline": mla}


def baseline_plan(source: str | Path, shapes: ShapeChoice, stride: int, dtype: str) -> Plan:
    """The plan a baseline of ``source`` is written by: ``shapes`` at rope ``stride`` in ``dtype``, laid out as
    ``convert --target transformers`` lays it out (biases kept, the source's rope scaling)."""
    folder, spec, reader = load_source(str(source))
    options = ConvertOptions(rank=shapes.rank, rope_dim=shapes.rope_dim, rope_stride=stride, dtype=dtype,
                             weights_only=True, target="transformers")
    chosen = target(options.target)
    return Plan(options, folder, spec, reader, chosen, shapes, layer_options(spec, shapes, options, chosen),
                WRITTEN_DTYPES[dtype])


def write_baseline(method: str, plan: Plan, out: str | Path, started: float, *inputs, **extra) -> dict:
    """Write ``out`` with the baseline pipeline registered as ``method`` (made from ``plan`` and ``inputs``) through
    mlaconv's own layer pass and writer; return the report (also baseline.json), ``extra`` added to it."""
    pipeline = choose(plan, method)(plan, *inputs)
    shapes, stride = plan.shapes, plan.layer.rope_stride
    with atomic_output_dir(Path(out), force=True) as tmp:
        write_layers(tmp, pipeline)
        config, _ = output_config(plan.spec, shapes, stride, plan.target, plan.attention_bias, plan.dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer(plan.folder, tmp)
        report = {
            "method": pipeline.name, "source": str(plan.folder), "kv_lora_rank": shapes.rank,
            "qk_rope_head_dim": shapes.rope_dim, "kv_keep": shapes.cache_elements / plan.shape.cache_elements,
            "rope_stride": stride, "dropped_bias": sorted(pipeline.step.dropped), **extra,
            "seconds": round(time.perf_counter() - started, 2),
        }
        (tmp / "baseline.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def plan_baseline(source: str | Path, rank: int | None, kv_keep: float | None,
                  rope_dim: int | None) -> tuple[SourceSpec, ShapeChoice]:
    """(spec, shapes from ``plan_shapes``) of a source folder."""
    _, spec, reader = load_source(str(source))
    reader.close()
    return spec, plan_shapes(spec, rank, kv_keep, rope_dim)


def read_layers(source: str | Path, stand_in_ids: torch.Tensor | None = None) -> list[SourceAttention]:
    """Every layer's attention; with ``stand_in_ids`` [n, w], each QK-normed one replaced by mlaconv's least-squares
    linear stand-in fitted on them."""
    _, spec, reader = load_source(str(source))
    streamer = SourceStreamer(reader, spec, CalibrationOptions(stand_in_ids)) if stand_in_ids is not None else None
    layers = [layer.attention if streamer is None else layer.linear for layer in source_layers(reader, spec, streamer)]
    reader.close()
    return layers
