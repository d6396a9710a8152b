"""``mlaconv convert``: stream a source checkpoint layer by layer into a DeepSeek-V3 MLA checkpoint.

One pass over the source (``pipeline.source_layers``) feeds each layer to a conversion step (``WeightsOnly``, or
``calibrated.CalibratedSteps``; the bench baselines plug in theirs) and the step's output to the ``LayerWriter``
(``write_tensors``). Memory: one source tensor group (a layer's attention or MLP) is in memory at a time, plus the
calibration activations when calibrated; the writer puts each tensor in its shard file as it is added (a tensor that
passes unchanged is copied there from the source file unread, ``LayerWriter``), and the output folder appears only
when complete. Weights only with one-thread operators and a spare core (``spare_core``; on 2 cores chosen unless the
user set a thread count, ``weights_only_operators``), two layers are factored at once, the outer tensors are written
while the first layers are, and the writer's own thread writes while they are (up to ``WRITE_AHEAD_BYTES`` waiting):
the same bytes, sooner.
"""

from __future__ import annotations

import json
import itertools
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipeline import LayerStep, SourceLayer, source_layers
from mlaconv.conversion.plan import (Plan, calibration_description, estimate_output_bytes, eval_source,
                                     factor_precision, output_config, output_dtype, plan_conversion, with_rope_stride)
from mlaconv.conversion.report import Sections, conversion_report
from mlaconv.errors import MlaconvError
from mlaconv.evaluate.perplexity import evaluate_perplexity
from mlaconv.io import ShardedWriter, atomic_output_dir, check_free_space, check_output_target
from mlaconv.io.heap import heap_reuse
from mlaconv.mla.attention import convert_attention
from mlaconv.mla.layer import LayerReport, MLAAttention, SourceAttention
from mlaconv.progress import Progress, no_progress
from mlaconv.report import ConversionReport, EvalReport
from mlaconv.report.conversion import Absorbed
from mlaconv.report.record import Failure
from mlaconv.target.layout import LayerWriter, copy_tokenizer
from mlaconv.target.model_card import write_model_card
from mlaconv.target.targets import target_report

WRITE_AHEAD_BYTES = 64 * 2**20  # tensors waiting for the writer's thread, at most (or one larger)
HEAL_PER_CALIBRATION_TOKEN = 4  # a conversion's default healing: at most this many tokens per calibration token
LAYER_MEMORY = 2**30  # weights only: a second layer is factored at once only below this working set


Checked = TypeVar("Checked")


class WeightsOnly(LayerStep):
    """Each layer converted from its weights alone (``convert_attention``), cast to the output dtype at once.

    ``ahead`` factors the next layers on ``workers`` threads while the caller writes one: torch's operators release
    the GIL, so with one-thread operators (``OMP_NUM_THREADS=1``, or ``weights_only_operators``) two layers use two
    cores, and every operator runs as it would alone (the same bytes).
    """

    def __init__(self, plan: Plan, dtype: torch.dtype | None = None, workers: int = 1):
        self.plan, self.dtype, self.workers, self._reports = plan, dtype, workers, []
        self.options = replace(plan.layer, precision=factor_precision(dtype))

    def __call__(self, layer: SourceLayer) -> dict[str, MLAAttention]:
        return self._collect(self._convert(layer.attention))

    def convert_layers(self, layers: Iterable[SourceLayer], start: Callable[[], None]
                       ) -> Iterator[tuple[int, dict[str, MLAAttention]]]:
        # one layer at a time unless two run at once: an interrupt then waits for one operator, not a layer
        if self.workers > 1:
            return self.ahead(layers, start)
        return super().convert_layers(layers, start)

    def ahead(self, layers: Iterable[SourceLayer], start: Callable[[], None]
              ) -> Iterator[tuple[int, dict[str, MLAAttention]]]:
        """(index, models) of every layer in order; ``start`` runs here once the first layers are on the threads (the
        outer tensors are written meanwhile). The weights are read here, in order (the reader and a fused tensor's
        cache stay on one thread); only the arithmetic runs on the threads."""
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="mlaconv-layer")
        waiting: deque[tuple[int, Future]] = deque()
        layers = iter(layers)
        try:
            for layer in itertools.islice(layers, self.workers):
                waiting.append((layer.index, pool.submit(self._convert, layer.attention)))
            start()
            for layer in layers:  # one layer more than the threads: the next waits read
                waiting.append((layer.index, pool.submit(self._convert, layer.attention)))
                index, future = waiting.popleft()
                yield index, self._collect(future.result())
            while waiting:
                index, future = waiting.popleft()
                yield index, self._collect(future.result())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _convert(self, attention: SourceAttention) -> tuple[MLAAttention, LayerReport]:
        mla, report = convert_attention(attention, self.plan.shape, self.options)
        return (mla if self.dtype is None else mla.cast(dtype=self.dtype)), report

    def _collect(self, converted: tuple[MLAAttention, LayerReport]) -> dict[str, MLAAttention]:
        mla, report = converted
        self._reports.append(report)
        return {"weights-only": mla}

    @property
    def reports(self) -> list[LayerReport]:
        return self._reports


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as torch counts them), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def spare_core() -> bool:
    """Whether torch runs each operator on one thread with more cores to use: only then are threads of the
    conversion's own (the writer's, a second layer's) used. Beside torch's two threads per operator on 2 cores (a
    calibrated pass, or a user's ``OMP_NUM_THREADS=2``) they contend with the operators' threads; a weights-only
    Llama-3.2-1B-shaped conversion took 182 s one thing at a time and 360 s with the writer's thread while another
    job ran on both cores (one pair of runs), 20–23 s and 18.5–20.5 s at load 1.9 (two pairs): too little gain for
    that risk."""
    return torch.get_num_threads() == 1 and usable_cores() > 1


