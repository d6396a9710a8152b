"""One pass over a source checkpoint, layer by layer: the layer loop every conversion step plugs into.

``source_layers`` yields each layer once, in order, as a ``SourceLayer``: its attention in Llama's canonical
layout (read on first use), its key projection alone (for steps that need no more), and, in a calibrated pass,
its statistics from the ``SourceStreamer``. When the consumer asks for the next layer, the pass moves the
calibration activations through the one before, following the converted layers the consumer put in
``SourceLayer.follow``; steps never drive the streamer themselves. ``convert``, the (r, R) split search, the
rope-stride pass, ``inspect spectra`` and the bench baselines all iterate this.

``checkpoint_layers`` is the same loop over a converted DeepSeek-V3 checkpoint, for what reads one back
(``absorb``, the GGUF export, the latent-cache runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from mlaconv.target import deepseek
from mlaconv.source.spec import SourceSpec
from mlaconv.calibration.streamer import MLARun, SourceStreamer
from mlaconv.source.families import SourceWeights
from mlaconv.io import CheckpointReader
from mlaconv.mla.layer import LayerStats, MLAAttention, SourceAttention
from mlaconv.progress import Progress, no_progress


@dataclass
class SourceLayer:
    """Layer ``index`` of the source as the pass reached it."""

    index: int
    weights: SourceWeights
    streamer: SourceStreamer | None = None
    follow: dict[str, MLAAttention] = field(default_factory=dict)  # converted models' layer i, for the audit
    run: MLARun | None = None  # how the followed layers run
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

    def _streamer(self) -> SourceStreamer:
        if self.streamer is None:
            raise RuntimeError("this pass over the source is not calibrated")
        return self.streamer


def source_layers(reader: CheckpointReader, spec: SourceSpec, streamer: SourceStreamer | None = None,
                  progress: Progress = no_progress, label: str = "reading layers") -> Iterator[SourceLayer]:
    """Every layer of the source in order; with ``streamer``, each layer is advanced through once its consumer is done."""
    weights = SourceWeights(reader, spec)
    for i in progress(range(spec.num_layers), label, spec.num_layers):
        layer = SourceLayer(i, weights, streamer)
        yield layer
        if streamer is not None:
            streamer.advance(i, layer.attention, layer.follow or None, layer.run)


@dataclass(frozen=True)
class CheckpointLayer:
    """Layer ``index`` of a converted DeepSeek-V3 checkpoint."""

    index: int
    reader: CheckpointReader

    @property
    def prefix(self) -> str:
        """The layer's tensor names start with this."""
        return deepseek.layer_prefix(self.index)

    def read_attention(self) -> MLAAttention:
        return deepseek.read_attention(self.reader, self.index)


def checkpoint_layers(reader: CheckpointReader, num_layers: int) -> Iterator[CheckpointLayer]:
    """Every layer of a converted checkpoint in order."""
    for i in range(num_layers):
        yield CheckpointLayer(i, reader)


def read_attention(reader: CheckpointReader, spec: SourceSpec, i: int) -> SourceAttention:
    """Layer i's attention in Llama's canonical layout, whatever the family (``SourceWeights``)."""
    return SourceWeights(reader, spec).attention(i)
