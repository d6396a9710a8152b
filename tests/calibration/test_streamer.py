"""Calibration: the streamed source forward, exact energy bookkeeping, memory, determinism, quality."""

from __future__ import annotations

import gc
import json
import weakref
from dataclasses import replace

import pytest
import torch

from helpers import open_source, random_tokens, write_tokens
from mlaconv.calibration.streamer import CalibrationOptions, SourceStreamer
from mlaconv.calibration.windows import load_calibration_tokens
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.io import CheckpointReader, read_config
from mlaconv.io.models import load_causal_lm
from mlaconv.mla import latent
from mlaconv.mla.attention import analyse_layer, convert_attention
from mlaconv.mla.forward import rms_norm
from mlaconv.mla.layer import AttentionShape, LayerOptions
from mlaconv.mla.refine import refine
from mlaconv.source.names import FINAL_NORM, LM_HEAD
from mlaconv.source.spec import SourceSpec
from mlaconv.source.weights import SourceWeights


def test_streamed_source_forward_matches_transformers(tiny_model):
    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16, eps=1e-5)
    spec, reader = open_source(src)
    tokens = random_tokens(3, 20, spec.vocab_size, seed=2)
    streamer = SourceStreamer(reader, spec, CalibrationOptions(tokens, batch_size=2))
    for i in range(spec.num_layers):
        attention = SourceWeights(reader, spec).attention(i)
        streamer.stats(i, attention)
        streamer.advance(i, attention)
    final = rms_norm(streamer.hidden, reader.get(FINAL_NORM), spec.rms_norm_eps)
    ours = final.double() @ reader.get(LM_HEAD).double().T
    with torch.no_grad():
        theirs = load_causal_lm(src)(tokens).logits.double()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())


def test_the_streamed_forward_reuses_the_source_outputs_a_layer_already_computed(tiny_model, monkeypatch):
    """The refinement's training windows and the held select/audit windows already have the layer's source attention
    outputs: moving the stream through the layer adds those instead of computing them again, with the same result."""
    import mlaconv.calibration.streamer as calibrate

    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16, eps=1e-5)
    spec, reader = open_source(src)
    tokens = random_tokens(16, 20, spec.vocab_size, seed=4)
    plain = SourceStreamer(reader, spec, CalibrationOptions(tokens, batch_size=3))
    reusing = SourceStreamer(reader, spec, CalibrationOptions(tokens, batch_size=3))
    computed: list[int] = []
    attention_of = calibrate.source_attention
    monkeypatch.setattr(calibrate, "source_attention", lambda x, *a: computed.append(x.shape[0]) or attention_of(x, *a))
    fit = reusing.split.fit
    for i in range(spec.num_layers):
        attention = SourceWeights(reader, spec).attention(i)
        reusing.refinement_data(i, attention, len(fit) - 1)  # every fit window but the last, and the select windows
        reusing.held_pairs(i, attention, "audit")
        computed.clear()
        reusing.advance(i, attention)
        assert sum(computed) == 1  # only the one window no earlier step of this layer needed
        plain.advance(i, attention)
        assert sum(computed) == 1 + len(tokens)
        assert torch.allclose(reusing.hidden, plain.hidden, rtol=0, atol=1e-5 * plain.hidden.abs().max().item())


def test_energy_retained_equals_measured_calibration_error(tiny_model):
    """With Σ = E[x xᵀ] of the fit windows, 1 − energy is exactly the relative balanced K/V output error there,
    and the report's energy_retained (1 − the mean of the key and value errors) is the same number."""
    src = tiny_model(kv_heads=2, head_dim=16, hidden=64)
    spec, reader = open_source(src)
    tokens = random_tokens(8, 32, spec.vocab_size, seed=3)
    streamer = SourceStreamer(reader, spec, CalibrationOptions(tokens))
    attention = SourceWeights(reader, spec).attention(0)
    stats = streamer.stats(0, attention)
    fit = list(streamer.split.fit)
    x = rms_norm(streamer.hidden[fit], attention.input_norm, spec.rms_norm_eps).flatten(0, 1).double()  # [T, H]
    shape = AttentionShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    for rank in (4, 12, 30):
        options = LayerOptions(rank=rank, rope_dim=8, rope_theta=spec.rope_theta, rope_stride=1)
        layer = analyse_layer(attention, shape, options, stats)
        factors = latent.factor(layer.target, layer.row_weight, stats.metric, rank, layer.spectrum)
        weighted = layer.row_weight[:, None] * layer.target
        outputs = x @ weighted.T  # the calibration K/V outputs, balanced
        approx = x @ (layer.row_weight[:, None] * (factors.up @ factors.down)).T
        measured = ((outputs - approx) ** 2).sum() / (outputs**2).sum()
        assert factors.energy == pytest.approx(1 - measured.item(), abs=1e-6)
        _, report = convert_attention(attention, shape, options, stats)
        assert report.energy_retained == pytest.approx(factors.energy, abs=1e-9)
        assert report.energy_retained == pytest.approx(1 - (report.key_error + report.value_error) / 2, abs=1e-12)
        assert report.objective_retained == pytest.approx(factors.energy, abs=1e-12)


