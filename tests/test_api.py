"""The declared Python API: ``from mlaconv import …`` gives the library's own functions, the README's example
runs as written, and a recipe applies outside the CLI (``ConvertOptions.from_recipe``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import mlaconv
from helpers import ROOT
from mlaconv.errors import MlaconvError



def test_the_public_names_are_the_library_functions():
    from mlaconv.conversion.options import ConvertOptions
    from mlaconv.conversion.run import convert
    from mlaconv.evaluate.perplexity import evaluate_perplexity
    from mlaconv.io.text import TokenSource
    from mlaconv.target.gguf import export_gguf
    from mlaconv.report import ConversionReport, EvalReport, RetrievalReport, SpectraReport
    from mlaconv.evaluate.retrieval import evaluate_retrieval
    from mlaconv.inspect.spectra import SpectraOptions, spectra

    expected = {"convert": convert, "ConvertOptions": ConvertOptions, "inspect_spectra": spectra,
                "SpectraOptions": SpectraOptions, "evaluate_perplexity": evaluate_perplexity,
                "evaluate_retrieval": evaluate_retrieval, "RetrievalReport": RetrievalReport,
                "TokenSource": TokenSource, "export_gguf": export_gguf, "MlaconvError": MlaconvError,
                "ConversionReport": ConversionReport, "SpectraReport": SpectraReport, "EvalReport": EvalReport}
    assert set(mlaconv.__all__) == {"__version__", *expected}
    for name, value in expected.items():
        assert getattr(mlaconv, name) is value, name
    with pytest.raises(AttributeError, match="no attribute 'convert_everything'"):
        mlaconv.convert_everything  # noqa: B018


def test_import_mlaconv_does_not_import_torch():
    code = "import sys, mlaconv; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_readme_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1].startswith("KV cache 50% of the source's; check: KL ")
    drift = re.fullmatch(r"drift ([+-]\d+\.\d+)% over 8 windows", lines[2])
    assert drift and abs(float(drift.group(1))) < 50, lines
    gguf = tmp_path / "out" / "api-mla-q8_0.gguf"
    assert int(lines[3]) == gguf.stat().st_size and gguf.read_bytes()[:4] == b"GGUF"
    report = json.loads((tmp_path / "out" / "api-mla" / "mlaconv.json").read_text())
    assert report["kv_keep"] == 0.5


def test_a_recipe_applies_through_convert_options(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("rank: 12\nrope_dim: 8\nverify: false\n")
    options = mlaconv.ConvertOptions.from_recipe(recipe, rank=10, rope_dim=None, force=True)
    assert (options.rank, options.rope_dim, options.verify, options.force, options.recipe.path) == (10, 8, False, True,
                                                                                                  recipe)
    report = mlaconv.convert(str(src), tmp_path / "out", options)
    assert (report.kv_lora_rank, report.qk_rope_head_dim) == (10, 8)
    assert report.settings["recipe"] == str(recipe)
    recipe.write_text("rank: 12\nkv_keep: 0.5\n")
    with pytest.raises(MlaconvError, match="must set exactly one of rank and kv_keep"):
        mlaconv.ConvertOptions.from_recipe(recipe)


def test_a_recipe_given_with_a_rank_converts_at_that_rank(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("kv_keep: 0.5\nrope_dim: 8\nverify: false\ndtype: float32\n")
    with pytest.raises(TypeError, match="ConvertOptions.from_recipe"):
        mlaconv.ConvertOptions(recipe=str(recipe), rank=12)  # a path alone applies nothing: refused, not ignored
    report = mlaconv.convert(str(src), tmp_path / "out", mlaconv.ConvertOptions.from_recipe(recipe, rank=12))
    assert (report.kv_lora_rank, report.qk_rope_head_dim, report.dtype, report.verify) == (12, 8, "float32", None)
    assert report.settings["recipe"] == str(recipe) and report.settings["kv_keep"] is None  # rank given: kv_keep goes
