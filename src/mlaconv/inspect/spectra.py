"""``mlaconv inspect spectra``: what the latent and the shared RoPE key keep, layer by layer, before converting.

For every layer this runs the very analysis ``convert`` runs (``analyse_layer`` with the options of
``layer_options`` and the model-wide stride of ``with_rope_stride``) and reports the spectrum of
the matrix the latent truncates: its singular values, the energy kept at chosen ranks, the
rank each energy target needs, and the RoPE energy the shared key keeps.

What it shows (the report's ``shows`` says it too): weights-only, exactly what ``convert`` keeps, and
``convert --rank r`` reports the same ``energy_retained`` per layer. With calibration, one variant at one
split: the plain calibrated variant (E[x xᵀ] and μ from convert's fit windows, balanced latent) at the
default (r, R) split of --kv-keep (with --refine, at the split convert's search chooses). ``convert`` also measures
the weights-only and the attention-weighted variants per layer and, for --kv-keep, other splits, and keeps per
layer what its select windows favour (its ``layer_variant`` and ``shape_search`` say what); where it keeps this
variant unrefined, it reports the same ``energy_retained`` and rotary figures: both measure them on the audit
windows. ``energy_curve`` and ``rank_for_energy`` are the spectrum itself, i.e. in-sample (the fit windows) when
calibrated. ``--refine`` adds, per layer, convert's own closed form and refined layer measured on the audit windows
(``spectra_refine``).

Weights are read lazily, one layer's attention at a time, so a 70B model fits on a laptop.
"""

from __future__ import annotations

import csv
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from mlaconv import __version__
from mlaconv.conversion.calibrated import calibrated_layer_options, calibration_streamer, window_sets
from mlaconv.conversion.options import ConvertOptions, flags, shared
from mlaconv.conversion.pipeline import source_layers
from mlaconv.conversion.plan import ShapeChoice, factor_precision, model_full_rank, plan_conversion, with_rope_stride
from mlaconv.errors import MlaconvError
from mlaconv.inspect.refine import start_refinement
from mlaconv.mla import rope
from mlaconv.mla import latent as latent_math
from mlaconv.mla import metric as metric_math
from mlaconv.mla.attention import LayerAnalysis, analyse_layer, latent_errors
from mlaconv.mla.layer import AttentionShape, LayerOptions, LayerStats, SourceAttention
from mlaconv.mla.shared_key import (RotaryFigures, closed_form_slots, query_energy_per_head, rotating_pairs,
                                    weights_only_stats)
from mlaconv.progress import Progress, no_progress
from mlaconv.report import SpectraReport
from mlaconv.report.spectra import LayerSpectrum, Recommendation, SpectraSummary

DEFAULT_ENERGY_TARGETS = (0.9, 0.95, 0.99)
DEFAULT_POWERS_OF_TWO = 6  # default ranks: the 6 largest powers of two below the full rank, and the full rank
ENERGY_TOLERANCE = 1e-12  # a target counts as reached within rounding (target 1.0 → the full rank)


@dataclass
class SpectraOptions:
    """What to measure, and the conversion settings to measure it under (same meaning as in ``convert``)."""

    ranks: list[int] | None = None  # None: ``default_ranks``
    energy_targets: tuple[float, ...] = DEFAULT_ENERGY_TARGETS
    # The conversion settings, as ``ConvertOptions`` declares them (kv_keep: recommend (R, r) for this budget,
    # as ``convert --kv-keep`` would choose them).
    kv_keep: float | None = shared("kv_keep")
    rope_dim: int | None = shared("rope_dim")
    rope_stride: int | None = shared("rope_stride")
    revision: str | None = shared("revision")
    allow_sliding_window: bool = shared("allow_sliding_window")
    calib: list[str] = shared("calib")
    calib_dataset: str | None = shared("calib_dataset")
    calib_tokens: int = shared("calib_tokens")
    calib_window: int = shared("calib_window")
    device: str | None = shared("device")
    refine: bool = False  # also run convert's per-layer steps (``spectra_refine``): needs calibration and kv_keep
    refine_steps: int | None = shared("refine_steps")  # with refine

    def convert_options(self) -> ConvertOptions:
        """The ``convert`` settings these spectra preview: the shared ones, and no rank (the spectra hold every
        rank; ``plan_conversion(..., every_rank=True)``)."""
        return ConvertOptions(weights_only=not (self.calib or self.calib_dataset),
                              **{name: getattr(self, name) for name in flags(SpectraOptions)})