def first_layer_calibrated(tiny_model):
    """A small GQA model's spec, its layer 0, that layer's calibration statistics and its attention shape."""
    src = tiny_model(kv_heads=2, head_dim=16, hidden=64)
    spec, reader = open_source(src)
    streamer = SourceStreamer(reader, spec, CalibrationOptions(random_tokens(8, 32, spec.vocab_size, seed=8)))
    attention = SourceWeights(reader, spec).attention(0)
    stats = streamer.stats(0, attention)
    return spec, attention, stats, AttentionShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)


def test_attention_weighted_latent_is_optimal_in_its_own_metric(tiny_model):
    """The attention-weighted latent (keys weighted by the queries that read them, values by W_o) has the
    least error in that weighted norm at every rank, equal to 1 − its energy; the balanced latent's is larger."""
    spec, attention, stats, shape = first_layer_calibrated(tiny_model)
    balanced_options = LayerOptions(rank=1, rope_dim=8, rope_theta=spec.rope_theta, rope_stride=1)
    balanced = analyse_layer(attention, shape, balanced_options, stats)
    weighted = analyse_layer(attention, shape, replace(balanced_options, latent_weighting="attention"), stats)
    assert torch.equal(balanced.target, weighted.target) and weighted.row_weight.dim() == 2
    root = torch.linalg.cholesky(stats.metric)
    full = weighted.row_weight @ weighted.target @ root

    def weighted_error(factors) -> float:
        residual = weighted.row_weight @ (weighted.target - factors.up @ factors.down) @ root
        return (residual.pow(2).sum() / full.pow(2).sum()).item()

    gaps = []
    for rank in (2, 6, 12, 24):
        ours = latent.factor(weighted.target, weighted.row_weight, stats.metric, rank, weighted.spectrum)
        other = latent.factor(balanced.target, balanced.row_weight, stats.metric, rank, balanced.spectrum)
        assert weighted_error(ours) == pytest.approx(1 - ours.energy, abs=1e-9)
        assert weighted_error(ours) <= weighted_error(other) + 1e-12
        gaps.append(weighted_error(other) - weighted_error(ours))
    assert max(gaps) > 1e-3  # the weighting changes the basis, not only the bookkeeping

    # energy_retained means the same for both: 1 − the balanced [K_nope; V] error; the weighted objective has its own name
    reports = {name: convert_attention(attention, shape, replace(balanced_options, rank=6, latent_weighting=name), stats)[1]
               for name in ("balanced", "attention")}
    for report in reports.values():
        assert report.energy_retained == pytest.approx(1 - (report.key_error + report.value_error) / 2, abs=1e-12)
    assert reports["balanced"].energy_retained == pytest.approx(reports["balanced"].objective_retained, abs=1e-9)
    assert reports["balanced"].energy_retained > reports["attention"].energy_retained  # balanced is optimal for it
    assert abs(reports["attention"].objective_retained - reports["attention"].energy_retained) > 1e-3


def test_a_value_weight_spends_more_of_the_latent_on_the_values(tiny_model):
    """``value_weight`` w sets the V block's weighted energy to w times the K block's, for either weighting, so
    the latent's basis keeps more of V and less of K."""
    from mlaconv.mla import metric as metric_math

    spec, attention, stats, shape = first_layer_calibrated(tiny_model)
    keys = shape.kv_heads * shape.head_dim
    for weighting in ("balanced", "attention"):
        options = LayerOptions(rank=6, rope_dim=8, rope_theta=spec.rope_theta, rope_stride=1, latent_weighting=weighting)
        for w in (1.0, 4.0):
            analysis = analyse_layer(attention, shape, replace(options, value_weight=w), stats)
            weight = analysis.row_weight if analysis.row_weight.dim() == 2 else torch.diag(analysis.row_weight)
            weighted = weight @ analysis.target
            k, v = (metric_math.total_energy(block, stats.metric) for block in (weighted[:keys], weighted[keys:]))
            assert v / k == pytest.approx(w, rel=1e-9)
        plain, heavy = (convert_attention(attention, shape, replace(options, value_weight=w), stats)[1] for w in (1, 4))
        assert heavy.value_error < plain.value_error and heavy.key_error > plain.key_error


