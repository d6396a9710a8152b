"""``SpectraReport``: what ``mlaconv.inspect_spectra`` returns, with its per-layer rows."""

from __future__ import annotations

from dataclasses import dataclass

from mlaconv.report.conversion import LayerSelection, ShapeSearch
from mlaconv.report.record import Record, WindowSets, optional


@dataclass
class LayerSpectrum(Record):
    layer: int
    energy_retained: list[float]
    rank_for_energy: list[int]
    rank_fraction_for_energy: list[float]
    rope_energy_kept: float
    rope_energy_kept_per_frequency: list[float]
    rope_loss_weighted_kept: float
    rope_score_loss: float
    rope_score_loss_per_frequency: list[float]
    rope_score_loss_without_mean_rotation: float
    rope_mean_rotation_recovers: float
    rope_frequencies: list[int]
    singular_values: list[float]
    normalised_spectrum: list[float]
    energy_curve: list[float]


@dataclass
class SpectraSummary(Record):
    energy_retained_mean: list[float]
    energy_retained_min: list[float]
    rank_for_energy_mean: list[float]
    rank_for_energy_max: list[int]
    rank_fraction_for_energy_mean: list[float]
    rope_energy_kept_mean: float
    rope_energy_kept_min: float
    rope_score_loss_mean: float
    rope_score_loss_without_mean_rotation_mean: float


@dataclass
class Recommendation(Record):
    kv_keep: float
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_elements_per_token_per_layer: int
    kv_keep_actual: float
    reason: str
    energy_retained: list[float]
    energy_retained_mean: float


@dataclass
class LayerAudit(Record):
    """One version of a layer, measured on the audit windows as ``convert`` measures it (docs/report.md)."""

    attention_error: float
    energy_retained: float
    rope_energy_kept: float
    rope_loss_weighted_kept: float
    rope_energy_kept_per_frequency: list[float]
    rope_score_loss: float
    rope_score_loss_without_mean_rotation: float
    rope_mean_rotation_recovers: float
    rope_score_loss_per_frequency: list[float]


@dataclass
class LayerRefinement(Record):
    layer: int
    selection: LayerSelection  # the select windows' choices: variant, refinement before/after, kept
    closed_form: LayerAudit
    refined: LayerAudit | None  # None where the refinement did not beat the closed form on the select windows


@dataclass
class SpectraRefinement(Record):
    """``--refine``: convert's per-layer steps at its split (variant choice, refinement), closed form vs refined."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    shape_search: ShapeSearch | None
    refinement: str  # the plan, in words
    refine_steps: int
    refine_batch: int
    layers: list[LayerRefinement]


@dataclass
class SpectraReport(Record):
    """What ``mlaconv.inspect_spectra`` returns (docs/report.md, "spectra")."""

    mlaconv_version: str
    source: str
    architecture: str
    mode: str
    shows: str
    window_sets: WindowSets | None
    settings: dict
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    kv_elements_per_token_per_layer: int
    qk_rope_head_dim: int
    rope_stride: int
    matrix_rows: int
    full_rank: int
    ranks: list[int]
    energy_targets: list[float]
    layers: list[LayerSpectrum]
    summary: SpectraSummary
    recommendation: Recommendation | None
    seconds: float
    refinement: SpectraRefinement | None = optional()
