"""``mlaconv convert``: stream a source checkpoint layer by layer into a DeepSeek-V3 MLA checkpoint.

One pass over the source (``pipeline.source_layers``) feeds each layer to a conversion step (``WeightsOnly``, or
``calibrated.CalibratedSteps``) and the step's output to the ``LayerWriter``. Memory: one source tensor group (a
layer's attention or MLP) is in memory at a time, plus the calibration activations when calibrated; the writer
puts each tensor in its shard file as it is added, and the output folder appears only when complete.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Protocol, TypeVar

import torch
import transformers

from mlaconv import __version__
from mlaconv.arch import SourceSpec
from mlaconv.engines import BIASES
from mlaconv.errors import MlaconvError
from mlaconv.evaluate import evaluate_perplexity
from mlaconv.io import ShardedWriter, atomic_output_dir, check_free_space, check_output_target
from mlaconv.io.layout import LayerWriter, copy_tokenizer
from mlaconv.mla.attention import convert_attention
from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.mla.layer import LayerReport, MLAAttention
from mlaconv.model_card import write_model_card
from mlaconv.options import ConvertOptions
from mlaconv.pipeline import SourceLayer, source_layers
from mlaconv.plan import (Plan, Shapes, estimate_output_bytes, eval_source, kv_cache_figures, output_config,
                          output_dtype, plan_conversion, with_rope_stride)
from mlaconv.progress import Progress, no_progress
from mlaconv.report import ConversionReport, EvalReport
from mlaconv.report.conversion import Absorbed, EnergyFigures, KVFigures, LatentNorm, SourceShape, TargetReport
from mlaconv.report.record import Failure
from mlaconv.serving import serving_notes
from mlaconv.targets import target_report


Checked = TypeVar("Checked")


class LayerStep(Protocol):
    """What the layer pass plugs in: each layer's converted attention, one version or several to choose from."""

    def __call__(self, layer: SourceLayer) -> dict[str, MLAAttention]: ...

    def finish(self, progress: Progress) -> str | None:
        """After the last layer: which version of the held layers to write (None: there is only one)."""

    @property
    def reports(self) -> list[LayerReport]:
        """The written layers' reports."""


class WeightsOnly:
    """Each layer converted from its weights alone (``convert_attention``)."""

    def __init__(self, plan: Plan):
        self.plan, self._reports = plan, []

    def __call__(self, layer: SourceLayer) -> dict[str, MLAAttention]:
        mla, report = convert_attention(layer.attention, self.plan.shape, self.plan.layer)
        self._reports.append(report)
        return {"weights-only": mla}

    def finish(self, progress: Progress) -> str | None:
        return None

    @property
    def reports(self) -> list[LayerReport]:
        return self._reports


def convert(source: str, out: str | Path, options: ConvertOptions, progress: Progress = no_progress) -> ConversionReport:
    """Convert ``source`` into an MLA checkpoint at ``out``; return the report (``to_json()``: OUT/mlaconv.json)."""
    started = time.perf_counter()
    out = Path(out)
    plan = plan_conversion(source, options)
    folder, spec, reader = plan.folder, plan.spec, plan.reader
    dtype = output_dtype(spec, options.dtype)
    check_output_target(out, folder, options.force)
    check_free_space(out.parent, estimate_output_bytes(spec, plan.shapes, dtype, options.absorbed))
    streamer = shape_search = None
    if options.calibrated:
        from mlaconv import calibrated

        tokens = calibrated.calibration_tokens(plan, options)
        if options.kv_keep is not None and options.rope_dim is None:  # the split is measured
            plan, shape_search = calibrated.search_shapes(plan, options, tokens, progress)
        streamer = calibrated.calibration_streamer(plan, options, tokens)
        refinement = calibrated.refinement_plan(plan, options, streamer)
    plan = with_rope_stride(plan, progress)
    step: LayerStep = (calibrated.CalibratedSteps(plan, options, streamer, refinement) if streamer else
                       WeightsOnly(plan))
    attention_bias = bool(spec.qkv_bias or spec.o_bias) and plan.layer.biases

    with atomic_output_dir(out, force=options.force) as tmp:
        writer = ShardedWriter(tmp, options.shard_size)  # writes each tensor as it is added
        output = LayerWriter(writer, reader, spec, plan.layer.residual_scale, dtype, attention_bias, tmp / ".pending")
        output.outer()
        for layer in source_layers(reader, spec, streamer, progress, "converting layers"):
            output.layer(layer.index, step(layer))
        chosen = step.finish(progress)
        if chosen is not None:
            output.choose(chosen)
        writer.finish()
        reader.close()

        config, rope_rewrite = output_config(spec, plan.shapes, plan.layer.rope_stride, options.target, attention_bias,
                                             dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = copy_tokenizer(folder, tmp)

        source_id = None if Path(source).expanduser().exists() else source  # a hub id, not a local path
        report = conversion_report(spec, plan.shapes, config, step.reports, out, source_id, folder, dtype,
                                   plan.layer.residual_scale, options, copied,
                                   target_report(options.target, step.reports, rope_rewrite, options.calibrated))
        report.shape_search = shape_search
        if streamer:
            report.mode = "calibrated"
            report.calibration = step.report()
        if options.verify:
            from mlaconv.verify import verify

            report.verify = _after_conversion(
                lambda: verify(folder, tmp, spec, windows=options.verify_windows, window=options.verify_window),
                "the built-in check")
        if options.evaluated:
            report.eval = _after_conversion(lambda: _evaluate(tmp, folder, out, options, progress), "the evaluation")
        if options.absorbed:
            from mlaconv.absorb import write_absorbed

            manifest = write_absorbed(tmp, shard_size=options.shard_size)
            report.absorbed = Absorbed(str(out / "absorbed"), len(manifest["tensors"]),
                                       manifest["latent_norm"]["max_relative_nonlinearity"])
        report.extra = options.extra_report
        (tmp / "mlaconv.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        write_model_card(tmp, report)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _after_conversion(check: Callable[[], Checked], what: str) -> Checked | Failure:
    """Run a check of the finished checkpoint; its failure is reported, never allowed to discard OUT."""
    try:
        return check()
    except MlaconvError as exc:
        return Failure(f"{what} failed: {exc}")
    except Exception as exc:  # a bug in a check must not cost the user the conversion
        return Failure(f"{what} failed unexpectedly: {type(exc).__name__}: {exc}")


def _evaluate(converted: Path, source: Path, out: Path, options: ConvertOptions, progress: Progress) -> EvalReport:
    """``mlaconv eval perplexity`` of the fresh conversion against its source (same code path)."""
    result = evaluate_perplexity(converted, source, source=eval_source(options), window=options.eval_window,
                                 max_windows=options.eval_max_windows, batch_size=options.eval_batch_size,
                                 device=options.device if options.device != "cpu" else None, progress=progress)
    result.model = str(out)
    return result


def conversion_report(spec: SourceSpec, shapes: Shapes, config: dict, reports: list[LayerReport], out: Path,
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
        transformers_version=transformers.__version__,
        output=str(out),
        source=str(source),
        source_id=source_id,
        source_revision=source.name if source.parent.name == "snapshots" else None,
        settings={k: v for k, v in asdict(options).items() if k not in ("extra_report", "force")},
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
        kv_keep=(shapes.rank + shapes.rope_dim) / spec.kv_elements_per_token_per_layer,
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