@pytest.fixture(scope="module")
def stories_samples(stories) -> torch.Tensor:
    """[40, 96] token ids: the bundled samples.jsonl (text generated by stories260K) cut into windows."""
    lines = (stories / "samples.jsonl").read_text().splitlines()
    ids = torch.tensor([token for line in lines for token in json.loads(line)["input_ids"]])
    return ids[: 40 * 96].view(40, 96)


def held_out_kl(stories, held_out: torch.Tensor):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(stories)(held_out).logits.log_softmax(-1)

    def kl(folder):
        with torch.no_grad():
            logq = load_causal_lm(folder)(held_out).logits.log_softmax(-1)
        return (reference.exp() * (reference - logq)).sum(-1).mean().item()

    return kl


def test_calibrated_conversion_never_worse_than_weights_only(stories, stories_samples, tmp_path):
    """Same budget, held-out samples of the model itself: calibration lowers KL to the source."""
    write_tokens(tmp_path / "calib.jsonl", stories_samples[:16])
    kl = held_out_kl(stories, stories_samples[32:])
    for rank in (16, 40):
        weights = convert(str(stories), tmp_path / f"w{rank}", ConvertOptions(rank=rank, verify=False))
        calibrated = convert(str(stories), tmp_path / f"c{rank}",
                             ConvertOptions(rank=rank, verify=False, calib=[str(tmp_path / "calib.jsonl")],
                                            calib_window=96, refine_steps=0))
        assert calibrated.mode == "calibrated" and weights.mode == "weights-only"
        assert kl(tmp_path / f"c{rank}") < kl(tmp_path / f"w{rank}")


def test_refinement_lowers_the_measured_attention_error(stories, stories_samples, tmp_path):
    """Refinement trains on fit windows, is kept per layer only where it beats the closed form on the select
    windows, lowers the attention error on the audit windows and the whole model's KL there, is written, and
    lowers the KL on text the conversion never saw."""
    write_tokens(tmp_path / "calib.jsonl", stories_samples[:32])
    kl = held_out_kl(stories, stories_samples[32:])
    common = dict(rank=24, verify=False, calib=[str(tmp_path / "calib.jsonl")], calib_window=96)
    closed = convert(str(stories), tmp_path / "closed", ConvertOptions(refine_steps=0, **common))
    refined = convert(str(stories), tmp_path / "refined", ConvertOptions(refine_steps=100, **common))
    assert not any("refined" in v for v in closed.layer_variant)
    assert closed.calibration.whole_model.refined is None
    assert closed.calibration.whole_model.written == "closed form"
    whole = refined.calibration.whole_model
    assert whole.written == "refined" and whole.refined.kl < whole.closed_form.kl
    before = closed.calibration.whole_model.closed_form
    assert (whole.closed_form.kl, whole.closed_form.top1) == pytest.approx((before.kl, before.top1), abs=1e-9)
    for choice, variant in zip(refined.calibration.selection, refined.layer_variant):
        step = choice.refinement
        assert step.kept == (step.after < step.before) == variant.endswith(", refined")
        assert step.before == choice.variants[choice.kept]  # the variant choice's own measurement of the closed form
    assert any("refined" in v for v in refined.layer_variant)
    assert refined.calibration.closed_form.attention_error == pytest.approx(closed.attention_error, abs=1e-9)
    # audited on windows that chose nothing: a smaller gain than the select windows, which chose the best step, show
    assert sum(refined.attention_error) < 0.95 * sum(closed.attention_error)
    # on the select windows: 0.878 of the closed form's error with 4 windows a step at every position and a fixed
    # rate of 3e-3, 0.900 at 3e-2 with back-off, 0.893 with the default's 8 windows at an eighth of the positions
    # (bench/refine/, issue 16)
    assert sum(c.refinement.after for c in refined.calibration.selection) < 0.92 * sum(
        c.refinement.before for c in refined.calibration.selection)
    assert kl(tmp_path / "refined") < kl(tmp_path / "closed")


