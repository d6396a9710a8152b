"""``mlaconv convert``: stream a source checkpoint layer by layer into a DeepSeek-V3 MLA checkpoint.

One pass over the source (``pipeline.source_layers``) feeds each layer to the conversion step of the pipeline
``choose`` picks (``weights_only.WeightsOnlyPipeline``, or ``calibrated.CalibratedPipeline``; the bench baselines
register theirs) and the step's output to the ``LayerWriter`` (``write_layers``); then the steps after the layers
(heal, check, evaluation) and the report (``report.conversion_report``). Memory: one source tensor group (a layer's
attention or MLP) is in memory at a time, plus the calibration activations when calibrated; the writer puts each
tensor in its shard file as it is added (a tensor that passes unchanged is copied there from the source file unread,
``LayerWriter``), and the output folder appears only when complete. Weights only with a spare core
(``weights_only.spare_core``), the writer's own thread writes while the layers are factored (up to
``weights_only.WRITE_AHEAD_BYTES`` waiting): the same bytes, sooner.
"""

from __future__ import annotations

import json
import time
from contextlib import closing
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from mlaconv.conversion.calibrated import CalibratedPipeline
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipeline import LayerStep, SourceLayer, source_layers
from mlaconv.conversion.pipelines import PIPELINES, Pipeline
from mlaconv.conversion.plan import (Plan, estimate_output_bytes, eval_source, output_config, plan_conversion,
                                     served_context)
from mlaconv.conversion.report import Sections, conversion_report
from mlaconv.conversion.weights_only import WeightsOnlyPipeline
from mlaconv.errors import MlaconvError
from mlaconv.evaluate.perplexity import evaluate_perplexity
from mlaconv.io import ShardedWriter, atomic_output_dir, check_free_space, check_output_target
from mlaconv.progress import Progress, no_progress
from mlaconv.report import ConversionReport, EvalReport
from mlaconv.report.conversion import Absorbed
from mlaconv.report.record import Failure
from mlaconv.target.layout import LayerWriter, copy_tokenizer
from mlaconv.target.model_card import write_model_card

HEAL_PER_CALIBRATION_TOKEN = 4  # a conversion's default healing: at most this many tokens per calibration token


Checked = TypeVar("Checked")


