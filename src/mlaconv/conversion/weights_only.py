"""The weights-only pipeline: each layer converted from its weights alone, two at a time where a spare core and the
memory allow (``WeightsOnly``, ``layer_workers``), with one-thread operators on 2 cores (``weights_only_operators``)
and, with a spare core, the writer's own thread (``WeightsOnlyPipeline``)."""

from __future__ import annotations

import itertools
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import torch

from mlaconv.conversion.pipeline import LayerStep, SourceLayer
from mlaconv.conversion.pipelines import Pipeline, register
from mlaconv.conversion.plan import Plan, factor_precision, with_rope_stride
from mlaconv.io.heap import heap_reuse
from mlaconv.mla.attention import convert_attention
from mlaconv.mla.layer import LayerReport, MLAAttention, SourceAttention
from mlaconv.progress import Progress, no_progress

LAYER_MEMORY = 2**30  # a second layer is factored at once only below this working set
WRITE_AHEAD_BYTES = 64 * 2**20  # tensors waiting for the writer's thread, at most (or one larger)


@register("weights-only")
class WeightsOnlyPipeline(Pipeline):
    """The weights-only conversion: the rope stride chosen from the weights, then ``WeightsOnly`` on each layer.

    Its layer pass runs with one-thread operators where two layers fit at once (``weights_only_operators``); with a
    spare core, freed memory is reused (io.heap) and the writer's own thread writes each tensor while the next ones are
    computed (a calibrated pass does neither: its peak is close to its 1.5 GB goal)."""

    def __init__(self, plan: Plan, progress: Progress = no_progress):
        super().__init__(with_rope_stride(plan, progress))
        self.step = WeightsOnly(self.plan)

    @contextmanager
    def layer_pass(self) -> Iterator[int]:
        with weights_only_operators(two_layers_fit(self.plan)):
            threads = spare_core()
            with heap_reuse() if threads else nullcontext():
                yield WRITE_AHEAD_BYTES if threads else 0


class WeightsOnly(LayerStep):
    """Each layer converted from its weights alone (``convert_attention``), cast to the output dtype at once.

    ``ahead`` factors the next layers on ``layer_workers`` threads while the caller writes one: torch's operators
    release the GIL, so with one-thread operators (``OMP_NUM_THREADS=1``, or ``weights_only_operators``) two layers use
    two cores, and every operator runs as it would alone (the same bytes).
    """

    def __init__(self, plan: Plan):
        self.plan, self._reports = plan, []
        self.options = replace(plan.layer, precision=factor_precision(plan.dtype))

    def __call__(self, layer: SourceLayer) -> dict[str, MLAAttention]:
        return self._collect(self._convert(layer.attention))

    def convert_layers(self, layers: Iterable[SourceLayer], start: Callable[[], None]
                       ) -> Iterator[tuple[int, dict[str, MLAAttention]]]:
        # one layer at a time unless two run at once: an interrupt then waits for one operator, not a layer
        workers = layer_workers(self.plan)
        if workers > 1:
            return self.ahead(layers, start, workers)
        return super().convert_layers(layers, start)

    def ahead(self, layers: Iterable[SourceLayer], start: Callable[[], None], workers: int
              ) -> Iterator[tuple[int, dict[str, MLAAttention]]]:
        """(index, models) of every layer in order, ``workers`` layers at once; ``start`` runs here once the first
        layers are on the threads (the outer tensors are written meanwhile). The weights are read here, in order (the
        reader and a fused tensor's cache stay on one thread); only the arithmetic runs on the threads."""
        pool = ThreadPoolExecutor(workers, thread_name_prefix="mlaconv-layer")
        waiting: deque[tuple[int, Future]] = deque()
        layers = iter(layers)
        try:
            for layer in itertools.islice(layers, workers):
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
        return mla.cast(dtype=self.plan.dtype), report

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
