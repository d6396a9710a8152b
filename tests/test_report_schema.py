"""docs/report.md lists every key of every report, once: checked against real reports of the three commands, whose
``to_json()`` objects ``from_json`` reads back into the same reports."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from mlaconv import (ConversionReport, ConvertOptions, EvalReport, SpectraOptions, SpectraReport, TokenSource, convert,
                     evaluate_perplexity, inspect_spectra)
from mlaconv.report.record import Failure

DOC = ROOT / "docs" / "report.md"
HEADING = re.compile(r"^#+ `([\w.\[\]]+)`\s*$")
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \|")


def documented() -> dict[str, dict[str, bool]]:
    """Section → key → whether the key is marked *always* present."""
    sections: dict[str, dict[str, bool]] = {}
    current = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if (heading := HEADING.match(line)):
            current = sections.setdefault(heading.group(1), {})
        elif current is not None and (row := ROW.match(line)):
            current[row.group(1)] = row.group(2).strip() == "always"
    return sections


def check(section: str, report: dict) -> None:
    keys = documented()[section]
    assert set(report) <= set(keys), f"{section}: undocumented {sorted(set(report) - set(keys))}"
    missing = [key for key, always in keys.items() if always and key not in report]
    assert missing == [], f"{section}: documented as always present but missing"


def test_the_parser_reads_the_document():
    sections = documented()
    assert {"convert", "convert.calibration", "spectra", "spectra.layers[]", "eval"} <= set(sections)
    assert sections["convert"]["kv_keep"] is True and sections["convert"]["calibration"] is False
    with pytest.raises(AssertionError, match="undocumented"):
        check("convert.target", {"name": 1, "surprise": 2})


def write_ids(path: Path, rows: int, length: int, vocab: int, seed: int) -> Path:
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    return path


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from conftest import make_model

    tmp = tmp_path_factory.mktemp("schema")
    src = make_model(tmp / "src", "qwen2", layers=2, head_dim=16)
    calib = write_ids(tmp / "calib.jsonl", 20, 24, 96, seed=1)
    ids = write_ids(tmp / "eval.jsonl", 4, 32, 96, seed=2)
    converted = convert(str(src), tmp / "out", ConvertOptions(
        kv_keep=0.5, calib=[str(calib)], calib_window=24, refine_steps=2, target="transformers",
        eval_tokens=str(ids)))
    spectra = inspect_spectra(str(src), SpectraOptions(kv_keep=0.5, calib=[str(calib)], calib_window=24))
    return converted, spectra


def test_convert_report_keys_are_documented(reports):
    converted, _ = reports
    assert converted.mode == "calibrated" and converted.shape_search.candidates
    written = converted.to_json()
    check("convert", written)
    for section in ("target", "shape_search", "calibration", "verify"):
        check(f"convert.{section}", written[section])
    check("convert.calibration.whole_model", written["calibration"]["whole_model"])
    check("eval", written["eval"])


def test_spectra_report_keys_are_documented(reports):
    _, spectra = reports
    written = spectra.to_json()
    check("spectra", written)
    check("spectra.summary", written["summary"])
    check("spectra.recommendation", written["recommendation"])
    for layer in written["layers"]:
        check("spectra.layers[]", layer)


def test_eval_report_keys_are_documented_without_a_baseline(reports, tmp_path):
    converted, _ = reports
    ids = write_ids(tmp_path / "ids.jsonl", 2, 32, 96, seed=3)
    alone = evaluate_perplexity(converted.output, source=TokenSource(tokens=ids))
    assert alone.baseline is None
    written = alone.to_json()
    check("eval", written)
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
    failed = replace(converted, verify=Failure("the built-in check failed: out of memory"), eval=None,
                     extra={"note": "added by a caller"})
    written = failed.to_json()
    assert written["verify"] == {"error": "the built-in check failed: out of memory"} and "eval" not in written
    assert list(written)[-2:] == ["note", "seconds"]
    assert ConversionReport.from_json(written) == failed


def test_heal_report_keys_are_documented(reports, tmp_path):
    from mlaconv.heal import HealOptions, heal
    from mlaconv.calibration.windows import CalibrationData

    converted, _ = reports
    ids = write_ids(tmp_path / "ids.jsonl", 24, 24, 96, seed=4)
    report = heal(converted.output, converted.source, tmp_path / "healed", CalibrationData((str(ids),), None, "ids"),
                  HealOptions(window=24, tokens=96 * 2, check_every=1))
    written = json.loads((tmp_path / "healed" / "mlaconv.json").read_text())
    check("convert", written | {"seconds": 0.0})  # mlaconv.json is written before the wall time is known
    check("convert.heal", written["heal"])
    check("convert.verdict", written["verdict"])
    printed = json.loads(json.dumps(report.to_json()))  # what `mlaconv heal --json` prints: the verdict added
    assert printed.pop("verdict") == written["verdict"] and written["heal"] == printed
    assert ConversionReport.from_json(written).heal == replace(report, verdict=None)
