"""``mlaconv inspect spectra``: what the latent and the shared RoPE key keep, layer by layer, before converting.

For every layer this runs the very analysis ``convert`` runs (``analyse_layer`` with the options of
``layer_options`` and the model-wide stride of ``global_rope_stride``) and reports the spectrum of
the exact matrix the latent truncates: its singular values, the energy kept at chosen ranks, the
rank each energy target needs, and the RoPE energy the shared key keeps. ``convert --rank r`` with
the same settings reports the same ``energy_retained`` per layer.

Weights are read lazily, one layer's attention at a time, so a 70B model fits on a laptop.
"""

from __future__ import annotations

import csv
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from mlaconv import __version__
from mlaconv.convert import (ConvertOptions, Progress, Shapes, _no_progress, global_rope_stride, layer_options,
                             load_source, plan_shapes, read_attention)
from mlaconv.errors import MlaconvError
from mlaconv.mla import rope
from mlaconv.mla.attention import (AttentionShape, LayerAnalysis, LayerStats, SourceAttention, analyse_layer,
                                   full_rank)
from mlaconv.mla.latent_norm import LATENT_NORM_EPS

DEFAULT_ENERGY_TARGETS = (0.9, 0.95, 0.99)
DEFAULT_POWERS_OF_TWO = 6  # default ranks: the 6 largest powers of two below the full rank, and the full rank
ENERGY_TOLERANCE = 1e-12  # a target counts as reached within rounding (target 1.0 → the full rank)


@dataclass
class SpectraOptions:
    """What to measure, and the conversion settings to measure it under (same meaning as in ``convert``)."""

    ranks: list[int] | None = None  # None: ``default_ranks``
    energy_targets: tuple[float, ...] = DEFAULT_ENERGY_TARGETS
    kv_keep: float | None = None  # recommend (R, r) for this budget, as ``convert --kv-keep`` would choose them
    rope_dim: int | None = None
    rope_stride: int | None = None
    query_weighted_rope: bool = False
    kv_balance: float = 1.0
    revision: str | None = None
    allow_sliding_window: bool = False

    def convert_options(self) -> ConvertOptions:
        """The ``convert`` settings these spectra preview (the rank does not enter the analysis)."""
        return ConvertOptions(kv_keep=self.kv_keep, rope_dim=self.rope_dim, rope_stride=self.rope_stride,
                              query_weighted_rope=self.query_weighted_rope, kv_balance=self.kv_balance,
                              revision=self.revision, allow_sliding_window=self.allow_sliding_window)


def default_ranks(full: int) -> list[int]:
    """The largest few powers of two below ``full``, and ``full`` itself (ascending)."""
    powers = [1 << k for k in range(full.bit_length()) if 1 << k < full]
    return powers[-DEFAULT_POWERS_OF_TWO:] + [full]


def rank_for_energy(curve: torch.Tensor, target: float) -> int:
    """The smallest rank whose energy reaches ``target`` (``curve[k-1]`` is the energy at rank k)."""
    reached = (curve >= target - ENERGY_TOLERANCE).nonzero()
    return int(reached[0, 0]) + 1 if len(reached) else len(curve)


