"""spectra.py (``inspect spectra``): the spectra are convert's own and exact, the report has the documented keys,
and the CSV has a row per layer."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT
from mlaconv.cli.inspect import spectra as spectra_command
from mlaconv.conversion.calibrated import calibrated_layer_options
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.plan import layer_options, plan_shapes
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.inspect.spectra import SpectraOptions, default_ranks, rank_for_energy, spectra, write_csv
from mlaconv.mla.attention import analyse_layer, convert_attention
from mlaconv.mla.layer import LayerStats
from mlaconv.source.spec import load_source
from mlaconv.source.weights import SourceWeights
from mlaconv.target.targets import target
from helpers import LAYER_KEYS, RECOMMENDATION_KEYS, SUMMARY_KEYS, TOP_KEYS, check_schema


def run_convert(src, out, **options):
    return convert(str(src), out, ConvertOptions(verify=False, **options))


def test_mqa_spectrum_is_the_svd_of_the_balanced_values(tiny_model):
    """MQA with R = d keeps every key rotated, so the latent matrix is V·diag(γ), balanced to unit norm."""
    src = tiny_model(kv_heads=1, head_dim=16, layers=2)
    report = spectra(str(src), SpectraOptions(rope_dim=16, energy_targets=(0.5, 0.9, 0.99, 1.0)))
    weights = load_file(src / "model.safetensors")
    assert report.full_rank == 16 and report.ranks == [1, 2, 4, 8, 16]
    for layer in report.layers:
        prefix = f"model.layers.{layer.layer}."
        matrix = weights[prefix + "self_attn.v_proj.weight"].double() * weights[prefix + "input_layernorm.weight"].double()
        singular = torch.linalg.svdvals(matrix)
        energy = (singular**2).cumsum(0) / (singular**2).sum()
        # The balancing weight 1/‖V·diag(γ)‖ reaches the matrix rounded to float32 (latent_target), hence 1e-7.
        torch.testing.assert_close(torch.tensor(layer.singular_values, dtype=torch.float64), singular / matrix.norm(),
                                   rtol=1e-7, atol=0)
        torch.testing.assert_close(torch.tensor(layer.normalised_spectrum, dtype=torch.float64), singular / singular[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(torch.tensor(layer.energy_curve, dtype=torch.float64), energy, rtol=1e-10, atol=1e-12)
        assert layer.energy_retained == pytest.approx([energy[r - 1].item() for r in report.ranks], abs=1e-12)
        expected = [int((energy < t - 1e-12).sum()) + 1 for t in report.energy_targets]
        assert layer.rank_for_energy == expected and expected[-1] == 16
        assert layer.rope_energy_kept == pytest.approx(1.0)


def test_energy_is_monotone_and_complete_at_full_rank(stories):
    report = spectra(str(stories), SpectraOptions(ranks=list(range(1, 57))))
    assert report.full_rank == 56
    for layer in report.layers:
        energy = layer.energy_retained
        assert all(a <= b for a, b in zip(energy, energy[1:]))
        assert energy[-1] == pytest.approx(1.0, abs=1e-12)
        assert energy == pytest.approx(layer.energy_curve, abs=1e-15)
        spectrum = layer.normalised_spectrum
        assert spectrum[0] == 1.0 and all(a >= b for a, b in zip(spectrum, spectrum[1:]))
        assert layer.rank_fraction_for_energy == [r / 56 for r in layer.rank_for_energy]


def test_rank_for_energy_and_default_ranks():
    curve = torch.tensor([0.5, 0.8, 0.95, 1.0 - 1e-16], dtype=torch.float64)
    assert [rank_for_energy(curve, t) for t in (0.1, 0.5, 0.81, 0.95, 1.0)] == [1, 1, 3, 3, 4]
    assert default_ranks(56) == [1, 2, 4, 8, 16, 32, 56]
    assert default_ranks(1984) == [32, 64, 128, 256, 512, 1024, 1984]
    assert default_ranks(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_ranks(1) == [1]


def checkpoint_values(out, i: int) -> torch.Tensor:
    """[N, V, H]: what the written layer i computes as each head's value of an RMS-normalised hidden state ĥ,
    read from the DeepSeek-V3 tensors (kv_b_proj's value rows · kv_a_layernorm linearised by the tiny latent ·
    kv_a_proj · the written input_layernorm weight)."""
    config = json.loads((out / "config.json").read_text())
    N, r, P, V = (config[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"))
    weights = {}
    for shard in set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()):
        weights.update(load_file(out / shard))
    prefix = f"model.layers.{i}.self_attn."
    down = weights[prefix + "kv_a_proj_with_mqa.weight"].double()[:r]  # [r, H]
    norm = weights[prefix + "kv_a_layernorm.weight"].double() / config["rms_norm_eps"] ** 0.5  # [r]
    up = weights[prefix + "kv_b_proj.weight"].double().reshape(N, P + V, r)[:, P:]  # [N, V, r]
    input_norm = weights[f"model.layers.{i}.input_layernorm.weight"].double()  # [H]
    return up @ (norm[:, None] * down * input_norm)


def source_values(src, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The source's values per query head [N, d, H] (GQA groups repeated) and its input norm γ [H]."""
    config = json.loads((src / "config.json").read_text())
    weights = load_file(src / "model.safetensors")
    N, G = config["num_attention_heads"], config["num_key_value_heads"]
    v = weights[f"model.layers.{i}.self_attn.v_proj.weight"].double()
    v = v.reshape(G, -1, v.shape[-1]).repeat_interleave(N // G, dim=0)
    return v, weights[f"model.layers.{i}.input_layernorm.weight"].double()


def relative_value_error(src, out, i: int) -> float:
    """‖(V − V̂)·diag γ‖² / ‖V·diag γ‖²: the value error on inputs with E[x̂ x̂ᵀ] = diag γ² (weights-only)."""
    v, gamma = source_values(src, i)
    return ((v * gamma - checkpoint_values(out, i)).pow(2).sum() / (v * gamma).pow(2).sum()).item()


def test_energy_is_the_optimal_truncation_measured_on_the_written_checkpoint(tiny_model, tmp_path):
    """MQA with R = d keeps every key rotated, so the latent only carries the values: by Eckart–Young the best
    rank-r error of V·diag γ is the tail of its singular values. Convert's checkpoint must reach it, and
    both commands must report it, all computed here from the weight files."""
    src = tiny_model(kv_heads=1, head_dim=16, layers=2, seed=4)
    rank = 6
    converted = run_convert(src, tmp_path / "out", rank=rank, rope_dim=16)
    report = spectra(str(src), SpectraOptions(ranks=[rank], rope_dim=16))
    for i in range(2):
        v, gamma = source_values(src, i)
        singular = torch.linalg.svdvals((v[0] * gamma))
        optimum = ((singular[:rank] ** 2).sum() / (singular**2).sum()).item()
        measured = relative_value_error(src, tmp_path / "out", i)
        assert 1 - measured == pytest.approx(optimum, abs=1e-6)
        assert converted.energy_retained.per_layer[i] == pytest.approx(optimum, abs=1e-6)
        assert report.layers[i].energy_retained[0] == pytest.approx(optimum, abs=1e-6)
        assert converted.value_error[i] == pytest.approx(measured, rel=1e-4)
        assert 0.05 < measured < 0.95  # a real truncation


@pytest.mark.parametrize("model", ["tiny-gqa", "stories"])
def test_inspect_reports_what_convert_reports(model, tiny_model, stories, tmp_path):
    if model == "stories":
        src, options = stories, {}
    else:  # two candidate strides, so the model-wide stride choice is exercised too
        src, options = tiny_model(kv_heads=2, head_dim=16, layers=3, seed=3), {"rope_dim": 8}
    converted = run_convert(src, tmp_path / "out", rank=24, **options)
    report = spectra(str(src), SpectraOptions(ranks=[24], **options))
    check_schema(report.to_json())
    assert report.rope_stride == converted.rope_stride
    assert report.qk_rope_head_dim == converted.qk_rope_head_dim
    energy = [layer.energy_retained[0] for layer in report.layers]
    assert energy == pytest.approx(converted.energy_retained.per_layer, abs=1e-12, rel=0)
    assert [layer.rope_energy_kept for layer in report.layers] == pytest.approx(converted.rope_energy_kept,
                                                                                    abs=1e-12, rel=0)
    for layer, per_frequency in zip(report.layers, converted.rope_energy_kept_per_frequency):
        assert layer.rope_energy_kept_per_frequency == pytest.approx(per_frequency, abs=1e-12, rel=0)
    # What convert reports about its values is what its written tensors do (measured from the files here).
    measured = [relative_value_error(Path(src), tmp_path / "out", i) for i in range(report.num_layers)]
    assert converted.value_error == pytest.approx(measured, rel=1e-4, abs=1e-7)


def test_a_bfloat16_source_is_analysed_in_the_precision_convert_factors_it_in(tiny_model, tmp_path, monkeypatch):
    """Weights only, a bfloat16 output is factored in float32 (``plan.factor_precision``): by ``convert`` and by
    ``inspect spectra`` alike, which then agree to float32's rounding."""
    import mlaconv.mla.attention
    import mlaconv.inspect.spectra

    seen = []

    def recording(src, shape, options, stats=None):
        seen.append(options.precision)
        return analyse_layer(src, shape, options, stats)

    monkeypatch.setattr(mlaconv.mla.attention, "analyse_layer", recording)
    monkeypatch.setattr(mlaconv.inspect.spectra, "analyse_layer", recording)
    src = tiny_model(kv_heads=2, head_dim=16, layers=3, seed=3, dtype=torch.bfloat16)
    converted = run_convert(src, tmp_path / "out", rank=24, rope_dim=8)
    report = spectra(str(src), SpectraOptions(ranks=[24], rope_dim=8))
    assert seen == [torch.float32] * 6
    energy = [layer.energy_retained[0] for layer in report.layers]
    assert energy == pytest.approx(converted.energy_retained.per_layer, abs=1e-6, rel=0)


def test_kv_keep_recommends_what_convert_picks(tiny_model, tmp_path):
    """A small budget makes convert shrink R below its default; inspect must analyse that same R."""
    src = tiny_model(kv_heads=2, head_dim=16)
    converted = run_convert(src, tmp_path / "out", kv_keep=0.25)
    report = spectra(str(src), SpectraOptions(kv_keep=0.25, ranks=[2, 4]))
    check_schema(report.to_json())
    advice = report.recommendation
    assert (advice.kv_lora_rank, advice.qk_rope_head_dim) == (converted.kv_lora_rank, converted.qk_rope_head_dim)
    assert advice.qk_rope_head_dim == report.qk_rope_head_dim == 8 < 16  # not the default min(64, d)
    assert advice.kv_lora_rank in report.ranks
    assert advice.energy_retained == pytest.approx(converted.energy_retained.per_layer, abs=1e-12, rel=0)
    assert advice.kv_keep_actual == pytest.approx(converted.kv_keep)


def test_calibration_hook_is_applied_as_in_convert(tiny_model):
    """The stats a hook returns reach the analysis as convert hands them to ``convert_attention``."""
    src = tiny_model(kv_heads=2, head_dim=16, hidden=32, heads=2)
    gen = torch.Generator().manual_seed(7)
    mixes = [torch.randn(32, 32, generator=gen, dtype=torch.float64) for _ in range(2)]
    calls = []

    def stats_for_layer(i, attention):
        calls.append(i)
        x = mixes[i] * attention.input_norm.double()
        return LayerStats(metric=x.T @ x / 32, rotation_mean=torch.full((2, 8), 0.5 + 0.1j, dtype=torch.complex128))

    calibrated = spectra(str(src), SpectraOptions(ranks=[12], rope_dim=8), stats_for_layer=stats_for_layer)
    plain = spectra(str(src), SpectraOptions(ranks=[12], rope_dim=8))
    assert calls == [0, 1] and calibrated.mode == "calibrated" and plain.mode == "weights-only"

    _, spec, reader = load_source(str(src))
    shapes = plan_shapes(spec, 12, None, 8)
    lopts = calibrated_layer_options(layer_options(spec, shapes, ConvertOptions(rope_stride=calibrated.rope_stride),
                                                     target(ConvertOptions().target)))
    shape = spec.attention_shape
    expected = []
    for i in range(2):
        attention = SourceWeights(reader, spec).attention(i)
        expected.append(convert_attention(attention, shape, lopts, stats_for_layer(i, attention))[1].energy_retained)
    energy = [layer.energy_retained[0] for layer in calibrated.layers]
    assert energy == pytest.approx(expected, abs=1e-12, rel=0)
    assert energy != pytest.approx([layer.energy_retained[0] for layer in plain.layers], abs=1e-3)


def test_spectra_show_what_the_shared_key_drops_for_mha_and_nothing_for_mqa(tiny_model):
    """MQA with R = d keeps every rotation; MHA (n_kv = N) keeps one component of n_kv per frequency and loses
    the rest, the more so with fewer rope dims, and the mean-rotation stand-in recovers part of it."""
    mqa = spectra(str(tiny_model("mqa", kv_heads=1, head_dim=16, layers=2)), SpectraOptions(rope_dim=16))
    for layer in mqa.layers:
        assert layer.rope_score_loss == pytest.approx(0, abs=1e-12)
        assert layer.rope_score_loss_without_mean_rotation == pytest.approx(0, abs=1e-12)
    mha_src = tiny_model("mha", kv_heads=4, heads=4, head_dim=16, layers=2)
    wide, narrow = (spectra(str(mha_src), SpectraOptions(rope_dim=R, rope_stride=1)) for R in (16, 8))
    check_schema(wide.to_json())
    for full, half in zip(wide.layers, narrow.layers):
        assert 0 < full.rope_score_loss < half.rope_score_loss < 1
        for layer in (full, half):
            assert layer.rope_score_loss < layer.rope_score_loss_without_mean_rotation
            assert layer.rope_mean_rotation_recovers == pytest.approx(
                1 - layer.rope_score_loss / layer.rope_score_loss_without_mean_rotation)
            assert sum(layer.rope_score_loss_per_frequency) == pytest.approx(layer.rope_score_loss)
        # R = 8 at stride 1 keeps pairs 0-3: the pairs it drops lose their whole key energy.
        assert all(a < b for a, b in zip(full.rope_score_loss_per_frequency[4:], half.rope_score_loss_per_frequency[4:]))
    assert wide.summary.rope_score_loss_mean == pytest.approx(
        sum(layer.rope_score_loss for layer in wide.layers) / 2)


@pytest.mark.parametrize("options, message", [
    ({"ranks": [0]}, "outside 1..56"),
    ({"ranks": [57]}, "outside 1..56"),
    ({"ranks": []}, "at least one rank"),
    ({"energy_targets": (0.0,)}, r"in \(0, 1\]"),
    ({"energy_targets": (1.5,)}, r"in \(0, 1\]"),
    ({"rope_dim": 3}, "even number"),
    ({"rope_dim": 16}, "larger than the source head_dim"),
    ({"kv_keep": 0.0}, "--kv-keep must be in"),
    ({"rope_stride": 2}, "does not fit"),
])
def test_bad_settings_are_refused(stories, options, message):
    with pytest.raises(MlaconvError, match=message):
        spectra(str(stories), SpectraOptions(**options))


def test_json_has_the_documented_keys(stories_report):
    check_schema(json.loads(json.dumps(stories_report.to_json())))
    assert "docs/report.md" in spectra_command.__doc__  # where the help sends the reader for the keys
    documented = (ROOT / "docs" / "report.md").read_text(encoding="utf-8")
    for key in [*TOP_KEYS, *LAYER_KEYS, *SUMMARY_KEYS, *RECOMMENDATION_KEYS]:
        assert f"| `{key}` |" in documented, f"{key} is not documented in docs/report.md"
    written = stories_report.to_json()
    with pytest.raises(AssertionError):  # the schema check can fail
        check_schema({**written, "summary": {**written["summary"], "rope_energy_kept_min": None}})


def test_csv_has_one_row_per_layer(stories_report, tmp_path):
    path = tmp_path / "spectra.csv"
    write_csv(stories_report, path)
    rows = list(csv.reader(path.open()))
    assert len(rows) == 1 + 5
    header = rows[0]
    assert header[0] == "layer" and "energy_at_rank_24" in header and "rank_for_energy_0.95" in header
    column = header.index("energy_at_rank_24")
    assert [float(row[column]) for row in rows[1:]] == stories_report.recommendation.energy_retained


def test_calibrated_inspect_agrees_with_calibrated_convert(stories, tmp_path):
    """--calib streams the source in both commands: the same window sets and the same energies per layer, both
    measured on the audit windows (convert without its per-layer variant search, which inspect does not run, as
    its ``shows`` says); the spectrum itself is in-sample and differs."""
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(3))
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in tokens.tolist()))
    converted = convert(str(stories), tmp_path / "out", ConvertOptions(rank=24, verify=False, calib=[str(calib)],
                                                                       calib_window=64, layer_search=False,
                                                                       refine_steps=0))
    report = spectra(str(stories), SpectraOptions(ranks=[24], calib=[str(calib)], calib_window=64))
    check_schema(report.to_json())
    assert report.mode == converted.mode == "calibrated"
    assert report.window_sets == converted.calibration.window_sets
    assert "plain calibrated variant" in report.shows and "measured on the audit windows" in report.shows
    energy = [layer.energy_retained[0] for layer in report.layers]
    assert energy == pytest.approx(converted.energy_retained.per_layer, abs=1e-12, rel=0)
    in_sample = [layer.energy_curve[23] for layer in report.layers]
    assert min(abs(a - b) for a, b in zip(in_sample, energy)) > 1e-4
