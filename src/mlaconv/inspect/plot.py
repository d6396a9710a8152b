"""Figures of ``inspect`` reports (matplotlib, the optional ``plot`` extra, imported only when needed).

The figures are drawn on matplotlib's Agg canvas directly, without pyplot, so nothing touches a
global backend or opens a window.
"""

from __future__ import annotations

import math
from pathlib import Path

from mlaconv.errors import MlaconvError
from mlaconv.report import SpectraReport

LEGEND_MAX_LAYERS = 10  # beyond this, a colour bar names the layers instead of a legend


def require_matplotlib() -> None:
    """Fail in one line, before any long work, when the ``plot`` extra is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MlaconvError("--plot needs matplotlib: pip install 'mlaconv[plot]'") from None


def spectra_figure(report: SpectraReport):
    """Two panels, one curve per layer in each: normalised singular values, and energy kept against rank.

    ``report`` is what ``mlaconv.inspect.spectra.spectra`` returns; returns a matplotlib ``Figure``.
    """
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    layers = report.layers
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    spectrum_ax, energy_ax = figure.subplots(1, 2)
    norm = Normalize(0, max(len(layers) - 1, 1))
    cmap = colormaps["viridis"]
    for layer in layers:
        colour = cmap(norm(layer.layer))
        ranks = range(1, len(layer.energy_curve) + 1)
        values = [v if v > 0 else math.nan for v in layer.normalised_spectrum]  # log axis: gaps for zeros
        spectrum_ax.plot(ranks, values, color=colour, linewidth=1.2, label=f"layer {layer.layer}")
        energy_ax.plot(ranks, layer.energy_curve, color=colour, linewidth=1.2, label=f"layer {layer.layer}")

    spectrum_ax.set_yscale("log")
    spectrum_ax.set_xlabel("index i")
    spectrum_ax.set_ylabel("σᵢ / σ₁")
    spectrum_ax.set_title("normalised singular values of [K_nope; V]")
    spectrum_ax.grid(True, which="major", alpha=0.3)

    full = report.full_rank
    energy_ax.set_xlim(0, full + 1)
    energy_ax.set_ylim(0, 1.01)
    targets = report.energy_targets
    base = [t for t in (0.0, 0.25, 0.5, 0.75, 1.0) if all(abs(t - target) > 0.04 for target in targets)]
    energy_ax.set_yticks(sorted({*base, *targets}))
    share = energy_ax.secondary_xaxis("top", functions=(lambda r: r / full, lambda f: f * full))
    share.set_xlabel("share of the singular values")
    share.xaxis.set_major_formatter(PercentFormatter(1.0))
    energy_ax.set_xlabel(f"latent rank r (full rank {full})")
    energy_ax.set_ylabel("energy retained")
    energy_ax.set_title("energy retained at rank r (gridlines: targets)", fontsize="medium")
    energy_ax.grid(True, alpha=0.3)

    if len(layers) <= LEGEND_MAX_LAYERS:
        energy_ax.legend(loc="lower right", fontsize="small")
    else:
        figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=[spectrum_ax, energy_ax], label="layer")
    figure.suptitle(f"{Path(report.source).name}: {report.mode}, R = {report.qk_rope_head_dim} rope dims, "
                    f"stride {report.rope_stride}, mean RoPE energy kept {report.summary.rope_energy_kept_mean:.1%}")
    return figure


def save_spectra_plot(report: SpectraReport, path: Path) -> None:
    """Write ``spectra_figure(report)`` as a PNG."""
    spectra_figure(report).savefig(path, format="png", dpi=120)
