"""``inspect spectra --refine``: convert's own per-layer steps, closed form and refined layer on the audit windows,
in the JSON and on a console of fixed (unlimited) width; the ``shows`` line; refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers import invoke

OPTIONS = ["--kv-keep", "0.3125", "--rope-dim", "8", "--calib-window", "24", "--refine-steps", "20", "--device", "cpu"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The same small GQA model (r + R = 12 + 8 of 64) through ``convert --json`` and ``inspect spectra --refine
    --json``: 16 calibration windows of 24 (8 fit, 4 select, 4 audit)."""
    from helpers import make_model

    tmp = tmp_path_factory.mktemp("spectra-refine")
    src = make_model(tmp / "src", "llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=2)
    ids = torch.randint(0, 96, (16, 24), generator=torch.Generator().manual_seed(4))
    calib = tmp / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    inspected = invoke("inspect", "spectra", src, "--calib", calib, "--refine", *OPTIONS, "--quiet", "--json")
    assert inspected.exit_code == 0, inspected.output
    converted = invoke("convert", src, tmp / "out", "--calib", calib, *OPTIONS, "--no-verify", "--quiet", "--json")
    assert converted.exit_code == 0, converted.output
    return json.loads(inspected.stdout), inspected.stderr, json.loads(converted.stdout)


FIGURES = ("attention_error", "energy_retained", "rope_energy_kept", "rope_loss_weighted_kept", "rope_score_loss")


def test_refine_reports_per_layer_what_convert_measures_for_both_models(reports):
    spectra, _, converted = reports
    refinement, calibration = spectra["refinement"], converted["calibration"]
    assert (refinement["kv_lora_rank"], refinement["qk_rope_head_dim"]) == (converted["kv_lora_rank"], 8) == (12, 8)
    assert spectra["window_sets"] == calibration["window_sets"]
    assert refinement["refine_steps"] == calibration["refine_steps"] == 20
    refined_layers = 0
    for i, layer in enumerate(refinement["layers"]):
        assert layer["selection"] == calibration["selection"][i]
        for model, name in (("closed_form", "closed_form"), ("refined", "refined")):
            figures = layer[model]
            if figures is None:
                assert calibration[name]["attention_error"][i] is None
                continue
            for figure in FIGURES:
                assert figures[figure] == pytest.approx(calibration[name][figure][i], rel=1e-9), (i, model, figure)
        refined_layers += layer["refined"] is not None
    assert refined_layers, "no layer refined: the refined column would check nothing"
    # the written layers' figures are the written model's (per layer: refined where it was, else the closed form)
    written = calibration["refined"] if calibration["whole_model"]["written"] == "refined" else calibration["closed_form"]
    for i, kept in enumerate(converted["rope_energy_kept"]):
        own = written["rope_energy_kept"][i]
        assert kept == (own if own is not None else calibration["closed_form"]["rope_energy_kept"][i])
    assert "refined" in spectra["shows"] and "audit windows" in spectra["shows"]


def test_the_console_shows_what_the_spectra_show_and_both_models_per_layer(reports):
    spectra, console, _ = reports
    lines = console.splitlines()
    assert f"shows: {spectra['shows']}" in lines
    start = next(i for i, text in enumerate(lines) if text.startswith("refinement per layer at r = 12, R = 8"))
    rows = [text.rstrip().split(None, 7) for text in lines[start + 1:] if re.match(r"^\s*\d+\s", text)][:spectra["num_layers"]]
    assert len(rows) == spectra["num_layers"]
    for row, layer in zip(rows, spectra["refinement"]["layers"]):
        expected = [str(layer["layer"])]
        for figure in ("attention_error", "rope_score_loss", "rope_energy_kept"):
            expected += [f"{layer['closed_form'][figure]:.4f}",
                         f"{layer['refined'][figure]:.4f}" if layer["refined"] else "—"]
        assert row == [*expected, layer["selection"]["kept"]]
    start = next(i for i, text in enumerate(lines) if text.startswith("rotary figures per layer, measured on the audit"))
    rows = [text.split() for text in lines[start + 1:] if re.match(r"^\s*\d+\s", text)][:spectra["num_layers"]]
    for row, layer in zip(rows, spectra["layers"]):
        losses = layer["rope_score_loss_per_frequency"]
        at_kept = sum(losses[j] for j in layer["rope_frequencies"])
        dropped = sum(loss for j, loss in enumerate(losses) if j not in layer["rope_frequencies"])
        worst = max(range(len(losses)), key=losses.__getitem__)
        assert row == [str(layer["layer"]), *(f"{layer[k]:.4f}" for k in (
            "rope_energy_kept", "rope_loss_weighted_kept", "rope_score_loss", "rope_score_loss_without_mean_rotation",
            "rope_mean_rotation_recovers")), f"{at_kept:.4f}", f"{dropped:.4f}",
            f"{worst}:", f"{losses[worst]:.4f}"]


@pytest.mark.parametrize("args, message", [
    (["--refine", "--kv-keep", "0.5"], "give --calib or --calib-dataset"),
    (["--refine", "--calib", "{calib}"], "give --kv-keep"),
    (["--refine-steps", "5", "--kv-keep", "0.5", "--calib", "{calib}"], "give --refine too"),
])
def test_refine_is_refused_without_what_it_needs(args, message, tiny_model, tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": list(range(24))}) + "\n" for _ in range(4)))
    src = tiny_model(head_dim=16)
    result = invoke("inspect", "spectra", src, *(a.format(calib=calib) for a in args), "--json")
    assert result.exit_code == 1, result.output
    assert message in json.loads(result.stdout)["error"]