def check_output_file(path: Path, suffix: str, option: str) -> None:
    """Refuse, before any work, an output file that cannot be written where the user asked."""
    if path.suffix.lower() != suffix:
        raise MlaconvError(f"{option} {path} must end in {suffix}")
    if not path.parent.is_dir():
        raise MlaconvError(f"{option} {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise MlaconvError(f"{option} {path} is a folder")


def spectra(source: str, options: SpectraOptions, progress: Progress = _no_progress,
            stats_for_layer: Callable[[int, SourceAttention], LayerStats] | None = None) -> dict:
    """Analyse every layer of ``source`` as ``convert`` would; return the report (a JSON-able dict).

    ``stats_for_layer(i, src)`` supplies calibration statistics exactly as in ``convert``; without it
    the spectra are weights-only. The keys are those documented in ``mlaconv inspect spectra --help``.
    """
    started = time.perf_counter()
    _check_targets(options.energy_targets)
    folder, spec, reader = load_source(source, options.revision, options.allow_sliding_window)
    try:
        shape = AttentionShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        settings = options.convert_options()
        recommended = plan_shapes(spec, None, options.kv_keep, options.rope_dim) if options.kv_keep is not None else None
        # Without a budget the rank is irrelevant here: any valid one yields convert's (validated) rope dims.
        shapes = recommended or plan_shapes(spec, 1, None, options.rope_dim)
        full = full_rank(shape, shapes.rope_dim)
        ranks = _ranks(options.ranks, full, recommended)
        if options.rope_stride is not None and options.rope_stride not in rope.strides(spec.head_dim, shapes.rope_dim):
            raise MlaconvError(f"--rope-stride {options.rope_stride} does not fit {shapes.rope_dim} rope dims "
                               f"in head_dim {spec.head_dim}")
        residual_scale = math.sqrt(LATENT_NORM_EPS / spec.rms_norm_eps)
        lopts = layer_options(spec, shapes, settings, residual_scale)
        if lopts.rope_stride is None:
            lopts = replace(lopts, rope_stride=global_rope_stride(reader, spec, shape, lopts, progress))
        layers = []
        for i in progress(range(spec.num_layers), "analysing layers", spec.num_layers):
            src = read_attention(reader, spec, i)
            stats = stats_for_layer(i, src) if stats_for_layer else None
            layers.append(_layer_entry(i, analyse_layer(src, shape, lopts, stats), ranks, options.energy_targets, full))
            del src, stats
    finally:
        reader.close()

    return {
        "mlaconv_version": __version__,
        "source": str(folder),
        "architecture": spec.family.label,
        "mode": "calibrated" if stats_for_layer else "weights-only",
        "settings": {k: v for k, v in asdict(options).items() if k not in ("ranks", "energy_targets")},
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "kv_elements_per_token_per_layer": spec.kv_elements_per_token_per_layer,
        "qk_rope_head_dim": shapes.rope_dim,
        "rope_stride": lopts.rope_stride,
        "matrix_rows": 2 * spec.num_kv_heads * spec.head_dim,
        "full_rank": full,
        "ranks": ranks,
        "energy_targets": list(options.energy_targets),
        "layers": layers,
        "summary": _summary(layers),
        "recommendation": _recommendation(recommended, options.kv_keep, spec.kv_elements_per_token_per_layer,
                                          ranks, layers),
        "seconds": round(time.perf_counter() - started, 3),
    }


def _check_targets(targets: tuple[float, ...]) -> None:
    if not targets:
        raise MlaconvError("--energy needs at least one target")
    for t in targets:
        if not 0 < t <= 1:
            raise MlaconvError(f"--energy targets must be in (0, 1], got {t}")


def _ranks(requested: list[int] | None, full: int, recommended: Shapes | None) -> list[int]:
    if requested is not None:
        if not requested:
            raise MlaconvError("--ranks needs at least one rank")
        for r in requested:
            if not 1 <= r <= full:
                raise MlaconvError(f"--ranks: rank {r} is outside 1..{full} (the full rank of this model's latent)")
    ranks = set(requested if requested is not None else default_ranks(full))
    if recommended is not None:
        ranks.add(recommended.rank)
    return sorted(ranks)


def _layer_entry(i: int, analysis: LayerAnalysis, ranks: list[int], targets: tuple[float, ...], full: int) -> dict:
    """One layer's row of the report; the spectrum is cut at the full rank (what lies beyond is zero)."""
    spectrum, choice = analysis.spectrum, analysis.choice
    singular = spectrum.values[:full].sqrt()
    top = singular[0].item()
    curve = spectrum.energy_curve()[:full]
    needed = [rank_for_energy(curve, t) for t in targets]
    return {
        "layer": i,
        "energy_retained": [spectrum.energy(r) for r in ranks],
        "rank_for_energy": needed,
        "rank_fraction_for_energy": [r / full for r in needed],
        "rope_energy_kept": analysis.rope_energy_kept,
        "rope_energy_kept_per_frequency": choice.energy_kept_per_frequency,
        "rope_loss_weighted_kept": choice.loss_weighted_kept,
        "rope_frequencies": choice.frequencies.tolist(),
        "singular_values": singular.tolist(),
        "normalised_spectrum": (singular / top if top > 0 else torch.zeros_like(singular)).tolist(),
        "energy_curve": curve.tolist(),
    }


def _summary(layers: list[dict]) -> dict:
    def column(key: str) -> list[list[float]]:
        return [list(values) for values in zip(*(layer[key] for layer in layers))]

    rope_kept = [layer["rope_energy_kept"] for layer in layers]
    return {
        "energy_retained_mean": [sum(c) / len(c) for c in column("energy_retained")],
        "energy_retained_min": [min(c) for c in column("energy_retained")],
        "rank_for_energy_mean": [sum(c) / len(c) for c in column("rank_for_energy")],
        "rank_for_energy_max": [max(c) for c in column("rank_for_energy")],
        "rank_fraction_for_energy_mean": [sum(c) / len(c) for c in column("rank_fraction_for_energy")],
        "rope_energy_kept_mean": sum(rope_kept) / len(rope_kept),
        "rope_energy_kept_min": min(rope_kept),
    }


def _recommendation(shapes: Shapes | None, kv_keep: float | None, source_elements: int, ranks: list[int],
                    layers: list[dict]) -> dict | None:
    if shapes is None:
        return None
    column = ranks.index(shapes.rank)
    energy = [layer["energy_retained"][column] for layer in layers]
    return {
        "kv_keep": kv_keep,
        "kv_lora_rank": shapes.rank,
        "qk_rope_head_dim": shapes.rope_dim,
        "kv_elements_per_token_per_layer": shapes.rank + shapes.rope_dim,
        "kv_keep_actual": (shapes.rank + shapes.rope_dim) / source_elements,
        "reason": shapes.reason,
        "energy_retained": energy,
        "energy_retained_mean": sum(energy) / len(energy),
    }


def write_csv(report: dict, path: Path) -> None:
    """One row per layer: energy at each rank, rank for each target, RoPE energy kept."""
    header = (["layer"] + [f"energy_at_rank_{r}" for r in report["ranks"]]
              + [f"rank_for_energy_{t:g}" for t in report["energy_targets"]]
              + ["rope_energy_kept", "rope_loss_weighted_kept", "top_singular_value"])
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for layer in report["layers"]:
            top = layer["singular_values"][0] if layer["singular_values"] else 0.0
            writer.writerow([layer["layer"], *layer["energy_retained"], *layer["rank_for_energy"],
                             layer["rope_energy_kept"], layer["rope_loss_weighted_kept"], top])
