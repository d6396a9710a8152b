"""The ``ConversionReport`` of a finished conversion: its top-level figures, from the plan and the written layers'
``LayerReport``s (``conversion.run.convert`` adds the optional sections)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import asdict
from pathlib import Path

import torch

from mlaconv import __version__
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.plan import ShapeChoice, kv_cache_figures
from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.mla.layer import LayerReport
from mlaconv.report import ConversionReport
from mlaconv.report.conversion import EnergyFigures, KVFigures, LatentNorm, SourceShape, TargetReport
from mlaconv.source.spec import SourceSpec
from mlaconv.target.engines import BIASES
from mlaconv.target.serving import serving_notes


def conversion_report(spec: SourceSpec, shapes: ShapeChoice, config: dict, reports: list[LayerReport], out: Path,
                      source_id: str | None, source: Path, dtype: torch.dtype, residual_scale: float,
                      options: ConvertOptions, copied: list[str], target: TargetReport) -> ConversionReport:
    """The report's top-level figures of the written layers (``reports``); the optional sections come after."""
    kv = kv_cache_figures(spec, shapes, dtype)
    energy = [r.energy_retained for r in reports]
    rope_kept = [r.rope_energy_kept for r in reports]
    dropped = sorted({b for r in reports for b in r.dropped_bias} - set(BIASES))  # no stack holds these; the
    # biases a target leaves out are in the report's target
    return ConversionReport(
        mlaconv_version=__version__,
        transformers_version=importlib.metadata.version("transformers"),
        output=str(out),
        source=str(source),
        source_id=source_id,
        source_revision=source.name if source.parent.name == "snapshots" else None,
        settings={k: v for k, v in asdict(options).items() if k not in ("force", "recipe_applied")},
        architecture=spec.family.label,
        source_shape=SourceShape(spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                 spec.rotary_dim, [i for i, rotated in enumerate(spec.rope_layers) if not rotated]),
        recipe=options.recipe,
        mode="weights-only",
        dtype=str(dtype).replace("torch.", ""),
        kv_lora_rank=shapes.rank,
        qk_rope_head_dim=shapes.rope_dim,
        qk_nope_head_dim=spec.head_dim,
        v_head_dim=spec.head_dim,
        shape_choice=shapes.reason,
        rope_theta=config["rope_theta"],
        rope_stride=reports[0].rope_stride,
        kv_elements_per_token_per_layer=KVFigures(**kv["elements_per_token_per_layer"]),
        kv_bytes_per_token=KVFigures(**kv["bytes_per_token"]),
        kv_keep=shapes.cache_elements / spec.attention_shape.cache_elements,
        energy_retained=EnergyFigures(energy, _mean(energy)),
        rope_energy_kept=rope_kept,
        rope_energy_kept_mean=_mean(rope_kept),
        rope_energy_kept_per_frequency=[r.rope_energy_kept_per_frequency for r in reports],
        rope_loss_weighted_kept=[r.rope_loss_weighted_kept for r in reports],
        key_error=[r.key_error for r in reports],
        attention_error=[r.attention_error for r in reports],
        layer_variant=[r.variant for r in reports],
        value_error=[r.value_error for r in reports],
        objective_retained=[r.objective_retained for r in reports],
        latent_norm=LatentNorm(LATENT_NORM_EPS, options.delta, max(r.latent_bound for r in reports)),
        residual_scale=residual_scale,
        source_rms_norm_eps=spec.rms_norm_eps,
        dropped_bias=dropped,
        tokenizer_files=copied,
        serving=serving_notes(spec, config, dropped),
        target=target,
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
