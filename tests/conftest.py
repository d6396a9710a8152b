"""Shared fixtures: tiny models built in the test, the bundled real stories260K and its spectra, and a small source
for the refusal tests. Everything else the tests share is in ``helpers``."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import STORIES, make_model


@pytest.fixture
def tiny_model(tmp_path):
    def build(name: str = "src", **kwargs) -> Path:
        return make_model(tmp_path / name, **kwargs)

    return build


@pytest.fixture(scope="session")
def stories() -> Path:
    return STORIES


@pytest.fixture(scope="module")
def stories_report(stories):
    """``inspect spectra`` of stories260K at a 50% cut."""
    from mlaconv.inspect.spectra import SpectraOptions, spectra

    return spectra(str(stories), SpectraOptions(kv_keep=0.5))


@pytest.fixture
def src(tmp_path) -> Path:
    """A small random Llama (head_dim 16) for the refusal tests."""
    return make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16)