def test_calibration_holds_one_layer_at_a_time(tiny_model, tmp_path, monkeypatch):
    """Every weight matrix read from the source is gone before a matrix of another layer is read."""
    src = tiny_model(kv_heads=2, head_dim=16, layers=4)
    write_tokens(tmp_path / "calib.jsonl", random_tokens(4, 24, 96, seed=4))
    alive: list[tuple[int, weakref.ref]] = []
    original_get = CheckpointReader.get

    def tracking_get(self, name):
        tensor = original_get(self, name)
        if name.startswith("model.layers.") and tensor.dim() == 2:
            layer = int(name.split(".")[2])
            gc.collect()
            others = [i for i, ref in alive if ref() is not None and i != layer]
            assert not others, f"reading layer {layer} while layer {others[0]} is still in memory"
            alive.append((layer, weakref.ref(tensor)))
        return tensor

    monkeypatch.setattr(CheckpointReader, "get", tracking_get)
    convert(str(src), tmp_path / "out", ConvertOptions(rank=24, verify=False, shard_size=1, refine_steps=5,
                                                       calib=[str(tmp_path / "calib.jsonl")], calib_window=24))
    assert {i for i, _ in alive} == set(range(4))


def test_same_inputs_give_byte_identical_output(tiny_model, tmp_path, monkeypatch):
    import mlaconv.conversion.calibrated

    refined = []
    monkeypatch.setattr(mlaconv.conversion.calibrated, "refine", lambda *a, **k: refined.append(1) or refine(*a, **k))
    src = tiny_model(kv_heads=2, head_dim=16)
    write_tokens(tmp_path / "calib.jsonl", random_tokens(20, 24, 96, seed=5))  # 10 fit, 5 select, 5 audit
    options = dict(rank=20, verify=False, calib=[str(tmp_path / "calib.jsonl")], calib_window=24, refine_steps=10,
                   device="cpu")  # CUDA kernels need not be deterministic
    report = convert(str(src), tmp_path / "out", ConvertOptions(**options))
    assert report.calibration.refine_steps == 10 and refined  # the stochastic step runs too
    first = {p.name: p.read_bytes() for p in sorted((tmp_path / "out").iterdir())}
    convert(str(src), tmp_path / "out", ConvertOptions(force=True, **options))
    second = {p.name: p.read_bytes() for p in sorted((tmp_path / "out").iterdir())}
    assert first.keys() == second.keys()
    assert [n for n in first if n != "mlaconv.json" and first[n] != second[n]] == []
    assert _untimed(json.loads(first["mlaconv.json"])) == _untimed(json.loads(second["mlaconv.json"]))


def _untimed(report):
    """A report without its wall-clock figures, the one thing two runs may differ in."""
    if isinstance(report, dict):
        return {k: _untimed(v) for k, v in report.items() if not k.endswith("seconds")}
    return [_untimed(v) for v in report] if isinstance(report, list) else report


def test_measured_attention_error_is_zero_for_an_exact_conversion(tiny_model, tmp_path):
    """MQA at full rank converts exactly, so the held-out attention error every variant is judged by is ~0
    in every layer; at a lossy rank it is not, and it is the same however often a layer is measured."""
    src = tiny_model(kv_heads=1, head_dim=16, layers=3)
    write_tokens(tmp_path / "calib.jsonl", random_tokens(6, 24, 96, seed=9))
    common = dict(verify=False, calib=[str(tmp_path / "calib.jsonl")], calib_window=24, rope_dim=16, refine_steps=0)
    exact = convert(str(src), tmp_path / "exact", ConvertOptions(rank=16, **common))
    assert max(exact.attention_error) <= 1e-10
    lossy = convert(str(src), tmp_path / "lossy", ConvertOptions(rank=4, **common))
    assert min(lossy.attention_error) > 1e-4

    spec, reader = open_source(src)
    streamer = SourceStreamer(reader, spec, CalibrationOptions(random_tokens(6, 24, 96, seed=9)))
    shape = AttentionShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    options = LayerOptions(rank=4, rope_dim=16, rope_theta=spec.rope_theta, rope_stride=1)
    slots = torch.arange(8, dtype=torch.float64)  # any slot frequencies: the same ones for both calls
    fresh = SourceStreamer(reader, spec, CalibrationOptions(random_tokens(6, 24, 96, seed=9)))
    for i in range(spec.num_layers):
        attention = SourceWeights(reader, spec).attention(i)
        mla, _ = convert_attention(attention, shape, options)
        first = streamer.attention_error(i, attention, mla, 4, 16, slots, 1.0)
        assert streamer.attention_error(i, attention, mla, 4, 16, slots, 1.0) == first
        if i == spec.num_layers - 1:  # nothing of the earlier layers' measurements leaks into this one
            assert fresh.attention_error(i, attention, mla, 4, 16, slots, 1.0) == first
        streamer.advance(i, attention)
        fresh.advance(i, attention)


