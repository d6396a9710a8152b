"""The shipped calibration text is what ``tools/general_text.py`` composes from the sources its SOURCES names."""

from __future__ import annotations

import importlib.util

import pytest

from helpers import ROOT


def general_text():
    spec = importlib.util.spec_from_file_location("general_text", ROOT / "tools" / "general_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_text_unpacks_into_its_sources_and_composes_again(tmp_path):
    tool = general_text()
    shipped = tool.OUT.read_text(encoding="utf-8")
    tool.unpack(shipped, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tool.SOURCES)
    for name, share in tool.SOURCES.items():  # each source gave its share, cut at a blank line after it
        size = len(tmp_path.joinpath(name).read_text(encoding="utf-8"))
        assert share <= size < share + 2 * tool.BLOCK, name
    assert tool.compose(tmp_path) == shipped


def test_unpacking_with_other_sources_than_composed_the_text_is_refused(tmp_path):
    tool = general_text()
    shipped = tool.OUT.read_text(encoding="utf-8")
    tool.SOURCES = {**tool.SOURCES, "extra.txt": 50_000}
    with pytest.raises(SystemExit, match="do not compose the text again"):
        tool.unpack(shipped, tmp_path)
