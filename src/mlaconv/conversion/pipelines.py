"""The conversion pipelines, registered by name: how the layers of a planned conversion are converted.

A pipeline is made from a ``Plan`` (and what else its preparation takes); its ``plan`` is then final (shapes and
rope stride). It gives the ``LayerStep`` the layer pass plugs in (``step``), the calibration pass the layers are read
with (``streamer``; None: the weights alone) and the setting the pass runs in (``layer_pass``), and after the pass its
own sections of the report (``sections``). ``weights_only`` and ``calibrated`` register ``weights-only`` and
``calibrated`` (the report's ``mode``), the bench's baselines theirs; ``conversion.run.choose`` picks one for a plan.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from mlaconv.calibration.streamer import SourceStreamer
from mlaconv.conversion.pipeline import LayerStep
from mlaconv.conversion.plan import Plan
from mlaconv.report.conversion import Calibration, ShapeSearch


@dataclass(frozen=True)
class PipelineSections:
    """A pipeline's own sections of the report (None where it has none: a weights-only conversion has neither)."""

    shape_search: ShapeSearch | None = None  # the (r, R) split measured for a --kv-keep budget
    calibration: Calibration | None = None


class Pipeline:
    """One way to convert the layers of ``plan``, registered as ``name``."""

    name: str  # set by ``register``
    step: LayerStep
    streamer: SourceStreamer | None = None

    def __init__(self, plan: Plan):
        self.plan = plan

    @contextmanager
    def layer_pass(self) -> Iterator[int]:
        """What the layer pass runs inside; yields how many bytes of tensors the writer's own thread may hold (0: the
        writer writes on the caller's thread)."""
        yield 0

    def sections(self) -> PipelineSections:
        """Its sections of the report, once the layers are written."""
        return PipelineSections()


PIPELINES: dict[str, type[Pipeline]] = {}


def register(name: str) -> Callable[[type[Pipeline]], type[Pipeline]]:
    """A class decorator: the pipeline is registered as ``name`` (``PIPELINES``)."""
    def add(cls: type[Pipeline]) -> type[Pipeline]:
        cls.name = name
        PIPELINES[name] = cls
        return cls

    return add
