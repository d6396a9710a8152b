"""The rotary figures of a calibrated layer (``shared_key.rotary_figures``), measured on the audit windows.

The closed form's construction reports what its shared key keeps in the fit windows' statistics, and a refinement
moves q_rope and k_rope after that. Here the same figures are taken, for any version of the layer, in the audit
windows' E[x xᵀ] and attention profile μ, which no fit or choice saw: the closed form and its refinement are
measured alike, and ``inspect spectra`` and ``convert`` report the same figure for the same layer. A layer of the
source pass builds its own (``conversion.pipeline.SourceLayer.rotary_audit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from mlaconv.mla.layer import AttentionShape, LatentAttention, SourceAttention
from mlaconv.mla.rope import kept_frequencies
from mlaconv.mla.shared_key import (RotaryFigures, RotatedSlots, SourceRotation, figures_against, latent_slots,
                                    nothing_rotates, source_rotation)


@dataclass(frozen=True)
class RotaryAudit:
    """One layer's source rows and audit-window statistics, to measure any version of the layer against."""

    source: SourceAttention  # the layer as factored (a QK-norm layer's linear stand-in): its q and k rows
    shape: AttentionShape
    pairs: int  # F_rot
    metric: torch.Tensor  # E[x xᵀ] [H, H] on the audit windows
    rotation_mean: torch.Tensor  # μ [N, d/2] on the audit windows

    @cached_property
    def rotation(self) -> SourceRotation:
        """The source's side of the figures, once for every version of the layer measured."""
        return source_rotation(self.source.q, self.source.k, self.shape, self.pairs, self.metric, self.rotation_mean)

    def figures(self, slots: RotatedSlots) -> RotaryFigures:
        if not self.source.rotated:
            return nothing_rotates(self.pairs)
        return figures_against(self.rotation, self.source.q, self.source.k, slots)

    def of_latent(self, latent: LatentAttention, rope_dim: int, stride: int) -> RotaryFigures:
        """The figures of a compact layer whose R/2 slots turn at source pairs 0, s, 2s, …"""
        return self.figures(latent_slots(latent, self.shape, rope_dim, kept_frequencies(rope_dim, stride)))
