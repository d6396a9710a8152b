"""plot.py: the spectra figure has a curve per layer (a colour bar for many), and the PNG is written."""

from __future__ import annotations

import sys

import pytest

from mlaconv.errors import MlaconvError
from mlaconv.inspect.plot import require_matplotlib, save_spectra_plot, spectra_figure
from mlaconv.inspect.spectra import SpectraOptions, spectra


def test_plot_draws_one_curve_per_layer_and_writes_a_png(stories_report, tmp_path):
    figure = spectra_figure(stories_report)
    panels = [ax for ax in figure.axes if ax.lines]
    assert len(panels) == 2
    for ax in panels:
        assert [line.get_label() for line in ax.lines] == [f"layer {i}" for i in range(5)]
        assert all(len(line.get_xdata()) == 56 for line in ax.lines)
    path = tmp_path / "spectra.png"
    save_spectra_plot(stories_report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
        assert image.size[0] > 800


def test_plot_of_many_layers_uses_a_colour_bar(tiny_model):
    report = spectra(str(tiny_model(layers=12, hidden=32, kv_heads=1, heads=2)), SpectraOptions(rope_dim=8))
    figure = spectra_figure(report)
    panels = [ax for ax in figure.axes if ax.lines]
    assert [len(ax.lines) for ax in panels] == [12, 12]
    assert all(ax.get_legend() is None for ax in panels)
    assert any(ax.get_label() == "<colorbar>" for ax in figure.axes)


def test_missing_matplotlib_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MlaconvError, match=r"pip install 'mlaconv\[plot\]'"):
        require_matplotlib()
