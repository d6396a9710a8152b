"""The ``ConversionReport`` of a finished conversion, built in one place from typed parts: its top-level figures from
the plan and the written layers' ``LayerReport``s, the pipeline's own sections (``PipelineSections``), the serving
target's, and the sections of the steps after the layers (``Sections``)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import asdict, dataclass
from pathlib import Path

from mlaconv import __version__
from mlaconv.conversion.pipelines import Pipeline
from mlaconv.conversion.plan import calibration_description, kv_cache_figures
from mlaconv.evaluate.verdict import conversion_verdict
from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.report import ConversionReport, EvalReport, RetrievalReport
from mlaconv.report.conversion import (Absorbed, EnergyFigures, HealReport, KVFigures, LatentNorm, SourceShape,
                                       Verification)
from mlaconv.report.record import Failure
from mlaconv.target.engines import BIASES
from mlaconv.target.serving import serving_notes
from mlaconv.target.targets import target_report


@dataclass(frozen=True)
class Sections:
    """What the steps after the layers add to the report (each None where it did not run); a step that failed is its
    ``Failure``."""

    heal: HealReport | Failure | None = None
    verify: Verification | Failure | None = None
    eval: EvalReport | Failure | None = None
    retrieval: RetrievalReport | Failure | None = None
    absorbed: Absorbed | None = None


def conversion_report(pipeline: Pipeline, config: dict, rope_rewrite: dict | None, out: Path, given: str,
                      copied: list[str], sections: Sections) -> ConversionReport:
    """The report of ``pipeline``'s conversion of ``given`` (a path, or a hub id) into ``out``: the figures of its plan
    and written layers, its own sections, the serving target's (with the ``rope_rewrite`` the output's config made),
    the ``sections`` of the steps after the layers and the verdict they give."""
    plan, reports, own = pipeline.plan, pipeline.step.reports, pipeline.sections()
    spec, shapes, source, options, dtype = plan.spec, plan.shapes, plan.folder, plan.options, plan.dtype
    kv = kv_cache_figures(spec, shapes, dtype)
    energy = [r.energy_retained for r in reports]
    rope_kept = [r.rope_energy_kept for r in reports]
    dropped = sorted({b for r in reports for b in r.dropped_bias} - set(BIASES))  # no stack holds these; the
    # biases a target leaves out are in the report's target
    recipe = str(options.recipe.path) if options.recipe is not None else None
    return ConversionReport(
        mlaconv_version=__version__,
        transformers_version=importlib.metadata.version("transformers"),
        output=str(out),
        source=str(source),
        source_id=None if Path(given).expanduser().exists() else given,  # a hub id, not a local path
        source_revision=source.name if source.parent.name == "snapshots" else None,
        settings={k: v for k, v in asdict(options).items() if k != "force"} | {"recipe": recipe},
        architecture=spec.family.label,
        source_shape=SourceShape(spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                 spec.rotary_dim, [i for i, rotated in enumerate(spec.rope_layers) if not rotated]),
        recipe=recipe,
        mode=pipeline.name,
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
        residual_scale=plan.layer.residual_scale,
        source_rms_norm_eps=spec.rms_norm_eps,
        dropped_bias=dropped,
        tokenizer_files=copied,
        serving=serving_notes(spec, config, dropped),
        target=target_report(plan.target, reports, rope_rewrite, plan.calibrated),
        shape_search=own.shape_search,
        calibration_data=calibration_description(plan),
        calibration=own.calibration,
        verify=sections.verify,
        eval=sections.eval,
        retrieval=sections.retrieval,
        verdict=conversion_verdict(sections.verify, sections.eval),
        heal=sections.heal,
        absorbed=sections.absorbed,
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