def two_layers_fit(plan: Plan) -> bool:
    """Whether one layer's float64 working set in a weights-only conversion, about five copies of its attention
    weights (0.4 GB for Llama-3.2-1B, 6 GB for Llama-3-70B), is under ``LAYER_MEMORY``."""
    s = plan.shape
    return 5 * 8 * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.hidden <= LAYER_MEMORY


@contextmanager
def weights_only_operators(two_layers_fit: bool) -> Iterator[None]:
    """One-thread operators for a weights-only layer pass whose layers fit two at a time (``LAYER_MEMORY``), on 2
    usable cores, where the user set no thread count (``OMP_NUM_THREADS``): as that setting would, two layers then
    run at once beside the writer's thread (``spare_core``); bench/results/conversion-weights-only.json. More cores are
    left to torch (not measured). Torch's setting comes back after the pass, for the checks that follow."""
    before = torch.get_num_threads()
    if not two_layers_fit or usable_cores() != 2 or "OMP_NUM_THREADS" in os.environ or before == 1:
        yield
        return
    try:
        torch.set_num_threads(1)
        yield
    finally:
        torch.set_num_threads(before)


def layer_workers(plan: Plan) -> int:
    """Layers factored at once in a weights-only conversion: two with a ``spare_core`` where ``two_layers_fit``, else
    one."""
    return 2 if spare_core() and two_layers_fit(plan) else 1


