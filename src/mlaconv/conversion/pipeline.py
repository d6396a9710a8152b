"""One pass over a source checkpoint, layer by layer: the layer loop every conversion step plugs into.

``source_layers`` yields each layer once, in order, as a ``SourceLayer``: its attention in Llama's canonical
layout (read on first use), its key projection alone (for steps that need no more), and, in a calibrated pass,
its statistics from the ``SourceStreamer``. When the consumer asks for the next layer, the pass moves the
calibration activations through the one before, following the converted layers the consumer put in
``SourceLayer.follow``; steps never drive the streamer themselves. ``convert``, the (r, R) split search, the
rope-stride pass, ``inspect spectra`` and the bench baselines all iterate this.

``target.deepseek.checkpoint_layers`` is the same loop over a converted DeepSeek-V3 checkpoint, for what reads one
back (``absorb``, the GGUF export, the latent-cache runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from mlaconv.calibration.rotary_audit import RotaryAudit
from mlaconv.calibration.streamer import MLARun, SourceStreamer
from mlaconv.io import CheckpointReader
from mlaconv.mla.layer import AttentionShape, LayerOptions, LayerReport, LayerStats, MLAAttention, SourceAttention
from mlaconv.mla.shared_key import rotating_pairs
from mlaconv.progress import Progress, no_progress
from mlaconv.source.spec import SourceSpec
from mlaconv.source.weights import SourceWeights


@dataclass
class SourceLayer:
    """Layer ``index`` of the source as the pass reached it."""

    index: int
    weights: SourceWeights
    streamer: SourceStreamer | None = None
    follow: dict[str, MLAAttention] = field(default_factory=dict)  # converted models' layer i, for the audit
    run: MLARun | None = None  # how the followed layers run
    kept: MLAAttention | None = None  # the converted layer a sequential calibration's inputs move through
    _attention: SourceAttention | None = None
    _stats: LayerStats | None = None
    _linear: SourceAttention | None = None

    @property
    def attention(self) -> SourceAttention:
        if self._attention is None:
            self._attention = self.weights.attention(self.index)
        return self._attention

    def key(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The canonical key projection and input norm γ only (``SourceWeights.key``)."""
        return self.weights.key(self.index)

    @property
    def stats(self) -> LayerStats:
        """E[x xᵀ] and the attention profile from the fit windows (calibrated passes only)."""
        if self._stats is None:
            self._stats = self._streamer().stats(self.index, self.attention)
        return self._stats

    @property
    def linear(self) -> SourceAttention:
        """The attention with its QK-norm replaced by the least-squares linear stand-in (itself without QK-norm)."""
        if self._linear is None:
            self._linear = self._streamer().stand_in(self.index, self.attention, self.stats)
        return self._linear

    def audit_metric(self) -> torch.Tensor:
        return self._streamer().audit_metric(self.index)

    def rotary_audit(self, shape: AttentionShape, options: LayerOptions) -> RotaryAudit:
        """The layer's ``RotaryAudit`` (after its statistics: the audit inputs are the held ones)."""
        return RotaryAudit(self.linear, shape, rotating_pairs(shape, options), self.audit_metric(),
                           self._streamer().audit_rotation_mean(self.index, self.attention))

    def _streamer(self) -> SourceStreamer:
        if self.streamer is None:
            raise RuntimeError("this pass over the source is not calibrated")
        return self.streamer


class LayerStep:
    """What the layer pass plugs in (``conversion.run.write_tensors``): each layer's converted attention, one version
    or several to choose from; after the last layer, ``reports`` holds the written layers' ``LayerReport``."""

    reports: list[LayerReport]

    def __call__(self, layer: SourceLayer) -> dict[str, MLAAttention]:
        raise NotImplementedError

    def convert_layers(self, layers: Iterable[SourceLayer], start: Callable[[], None]
                       ) -> Iterator[tuple[int, dict[str, MLAAttention]]]:
        """(index, models) of every layer in order, ``start`` (the writer's outer tensors) run first; one layer at a
        time, unless a step converts ahead of the writer (``WeightsOnly`` on several threads)."""
        start()
        for layer in layers:
            yield layer.index, self(layer)

    def finish(self, progress: Progress) -> str | None:
        """After the last layer: which version of the held layers to write (None: there is only one)."""
        return None


def source_layers(reader: CheckpointReader, spec: SourceSpec, streamer: SourceStreamer | None = None,
                  progress: Progress = no_progress, label: str = "reading layers") -> Iterator[SourceLayer]:
    """Every layer of the source in order; with ``streamer``, each layer is advanced through once its consumer is done."""
    weights = SourceWeights(reader, spec)
    for i in progress(range(spec.num_layers), label, spec.num_layers):
        layer = SourceLayer(i, weights, streamer)
        yield layer
        if streamer is not None:
            streamer.advance(i, layer.attention, layer.follow or None, layer.run, layer.kept)