def test_refinement_is_reduced_to_fit_a_cpu_budget_or_skipped(stories, stories_samples, tmp_path, monkeypatch):
    """Full refinement where it is estimated to be affordable; on a slow CPU, healing or not, steps of one window (at
    least 25) that fit the 30-minute budget, more in a longer --refine-minutes, the full plan where it fits in them;
    slower still, none — and the note says which."""
    import mlaconv.conversion.calibrated as conversion
    from mlaconv.conversion.plan import plan_conversion

    write_tokens(tmp_path / "calib.jsonl", stories_samples[:24])
    options = ConvertOptions(rank=24, verify=False, calib=[str(tmp_path / "calib.jsonl")], calib_window=96, device="cpu",
                             heal_tokens=0)
    plan = plan_conversion(str(stories), options)
    streamer = conversion.calibration_streamer(plan)
    full_flops = conversion.DEFAULT_REFINE_STEPS * plan.spec.num_layers * conversion.refinement_flops(
        plan.shape, plan.shapes.rope_dim, plan.shapes.rank, conversion.REFINE_BATCH, 96, 96 // 8)

    def planned(cpu_seconds_for_the_full_refinement: float):
        monkeypatch.setattr(conversion, "CPU_FLOPS", full_flops / cpu_seconds_for_the_full_refinement)
        return conversion.refinement_plan(plan, streamer)

    def planned_with(**changes):
        return conversion.refinement_plan(replace(plan, options=replace(options, **changes)), streamer)

    full = planned(600)
    assert (full.steps, full.batch, full.note, full.lr, full.queries) == (150, 8, "default", 3e-2, 12)
    reduced = planned(2 * 3600)
    assert reduced.batch == 1 and 25 <= reduced.steps < 1200 and reduced.note.startswith("reduced:")
    assert reduced.queries == 12  # an eighth of each 96-token window's positions, as in the full plan
    assert reduced.lr == 3e-3  # the rate the reduced plan's figures were measured at
    assert "about 30 min on this CPU" in reduced.note and "give --refine-minutes more time" in reduced.note
    longer = planned_with(refine_minutes=60)
    assert longer.batch == 1 and 2 * reduced.steps <= longer.steps < 2 * reduced.steps + 20  # + the check's share
    assert "about 60 min on this CPU" in longer.note
    assert planned_with(refine_minutes=121).steps == 1200  # at most the full plan's windows, one a step
    assert planned_with(refine_minutes=180).steps == 150  # the full plan (2 h and its checks) fits in the budget
    healing = planned_with(heal_tokens=None)  # healing follows the refinement, whichever plan it is
    assert (healing.steps, healing.batch, healing.note) == (reduced.steps, 1, reduced.note)
    assert planned_with(heal_tokens=None, device="cuda:0").steps == 150
    skipped = planned(1000 * 3600)
    assert skipped.steps == 0 and skipped.note.startswith("skipped: even 25 steps")
    assert planned_with(refine_steps=7).steps == 7
    assert planned_with(device="cuda:0").steps == 150
    fit = len(streamer.split.fit)
    assert (full.train_windows, reduced.train_windows) == (fit, fit)  # every fit window: 96-token windows are short
    capped = planned_with(device="cuda:0", refine_tokens=2 * 96 + 95)
    assert (capped.train_windows, capped.batch) == (2, 2)  # whole windows within the token budget


def test_the_refinement_trains_on_every_fit_window_within_its_token_budget():
    """Short windows are not capped at a window count: at the bench's 256-token windows the default 65536-token
    calibration has 240 fit windows, and training on all of them measured better than on 48 (issue 16)."""
    from mlaconv.conversion.calibrated import training_windows

    budget = ConvertOptions().refine_tokens
    assert training_windows(240, 256, budget) == 240
    assert training_windows(16, 2048, budget) == 16  # the default calibration at 2048: all 16
    assert training_windows(112, 2048, budget) == 48  # the memory cap: 48 windows of 2048
    assert training_windows(3, 10**6, budget) == 1


def test_calibration_tokens_from_text_and_bad_input(tiny_model, tmp_path):
    from mlaconv.errors import MlaconvError

    src = tiny_model()
    spec = SourceSpec.from_config(read_config(src))
    with pytest.raises(MlaconvError, match="not found"):
        load_calibration_tokens(src, spec, [str(tmp_path / "missing.txt")], None, 1000, 32)
    (tmp_path / "short.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(MlaconvError, match="shorter than one window"):
        load_calibration_tokens(src, spec, [str(tmp_path / "short.jsonl")], None, 1000, 32)
    (tmp_path / "text.txt").write_text("some words " * 50)
    with pytest.raises(MlaconvError, match="no tokenizer"):
        load_calibration_tokens(src, spec, [str(tmp_path / "text.txt")], None, 1000, 32)
    write_tokens(tmp_path / "ok.jsonl", random_tokens(3, 70, 96, seed=6))
    windows = load_calibration_tokens(src, spec, [str(tmp_path / "ok.jsonl")], None, 64, 32)
    assert windows.shape == (2, 32)


def test_kv_keep_split_is_chosen_by_measured_error(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=32, hidden=128, heads=4)
    write_tokens(tmp_path / "calib.jsonl", random_tokens(8, 48, 96, seed=8))
    report = convert(str(src), tmp_path / "out", ConvertOptions(kv_keep=0.5, verify=False, calib_window=48,
                                                                heal_tokens=0, calib=[str(tmp_path / "calib.jsonl")],
                                                                context=32))  # every split passes (test_served_context)
    table = report.shape_search.candidates
    assert len(table) >= 2 and all(row.kv_lora_rank + row.qk_rope_head_dim <= 64 for row in table)
    best = min(table, key=lambda row: row.mean_attention_error)
    assert (report.kv_lora_rank, report.qk_rope_head_dim) == (best.kv_lora_rank, best.qk_rope_head_dim)
    assert "least mean attention error" in report.shape_choice


def test_the_split_search_compares_refined_splits_unless_refinement_is_off(tiny_model, tmp_path):
    """Each candidate is refined for SEARCH_REFINE_STEPS before the comparison (its best step kept, the closed form
    included), so no split measures worse than its closed form and the table says how many steps; with
    --refine-steps 0 the closed forms are compared."""
    from mlaconv.conversion.calibrated import SEARCH_REFINE_STEPS

    src = tiny_model(kv_heads=2, head_dim=32, hidden=128, heads=4)
    write_tokens(tmp_path / "calib.jsonl", random_tokens(8, 48, 96, seed=8))
    searches = {}
    for steps in (None, 0):
        options = ConvertOptions(kv_keep=0.5, verify=False, calib_window=48, calib=[str(tmp_path / "calib.jsonl")],
                                 refine_steps=steps, heal_tokens=0, context=32)
        searches[steps] = convert(str(src), tmp_path / f"out-{steps}", options).shape_search
    refined, closed = searches[None], searches[0]
    assert (refined.refine_steps, closed.refine_steps) == (SEARCH_REFINE_STEPS, 0)
    assert f"after {SEARCH_REFINE_STEPS} refinement steps" in refined.chosen and "in closed form" in closed.chosen
    pairs = list(zip(refined.candidates, closed.candidates))
    assert len(pairs) >= 2
    assert all((a.kv_lora_rank, a.qk_rope_head_dim) == (b.kv_lora_rank, b.qk_rope_head_dim) for a, b in pairs)
    assert all(a.mean_attention_error <= b.mean_attention_error for a, b in pairs)
    assert sum(a.mean_attention_error for a, _ in pairs) < sum(b.mean_attention_error for _, b in pairs)


def test_split_errors_refine_on_from_one_checkpoint_to_the_next(stories, stories_samples, tmp_path):
    """``split_errors`` (the search's measurement, and the split probe's) gives the closed form's select error and
    then each checkpoint's, the steps going on from the last checkpoint's latent: the errors never rise, and the
    refinement lowers them."""
    from mlaconv.conversion.calibrated import (calibrated_layer_options, calibration_streamer, calibration_tokens,
                                               split_errors)
    from mlaconv.conversion.pipeline import source_layers
    from mlaconv.conversion.plan import plan_conversion

    write_tokens(tmp_path / "calib.jsonl", stories_samples[:32])
    plan = plan_conversion(str(stories), ConvertOptions(rank=24, rope_dim=4, rope_stride=1, calib_window=96,
                                                        heal_tokens=0, calib=[str(tmp_path / "calib.jsonl")]))
    tokens = calibration_tokens(plan)
    streamer = calibration_streamer(plan, tokens)
    layer = replace(calibrated_layer_options(plan.layer), latent_weighting="attention")
    curves = []
    for source in source_layers(plan.reader, plan.spec, streamer):
        train, held = streamer.refinement_data(source.index, source.attention, len(streamer.split.fit))
        curves.append(split_errors(plan, streamer, source, layer, tokens.shape[1], train, held, (20, 60)))
    assert all(len(curve) == 3 for curve in curves)
    assert all(a >= b >= c for a, b, c in curves)
    assert sum(c[2] for c in curves) < sum(c[1] for c in curves) < sum(c[0] for c in curves)


@pytest.mark.parametrize("sequential", ["outputs", "residual"])
def test_a_sequential_calibration_refines_each_layer_on_the_written_models_own_inputs(stories, stories_samples,
                                                                                     tmp_path, monkeypatch, sequential):
    """With --calib-sequential, the refinement of layer i trains on the activations that the converted layers before
    it produce: those of the written model as transformers runs it (hidden_states[i], normalised by the source's
    input norm), and aims at the source's attention output on the source's own inputs (plus, for "residual", the
    source's residual stream less the converted one), both computed here in plain PyTorch."""
    import mlaconv.calibration.streamer as calibrate
    from transformers import AutoModelForCausalLM

    write_tokens(tmp_path / "calib.jsonl", stories_samples[:32])
    seen = {}
    refinement_data = calibrate.SourceStreamer.refinement_data

    def recording(self, i, attention, windows):
        (x, y), select = refinement_data(self, i, attention, windows)
        seen[i] = (self.options.tokens[list(self.split.fit[:windows])], x[:].clone(), y.clone(), attention,
                   self.hidden[list(self.split.fit[:windows])].clone())
        return (x, y), select

    monkeypatch.setattr(calibrate.SourceStreamer, "refinement_data", recording)
    report = convert(str(stories), tmp_path / "out", ConvertOptions(
        rank=16, verify=False, calib=[str(tmp_path / "calib.jsonl")], calib_window=96, refine_steps=20, heal_tokens=0,
        calib_sequential=sequential))
    assert report.calibration.whole_model.written == "refined" and report.calibration.sequential == sequential
    spec = SourceSpec.from_config(read_config(stories))
    converted = load_causal_lm(tmp_path / "out")
    source = AutoModelForCausalLM.from_pretrained(stories)
    assert sorted(seen) == list(range(spec.num_layers))
    alpha = (1e-6 / spec.rms_norm_eps) ** 0.5  # the converted model's ε is DeepSeek's
    for i, (ids, x, y, attention, source_stream) in seen.items():
        with torch.no_grad():
            theirs = converted(ids, output_hidden_states=True).hidden_states[i] / alpha  # its stream is α× the source's
            source_hidden = source(ids, output_hidden_states=True).hidden_states[i]
            source_output = source.model.layers[i].self_attn(
                source.model.layers[i].input_layernorm(source_hidden),
                position_embeddings=source.model.rotary_emb(source_hidden, torch.arange(ids.shape[1])[None]),
                attention_mask=torch.full((ids.shape[1],) * 2, -torch.inf).triu(1)[None, None])[0]
        expected = rms_norm(theirs, attention.input_norm, spec.rms_norm_eps)
        assert torch.allclose(x, expected, rtol=0, atol=1e-4 * expected.abs().max().item()), i
        assert torch.allclose(source_stream, source_hidden, rtol=0, atol=1e-4 * source_hidden.abs().max().item())
        target = source_output + (source_hidden - theirs if sequential == "residual" else 0)
        assert torch.allclose(y, target, rtol=0, atol=1e-4 * target.abs().max().item()), i
        if i > 0:  # the converted inputs are not the source's after the first layer
            assert not torch.allclose(theirs, source_hidden, rtol=0, atol=1e-2 * source_hidden.abs().max().item())