def convert(source: str, out: str | Path, options: ConvertOptions, progress: Progress = no_progress) -> ConversionReport:
    """Convert ``source`` into an MLA checkpoint at ``out``; return the report (``to_json()``: OUT/mlaconv.json).

    Weights only on 2 cores, torch runs one-thread operators during the layer pass unless ``OMP_NUM_THREADS`` is set
    (``weights_only_operators``); its thread count comes back afterwards."""
    started = time.perf_counter()
    out = Path(out)
    plan = plan_conversion(source, options)
    folder, spec, reader = plan.folder, plan.spec, plan.reader
    dtype = output_dtype(spec, options.dtype)
    check_output_target(out, folder, options.force)
    check_free_space(out.parent, estimate_output_bytes(spec, plan.shapes, dtype, options.absorbed))
    streamer = shape_search = None
    if plan.calibrated:
        from mlaconv.conversion import calibrated

        plan, streamer, refinement, shape_search = calibrated.prepare(plan, options, progress)
    plan = with_rope_stride(plan, progress)
    attention_bias = bool(spec.qkv_bias or spec.o_bias) and plan.layer.biases
    with atomic_output_dir(out, force=options.force) as tmp:
        with weights_only_operators(streamer is None and two_layers_fit(plan)):
            step: LayerStep = (calibrated.CalibratedSteps(plan, options, streamer, refinement) if streamer else
                               WeightsOnly(plan, dtype, layer_workers(plan)))
            # Weights only with a spare core: freed memory reused (io.heap), and the writer's own thread writes each
            # tensor while the next ones are computed (stopped before tmp is removed). Not calibrated, whose peak is
            # close to its 1.5 GB goal.
            threads = streamer is None and spare_core()
            heap = heap_reuse() if threads else nullcontext()
            write_ahead = WRITE_AHEAD_BYTES if threads else 0
            with heap, ShardedWriter(tmp, options.shard_size, write_ahead=write_ahead) as writer:
                output = LayerWriter(writer, reader, spec, plan.layer.residual_scale, dtype, attention_bias,
                                     tmp / ".pending")
                write_tensors(output, source_layers(reader, spec, streamer, progress, "converting layers"), step,
                              progress)
                writer.finish()
        reader.close()

        config, rope_rewrite = output_config(spec, plan.shapes, plan.layer.rope_stride, options.target, attention_bias,
                                             dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = copy_tokenizer(folder, tmp)

        sections = Sections(shape_search=shape_search,
                            calibration_data=calibration_description(folder, options, plan.calibration),
                            calibration=step.report() if streamer else None)
        if plan.calibrated and options.heal_tokens != 0:
            sections.heal = _after_conversion(lambda: _heal(tmp, folder, plan, options, progress), "healing")
        if options.verify:
            from mlaconv.evaluate.verify import verify

            sections.verify = _after_conversion(
                lambda: verify(folder, tmp, spec, windows=options.verify_windows, window=options.verify_window),
                "the built-in check")
        if options.evaluated:
            sections.eval = _after_conversion(lambda: _evaluate(tmp, folder, out, options, progress), "the evaluation")
        if options.eval_retrieval:
            sections.retrieval = _after_conversion(lambda: _retrieval(tmp, folder, out, options, progress),
                                                   "the retrieval evaluation")
        if options.absorbed:
            from mlaconv.target.absorb import write_absorbed

            manifest = write_absorbed(tmp, shard_size=options.shard_size)
            sections.absorbed = Absorbed(str(out / "absorbed"), len(manifest["tensors"]),
                                         manifest["latent_norm"]["max_relative_nonlinearity"])
        report = conversion_report(plan, config, step.reports, out, source, dtype, options, copied,
                                   target_report(options.target, step.reports, rope_rewrite, plan.calibrated), sections)
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


def _heal(converted: Path, source: Path, plan: Plan, options: ConvertOptions, progress: Progress):
    """Heal the fresh conversion in place on its own calibration windows (``heal.run.conversion_data``)."""
    from mlaconv.heal import HealOptions
    from mlaconv.heal.run import conversion_data, heal_folder

    data = conversion_data(source, plan.spec, plan.calibration, options.calib_tokens, options.calib_window)
    heal_options = HealOptions(tokens=options.heal_tokens, max_tokens=HEAL_PER_CALIBRATION_TOKEN * options.calib_tokens,
                               device=options.calibration_device)
    return heal_folder(converted, converted, source, data, heal_options, plan.shapes.rank, options.delta, progress)


def _retrieval(converted: Path, source: Path, out: Path, options: ConvertOptions, progress: Progress):
    """``mlaconv eval retrieval`` of the fresh conversion against its source (same code path)."""
    from mlaconv.io.text import token_counts
    from mlaconv.evaluate.retrieval import evaluate_retrieval

    result = evaluate_retrieval(converted, source, lengths=token_counts(options.eval_retrieval, "--eval-retrieval"),
                                device=options.device if options.device != "cpu" else None, progress=progress)
    result.model = str(out)
    return result


def _evaluate(converted: Path, source: Path, out: Path, options: ConvertOptions, progress: Progress) -> EvalReport:
    """``mlaconv eval perplexity`` of the fresh conversion against its source (same code path)."""
    result = evaluate_perplexity(converted, source, source=eval_source(options), window=options.eval_window,
                                 max_windows=options.eval_max_windows, batch_size=options.eval_batch_size,
                                 device=options.device if options.device != "cpu" else None, progress=progress)
    result.model = str(out)
    return result
