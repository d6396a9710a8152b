"""docs/report.md lists every key of every report, once: checked against real reports of the three commands, whose
``to_json()`` objects ``from_json`` reads back into the same reports."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import check_documented, documented, random_tokens, write_tokens
from mlaconv import (ConversionReport, ConvertOptions, EvalReport, SpectraOptions, SpectraReport, TokenSource, convert,
                     evaluate_perplexity, inspect_spectra)
from mlaconv.report.record import Failure


def test_the_parser_reads_the_document():
    sections = documented()
    assert {"convert", "convert.calibration", "spectra", "spectra.layers[]", "eval"} <= set(sections)
    assert sections["convert"]["kv_keep"] is True and sections["convert"]["calibration"] is False
    with pytest.raises(AssertionError, match="undocumented"):
        check_documented("convert.target", {"name": 1, "surprise": 2})


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from helpers import make_model

    tmp = tmp_path_factory.mktemp("schema")
    src = make_model(tmp / "src", "qwen2", layers=2, head_dim=32)
    calib = write_tokens(tmp / "calib.jsonl", random_tokens(20, 24, 96, seed=1))
    ids = write_tokens(tmp / "eval.jsonl", random_tokens(4, 32, 96, seed=2))
    converted = convert(str(src), tmp / "out", ConvertOptions(
        kv_keep=0.5, calib=[str(calib)], calib_window=24, refine_steps=2, target="transformers",
        eval_tokens=str(ids), context=24))  # a served context short enough for two splits to be compared
    spectra = inspect_spectra(str(src), SpectraOptions(kv_keep=0.5, calib=[str(calib)], calib_window=24))
    return converted, spectra


def test_convert_report_keys_are_documented(reports):
    converted, _ = reports
    assert converted.mode == "calibrated" and converted.shape_search.candidates
    written = converted.to_json()
    check_documented("convert", written)
    for section in ("target", "shape_search", "calibration", "verify"):
        check_documented(f"convert.{section}", written[section])
    check_documented("convert.calibration.whole_model", written["calibration"]["whole_model"])
    check_documented("eval", written["eval"])


def test_spectra_report_keys_are_documented(reports):
    _, spectra = reports
    written = spectra.to_json()
    check_documented("spectra", written)
    check_documented("spectra.summary", written["summary"])
    check_documented("spectra.recommendation", written["recommendation"])
    for layer in written["layers"]:
        check_documented("spectra.layers[]", layer)


def test_eval_report_keys_are_documented_without_a_baseline(reports, tmp_path):
    converted, _ = reports
    ids = write_tokens(tmp_path / "ids.jsonl", random_tokens(2, 32, 96, seed=3))
    alone = evaluate_perplexity(converted.output, source=TokenSource(tokens=ids))
    assert alone.baseline is None
    written = alone.to_json()
    check_documented("eval", written)
    assert not [key for key in written if key.startswith("baseline_") or key in ("drift", "kv_kept")]
    assert EvalReport.from_json(written) == alone


def test_reports_read_back_from_json_as_they_were(reports, tmp_path):
    """``from_json`` inverts ``to_json``: the written OUT/mlaconv.json, and each report through a JSON round trip."""
    converted, spectra = reports
    on_disk = json.loads((Path(converted.output) / "mlaconv.json").read_text())
    assert on_disk == {key: value for key, value in json.loads(json.dumps(converted.to_json())).items()
                       if key != "seconds"}
    assert ConversionReport.from_json(on_disk) == replace(converted, seconds=None)
    assert ConversionReport.from_json(json.loads(json.dumps(converted.to_json()))) == converted
    assert SpectraReport.from_json(json.loads(json.dumps(spectra.to_json()))) == spectra
    failed = replace(converted, verify=Failure("the built-in check failed: out of memory"), eval=None)
    written = failed.to_json()
    assert written["verify"] == {"error": "the built-in check failed: out of memory"} and "eval" not in written
    assert ConversionReport.from_json(written) == failed
    assert ConversionReport.from_json(written | {"added_by_a_newer_version": 1}) == failed  # unknown keys: left out


def test_heal_report_keys_are_documented(reports, tmp_path):
    from mlaconv.heal import HealOptions, heal
    from mlaconv.calibration.windows import CalibrationData

    converted, _ = reports
    ids = write_tokens(tmp_path / "ids.jsonl", random_tokens(24, 24, 96, seed=4))
    report = heal(converted.output, converted.source, tmp_path / "healed", CalibrationData((str(ids),), None, "ids"),
                  HealOptions(window=24, tokens=96 * 2, check_every=1))
    written = json.loads((tmp_path / "healed" / "mlaconv.json").read_text())
    check_documented("convert", written | {"seconds": 0.0})  # mlaconv.json is written before the wall time is known
    check_documented("convert.heal", written["heal"])
    check_documented("convert.verdict", written["verdict"])
    printed = json.loads(json.dumps(report.to_json()))  # what `mlaconv heal --json` prints: the verdict added
    assert printed.pop("verdict") == written["verdict"] and written["heal"] == printed
    assert ConversionReport.from_json(written).heal == replace(report, verdict=None)
