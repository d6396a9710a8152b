"""``mlaconv convert``: stream a source checkpoint layer by layer into a DeepSeek-V3 MLA checkpoint.

One pass over the source (``pipeline.source_layers``) feeds each layer to a conversion step
(``weights_only.WeightsOnly``, or ``calibrated.CalibratedSteps``; the bench baselines plug in theirs) and the
step's output to the ``LayerWriter`` (``write_tensors``); then the steps after the layers (heal, check, evaluation)
and the report (``report.conversion_report``). Memory: one source tensor group (a layer's attention or MLP) is in
memory at a time, plus the calibration activations when calibrated; the writer puts each tensor in its shard file as
it is added (a tensor that passes unchanged is copied there from the source file unread, ``LayerWriter``), and the
output folder appears only when complete. Weights only with a spare core (``weights_only.spare_core``), the writer's
own thread writes while the layers are factored (up to ``WRITE_AHEAD_BYTES`` waiting): the same bytes, sooner.
"""

from __future__ import annotations

import json
import time
from contextlib import closing, nullcontext
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from mlaconv.conversion import weights_only
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipeline import LayerStep, SourceLayer, source_layers
from mlaconv.conversion.plan import (Plan, calibration_description, estimate_output_bytes, eval_source,
                                     output_config, plan_conversion, with_rope_stride)
from mlaconv.conversion.report import Sections, conversion_report
from mlaconv.errors import MlaconvError
from mlaconv.evaluate.perplexity import evaluate_perplexity
from mlaconv.io import ShardedWriter, atomic_output_dir, check_free_space, check_output_target
from mlaconv.io.heap import heap_reuse
from mlaconv.progress import Progress, no_progress
from mlaconv.report import ConversionReport, EvalReport
from mlaconv.report.conversion import Absorbed
from mlaconv.report.record import Failure
from mlaconv.target.layout import LayerWriter, copy_tokenizer
from mlaconv.target.model_card import write_model_card
from mlaconv.target.targets import target_report

WRITE_AHEAD_BYTES = 64 * 2**20  # tensors waiting for the writer's thread, at most (or one larger)
HEAL_PER_CALIBRATION_TOKEN = 4  # a conversion's default healing: at most this many tokens per calibration token


Checked = TypeVar("Checked")


def convert(source: str, out: str | Path, options: ConvertOptions, progress: Progress = no_progress) -> ConversionReport:
    """Convert ``source`` into an MLA checkpoint at ``out``; return the report (``to_json()``: OUT/mlaconv.json).

    Weights only on 2 cores, torch runs one-thread operators during the layer pass unless ``OMP_NUM_THREADS`` is set
    (``weights_only_operators``); its thread count comes back afterwards."""
    started = time.perf_counter()
    out = Path(out)
    plan = plan_conversion(source, options)
    folder, spec, reader, dtype = plan.folder, plan.spec, plan.reader, plan.dtype
    check_output_target(out, folder, options.force)
    check_free_space(out.parent, estimate_output_bytes(spec, plan.shapes, dtype, options.absorbed))
    streamer = shape_search = None
    if plan.calibrated:
        from mlaconv.conversion import calibrated

        plan, streamer, refinement, shape_search = calibrated.prepare(plan, progress)
    plan = with_rope_stride(plan, progress)
    with atomic_output_dir(out, force=options.force) as tmp:
        with weights_only.weights_only_operators(streamer is None and weights_only.two_layers_fit(plan)):
            step: LayerStep = (calibrated.CalibratedSteps(plan, streamer, refinement) if streamer else
                               weights_only.WeightsOnly(plan, dtype, weights_only.layer_workers(plan)))
            # Weights only with a spare core: freed memory reused (io.heap), and the writer's own thread writes each
            # tensor while the next ones are computed (stopped before tmp is removed). Not calibrated, whose peak is
            # close to its 1.5 GB goal.
            threads = streamer is None and weights_only.spare_core()
            heap = heap_reuse() if threads else nullcontext()
            write_ahead = WRITE_AHEAD_BYTES if threads else 0
            with heap, ShardedWriter(tmp, options.shard_size, write_ahead=write_ahead) as writer:
                output = LayerWriter(writer, reader, spec, plan.layer.residual_scale, dtype, plan.attention_bias,
                                     tmp / ".pending")
                write_tensors(output, source_layers(reader, spec, streamer, progress, "converting layers"), step,
                              progress)
                writer.finish()
        reader.close()

        config, rope_rewrite = output_config(spec, plan.shapes, plan.layer.rope_stride, plan.target,
                                             plan.attention_bias, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = copy_tokenizer(folder, tmp)

        sections = Sections(shape_search=shape_search,
                            calibration_data=calibration_description(plan),
                            calibration=step.report() if streamer else None)
        if plan.calibrated and options.heal_tokens != 0:
            sections.heal = _after_conversion(lambda: _heal(tmp, plan, progress), "healing")
        if options.verify:
            from mlaconv.evaluate.verify import verify

            sections.verify = _after_conversion(
                lambda: verify(folder, tmp, spec, windows=options.verify_windows, window=options.verify_window),
                "the built-in check")
        if options.evaluated:
            sections.eval = _after_conversion(lambda: _evaluate(tmp, out, plan, progress), "the evaluation")
        if options.eval_retrieval:
            sections.retrieval = _after_conversion(lambda: _retrieval(tmp, out, plan, progress),
                                                   "the retrieval evaluation")
        if options.absorbed:
            from mlaconv.target.absorb import write_absorbed

            manifest = write_absorbed(tmp, shard_size=options.shard_size)
            sections.absorbed = Absorbed(str(out / "absorbed"), len(manifest["tensors"]),
                                         manifest["latent_norm"]["max_relative_nonlinearity"])
        report = conversion_report(plan, config, step.reports, out, source, copied,
                                   target_report(plan.target, step.reports, rope_rewrite, plan.calibrated), sections)
        (tmp / "mlaconv.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        write_model_card(tmp, report)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


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


def _heal(converted: Path, plan: Plan, progress: Progress):
    """Heal the fresh conversion in place on its own calibration windows (``heal.run.conversion_data``)."""
    from mlaconv.heal import HealOptions
    from mlaconv.heal.run import conversion_data, heal_folder

    options = plan.options
    data = conversion_data(plan.folder, plan.spec, plan.calibration, options.calib_tokens, options.calib_window)
    heal_options = HealOptions(tokens=options.heal_tokens, max_tokens=HEAL_PER_CALIBRATION_TOKEN * options.calib_tokens,
                               device=options.calibration_device)
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