def convert(source: str, out: str | Path, options: ConvertOptions, progress: Progress = no_progress) -> ConversionReport:
    """Convert ``source`` into an MLA checkpoint at ``out``; return the report (``to_json()``: OUT/mlaconv.json).

    Weights only on 2 cores, torch runs one-thread operators during the layer pass unless ``OMP_NUM_THREADS`` is set
    (``weights_only.weights_only_operators``); its thread count comes back afterwards."""
    started = time.perf_counter()
    out = Path(out)
    plan = plan_conversion(source, options)
    check_output_target(out, plan.folder, options.force)
    check_free_space(out.parent, estimate_output_bytes(plan.spec, plan.shapes, plan.dtype, options.absorbed))
    pipeline = choose(plan)(plan, progress)
    plan = pipeline.plan
    with atomic_output_dir(out, force=options.force) as tmp:
        write_layers(tmp, pipeline, progress)
        config, rope_rewrite = output_config(plan.spec, plan.shapes, plan.layer.rope_stride, plan.target,
                                             plan.attention_bias, plan.dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = copy_tokenizer(plan.folder, tmp)
        sections = after_layers(tmp, out, plan, progress)
        report = conversion_report(pipeline, config, rope_rewrite, out, source, copied, sections)
        (tmp / "mlaconv.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        write_model_card(tmp, report)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def choose(plan: Plan, name: str | None = None) -> type[Pipeline]:
    """The pipeline registered as ``name`` (the bench's baselines register theirs); without a name, the plan's own:
    calibrated where it has calibration data, else weights-only."""
    if name is not None:
        return PIPELINES[name]
    return CalibratedPipeline if plan.calibrated else WeightsOnlyPipeline


def write_layers(tmp: Path, pipeline: Pipeline, progress: Progress = no_progress) -> None:
    """The checkpoint's tensors into shards in ``tmp``, each layer converted by ``pipeline``; then the source is
    closed."""
    plan = pipeline.plan
    with pipeline.layer_pass() as write_ahead:
        with ShardedWriter(tmp, plan.options.shard_size, write_ahead=write_ahead) as writer:
            output = LayerWriter(writer, plan.reader, plan.spec, plan.layer.residual_scale, plan.dtype,
                                 plan.attention_bias, tmp / ".pending")
            layers = source_layers(plan.reader, plan.spec, pipeline.streamer, progress, "converting layers")
            write_tensors(output, layers, pipeline.step, progress)
            writer.finish()
    plan.reader.close()


def write_tensors(output: LayerWriter, layers: Iterable[SourceLayer], step: LayerStep,
                  progress: Progress = no_progress) -> None:
    """Every tensor of the converted checkpoint: the outer ones, each layer as ``step`` converts it, then the chosen
    version of the layers ``step`` held."""
    converted = step.convert_layers(layers, start=output.outer)
    with closing(converted):  # on an error, the layer threads end before the folder goes
        for index, models in converted:
            output.layer(index, models)
    chosen = step.finish(progress)
    if chosen is not None:
        output.choose(chosen)


def _after_conversion(check: Callable[[], Checked], what: str) -> Checked | Failure:
    """Run a check of the finished checkpoint; its failure is reported, never allowed to discard OUT."""
    try:
        return check()
    except MlaconvError as exc:
        return Failure(f"{what} failed: {exc}")
    except Exception as exc:  # a bug in a check must not cost the user the conversion
        return Failure(f"{what} failed unexpectedly: {type(exc).__name__}: {exc}")


def after_layers(converted: Path, out: Path, plan: Plan, progress: Progress) -> Sections:
    """What the steps after the layers give, in order: healing (calibrated), the built-in check, the evaluations,
    the absorbed weights."""
    options = plan.options
    heal = check = evaluation = retrieval = absorbed = None
    if plan.calibrated and options.heal_tokens != 0:
        heal = _after_conversion(lambda: _heal(converted, plan, progress), "healing")
    if options.verify:
        from mlaconv.evaluate.verify import verify

        check = _after_conversion(lambda: verify(plan.folder, converted, plan.spec, windows=options.verify_windows,
                                                 window=options.verify_window), "the built-in check")
    if options.evaluated:
        evaluation = _after_conversion(lambda: _evaluate(converted, out, plan, progress), "the evaluation")
    if options.eval_retrieval:
        retrieval = _after_conversion(lambda: _retrieval(converted, out, plan, progress), "the retrieval evaluation")
    if options.absorbed:
        from mlaconv.target.absorb import write_absorbed

        manifest = write_absorbed(converted, shard_size=options.shard_size)
        absorbed = Absorbed(str(out / "absorbed"), len(manifest["tensors"]),
                            manifest["latent_norm"]["max_relative_nonlinearity"])
    return Sections(heal=heal, verify=check, eval=evaluation, retrieval=retrieval, absorbed=absorbed)


def _heal(converted: Path, plan: Plan, progress: Progress):
    """Heal the fresh conversion in place on its own calibration windows (``heal.run.conversion_data``)."""
    from mlaconv.heal import HealOptions
    from mlaconv.heal.distill import DEFAULT_SCHEDULE, DEFAULT_WINDOW, STEP_TOKENS, default_position_span
    from mlaconv.heal.run import conversion_data, heal_folder

    options = plan.options
    data = conversion_data(plan.folder, plan.spec, plan.calibration, options.calib_tokens, options.calib_window)
    window = options.heal_window or DEFAULT_WINDOW
    heal_options = HealOptions(tokens=options.heal_tokens, max_tokens=HEAL_PER_CALIBRATION_TOKEN * options.calib_tokens,
                               window=window, batch=max(1, STEP_TOKENS // window), device=options.calibration_device,
                               written_tokens=options.heal_written,
                               schedule=options.heal_lr_schedule or DEFAULT_SCHEDULE, precision=options.heal_precision,
                               position_span=default_position_span(options.heal_position_span, window,
                                                                   served_context(plan.spec, options)))
    return heal_folder(converted, converted, plan.folder, data, heal_options, plan.shapes.rank, options.delta, progress)


def _retrieval(converted: Path, out: Path, plan: Plan, progress: Progress):
    """``mlaconv eval retrieval`` of the fresh conversion against its source (same code path)."""
    from mlaconv.io.text import token_counts
    from mlaconv.evaluate.retrieval import evaluate_retrieval

    options = plan.options
    lengths = token_counts(options.eval_retrieval, "--eval-retrieval")
    result = evaluate_retrieval(converted, plan.folder, lengths=lengths,
                                device=options.device if options.device != "cpu" else None, progress=progress)
    result.model = str(out)
    return result


def _evaluate(converted: Path, out: Path, plan: Plan, progress: Progress) -> EvalReport:
    """``mlaconv eval perplexity`` of the fresh conversion against its source (same code path)."""
    options = plan.options
    result = evaluate_perplexity(converted, plan.folder, source=eval_source(options), window=options.eval_window,
                                 max_windows=options.eval_max_windows, batch_size=options.eval_batch_size,
                                 device=options.device if options.device != "cpu" else None, progress=progress)
    result.model = str(out)
    return result