def default_ranks(full: int) -> list[int]:
    """The largest few powers of two below ``full``, and ``full`` itself (ascending)."""
    powers = [1 << k for k in range(full.bit_length()) if 1 << k < full]
    return powers[-DEFAULT_POWERS_OF_TWO:] + [full]


def rank_for_energy(curve: torch.Tensor, target: float) -> int:
    """The smallest rank whose energy reaches ``target`` (``curve[k-1]`` is the energy at rank k)."""
    reached = (curve >= target - ENERGY_TOLERANCE).nonzero()
    return int(reached[0, 0]) + 1 if len(reached) else len(curve)


def check_output_file(path: Path, suffix: str, option: str) -> None:
    """Refuse, before any work, an output file that cannot be written where the user asked."""
    if path.suffix.lower() != suffix:
        raise MlaconvError(f"{option} {path} must end in {suffix}")
    if not path.parent.is_dir():
        raise MlaconvError(f"{option} {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise MlaconvError(f"{option} {path} is a folder")


def spectra(source: str, options: SpectraOptions, progress: Progress = no_progress,
            stats_for_layer: Callable[[int, SourceAttention], LayerStats] | None = None) -> SpectraReport:
    """Analyse every layer of ``source`` as ``convert`` would; return the report.

    Calibration settings in ``options`` stream the source model exactly as ``convert`` does;
    ``stats_for_layer(i, src)`` instead supplies statistics directly (for tests and other callers).
    Without either the spectra are weights-only. The keys are listed in docs/report.md ("spectra").
    """
    started = time.perf_counter()
    _check_targets(options.energy_targets)
    if options.refine_steps is not None and not options.refine:
        raise MlaconvError("--refine-steps sets the steps of --refine: give --refine too")
    plan = plan_conversion(source, options.convert_options(), every_rank=True)
    folder, spec, reader = plan.folder, plan.spec, plan.reader
    try:
        refining = None
        if options.refine:  # convert's split and refinement plan
            plan, refining = start_refinement(plan, progress)
        recommended = plan.shapes if options.kv_keep is not None else None
        shapes = plan.shapes
        full = model_full_rank(spec, shapes.rope_dim)
        ranks = _ranks(options.ranks, full, recommended)
        streamer = refining.streamer if refining else calibration_streamer(plan)
        plan = with_rope_stride(plan, progress)
        calibrated = streamer is not None or stats_for_layer is not None
        weights_only = replace(plan.layer, precision=factor_precision(plan.dtype))
        layers = []
        for source in source_layers(reader, spec, streamer, progress, "analysing layers"):
            i, audit, rotary = source.index, None, None
            if streamer:
                src, stats, audit = source.linear, source.stats, source.audit_metric()
                rotary = source.rotary_audit(plan.shape, plan.layer)
            else:
                src = source.attention
                stats = stats_for_layer(i, src) if stats_for_layer else None
            layer_options = calibrated_layer_options(plan.layer) if calibrated else weights_only
            analysis = analyse_layer(src, plan.shape, layer_options, stats)
            energy = _audited_energy(analysis, src, stats.metric, audit, ranks) if audit is not None else None
            kept = (rotary.figures(closed_form_slots(src.q, analysis.mix, analysis.choice, analysis.shared, plan.shape))
                    if rotary else _construction_figures(analysis, src, plan.shape, layer_options, stats))
            layers.append(_layer_entry(i, analysis, kept, ranks, options.energy_targets, full, energy))
            if refining:
                refining.add(source, plan, rotary)
            del src, stats, analysis, source
    finally:
        reader.close()
    lopts = plan.layer

    return SpectraReport(
        mlaconv_version=__version__,
        source=str(folder),
        architecture=spec.family.label,
        mode="calibrated" if calibrated else "weights-only",
        shows=_shows(calibrated, streamer is not None, options.kv_keep is not None, refining is not None),
        window_sets=window_sets(streamer.split) if streamer else None,
        settings={k: v for k, v in asdict(options).items() if k not in ("ranks", "energy_targets")},
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        kv_elements_per_token_per_layer=spec.attention_shape.cache_elements,
        qk_rope_head_dim=shapes.rope_dim,
        rope_stride=lopts.rope_stride,
        matrix_rows=spec.attention_shape.cache_elements,  # [K; V] has a row per cached value
        full_rank=full,
        ranks=ranks,
        energy_targets=list(options.energy_targets),
        layers=layers,
        summary=_summary(layers),
        recommendation=_recommendation(recommended, options.kv_keep, spec.attention_shape.cache_elements, ranks,
                                       layers),
        seconds=round(time.perf_counter() - started, 3),
        refinement=refining.report(plan) if refining else None,
    )


def _check_targets(targets: tuple[float, ...]) -> None:
    if not targets:
        raise MlaconvError("--energy needs at least one target")
    for t in targets:
        if not 0 < t <= 1:
            raise MlaconvError(f"--energy targets must be in (0, 1], got {t}")


def _ranks(requested: list[int] | None, full: int, recommended: ShapeChoice | None) -> list[int]:
    if requested is not None:
        if not requested:
            raise MlaconvError("--ranks needs at least one rank")
        for r in requested:
            if not 1 <= r <= full:
                raise MlaconvError(f"--ranks: rank {r} is outside 1..{full} (the full rank of this model's latent)")
    ranks = set(requested if requested is not None else default_ranks(full))
    if recommended is not None:
        ranks.add(recommended.rank)
    return sorted(ranks)


def _shows(calibrated: bool, audited: bool, budget: bool, refined: bool = False) -> str:
    """What the spectra are of, in words, for the report."""
    if not calibrated:
        return ("weights-only: what convert keeps with these options (energy_retained and rope figures as convert "
                "reports them)")
    split = " at convert's (r, R) split" if refined else " at the default (r, R) split" if budget else ""
    text = ("the plain calibrated variant (whitened metric, measured attention profile, balanced latent)" + split
            + "; convert also measures other variants per layer"
            + (" and other splits" if budget and not refined else "")
            + " and keeps what its select windows favour (its layer_variant says what). energy_curve and "
            "rank_for_energy: the spectrum, in-sample")
    if not audited:
        return text + "; energy_retained and rope figures: in-sample (statistics given directly, no audit windows)"
    text += (" (fit windows); energy_retained and rope figures: measured on the audit windows, as convert reports "
             "them for this variant")
    if refined:
        text += ("; refinement: convert's own steps per layer (the variant it keeps, then refined), the closed form "
                 "and the refined layer measured on the audit windows")
    return text


def _audited_energy(analysis: LayerAnalysis, src: SourceAttention, metric: torch.Tensor, audit: torch.Tensor,
                    ranks: list[int]) -> list[float]:
    """energy_retained at each rank as convert measures it: the latent factored in ``metric`` (the fit windows),
    its balanced [K_nope; V] error measured in ``audit`` (the audit windows)."""
    d = analysis.k_nope.shape[0]
    energies = []
    for rank in ranks:
        lat = latent_math.factor(analysis.target, analysis.row_weight, metric, rank, analysis.spectrum)
        energies.append(latent_errors(analysis.k_nope, src.v, lat.up[:d], lat.up[d:], lat.down, audit)[2])
    return energies


def _unrotation_loss(src: SourceAttention, shape: AttentionShape, options: LayerOptions, analysis: LayerAnalysis,
                     stats: LayerStats | None) -> rope.UnrotationLoss:
    """What the key remainders (the rotation the shared key does not keep) cost the scores, over the rotating
    pairs, under the statistics the analysis used (``weights_only_stats`` when none were given)."""
    src = src.cast(dtype=torch.float64)
    stats = stats if stats is not None else weights_only_stats(src.input_norm, shape, options, src.rotated)
    pairs, group_of_head = rotating_pairs(shape, options), torch.arange(shape.heads) // shape.group

    def per_query_head(k: torch.Tensor) -> torch.Tensor:  # [n_kv·d, H] → E|k_g(h)^j|² [F_rot, N]
        return metric_math.energy(rope.complex_pairs(k, shape.kv_heads), stats.metric)[:pairs, group_of_head]

    return rope.unrotation_loss(query_energy_per_head(src.q, shape, stats.metric)[:pairs], per_query_head(src.k),
                                per_query_head(analysis.k_nope), stats.rotation_mean[:, :pairs])


def _construction_figures(analysis: LayerAnalysis, src: SourceAttention, shape: AttentionShape,
                         options: LayerOptions, stats: LayerStats | None) -> RotaryFigures:
    """The rotary figures of the construction itself, in the statistics it was built with (nothing audited)."""
    choice = analysis.choice
    return RotaryFigures(analysis.rope_energy_kept, choice.energy_kept_per_frequency, choice.loss_weighted_kept,
                         _unrotation_loss(src, shape, options, analysis, stats))


def _layer_entry(i: int, analysis: LayerAnalysis, kept: RotaryFigures, ranks: list[int],
                 targets: tuple[float, ...], full: int, energy: list[float] | None = None) -> LayerSpectrum:
    """One layer's row of the report; the spectrum is cut at the full rank (what lies beyond is zero).
    ``energy``: energy_retained per rank when measured on audit windows; ``kept``: the rotary figures."""
    spectrum = analysis.spectrum
    singular = spectrum.values[:full].sqrt()
    top = singular[0].item()
    curve = spectrum.energy_curve()[:full]
    needed = [rank_for_energy(curve, t) for t in targets]
    return LayerSpectrum(
        layer=i,
        energy_retained=energy if energy is not None else [spectrum.energy(r) for r in ranks],
        rank_for_energy=needed,
        rank_fraction_for_energy=[r / full for r in needed],
        rope_energy_kept=kept.energy_kept,
        rope_energy_kept_per_frequency=kept.energy_kept_per_frequency,
        rope_loss_weighted_kept=kept.loss_weighted_kept,
        rope_score_loss=kept.score.compensated,
        rope_score_loss_per_frequency=kept.score.compensated_per_frequency,
        rope_score_loss_without_mean_rotation=kept.score.uncompensated,
        rope_mean_rotation_recovers=kept.score.recovered,
        rope_frequencies=analysis.choice.frequencies.tolist(),
        singular_values=singular.tolist(),
        normalised_spectrum=(singular / top if top > 0 else torch.zeros_like(singular)).tolist(),
        energy_curve=curve.tolist(),
    )


def _summary(layers: list[LayerSpectrum]) -> SpectraSummary:
    def column(name: str) -> list[list[float]]:
        return [list(values) for values in zip(*(getattr(layer, name) for layer in layers))]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    rope_kept = [layer.rope_energy_kept for layer in layers]
    return SpectraSummary(
        energy_retained_mean=[mean(c) for c in column("energy_retained")],
        energy_retained_min=[min(c) for c in column("energy_retained")],
        rank_for_energy_mean=[mean(c) for c in column("rank_for_energy")],
        rank_for_energy_max=[max(c) for c in column("rank_for_energy")],
        rank_fraction_for_energy_mean=[mean(c) for c in column("rank_fraction_for_energy")],
        rope_energy_kept_mean=mean(rope_kept),
        rope_energy_kept_min=min(rope_kept),
        rope_score_loss_mean=mean([layer.rope_score_loss for layer in layers]),
        rope_score_loss_without_mean_rotation_mean=mean([layer.rope_score_loss_without_mean_rotation
                                                         for layer in layers]),
    )


def _recommendation(shapes: ShapeChoice | None, kv_keep: float | None, source_elements: int, ranks: list[int],
                    layers: list[LayerSpectrum]) -> Recommendation | None:
    if shapes is None:
        return None
    column = ranks.index(shapes.rank)
    energy = [layer.energy_retained[column] for layer in layers]
    return Recommendation(
        kv_keep=kv_keep,
        kv_lora_rank=shapes.rank,
        qk_rope_head_dim=shapes.rope_dim,
        kv_elements_per_token_per_layer=shapes.cache_elements,
        kv_keep_actual=shapes.cache_elements / source_elements,
        reason=shapes.reason,
        energy_retained=energy,
        energy_retained_mean=sum(energy) / len(energy),
    )


def write_csv(report: SpectraReport, path: Path) -> None:
    """One row per layer: energy at each rank, rank for each target, RoPE energy kept."""
    header = (["layer"] + [f"energy_at_rank_{r}" for r in report.ranks]
              + [f"rank_for_energy_{t:g}" for t in report.energy_targets]
              + ["rope_energy_kept", "rope_loss_weighted_kept", "top_singular_value"])
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for layer in report.layers:
            top = layer.singular_values[0] if layer.singular_values else 0.0
            writer.writerow([layer.layer, *layer.energy_retained, *layer.rank_for_energy, layer.rope_energy_kept,
                             layer.rope_loss_weighted_kept, top])
