"""Fit, select and audit windows: disjoint, each used only for its job, and the whole-model check on the audit
windows — checked against transformers' own models, and shown to reject an overfitted refinement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import random_tokens, tensors, write_tokens
from mlaconv.calibration.streamer import CalibrationOptions, SourceStreamer
from mlaconv.calibration.windows import split_windows
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.io import CheckpointReader, read_config
from mlaconv.io.models import load_causal_lm
from mlaconv.mla.attention import convert_attention
from mlaconv.mla.forward import rms_norm
from mlaconv.mla.layer import AttentionShape, LayerOptions
from mlaconv.mla.refine import refine
from mlaconv.source.spec import SourceSpec
from mlaconv.source.weights import SourceWeights


def calibrated(tmp_path: Path, tokens: torch.Tensor, name: str, **options) -> ConvertOptions:
    path = write_tokens(tmp_path / f"{name}.jsonl", tokens)
    return ConvertOptions(verify=False, calib=[str(path)], calib_window=tokens.shape[1],
                          calib_tokens=tokens.numel(), device="cpu", **options)


def test_window_sets_are_disjoint_and_follow_the_documented_rule():
    for count in range(3, 80):
        split = split_windows(count)
        held = min(8, max(1, count // 4))
        sets = [set(split.fit), set(split.select), set(split.audit)]
        assert sets[0] | sets[1] | sets[2] == set(range(count))
        assert sum(map(len, sets)) == count  # disjoint
        assert (len(split.select), len(split.audit), len(split.fit)) == (held, held, count - 2 * held)
        assert (split.note is not None) == (count < 16)
        assert split_windows(count) == split  # seeded
    assert split_windows(64).select != tuple(range(8))  # drawn at random, not the first windows
    for count in (1, 2):
        with pytest.raises(MlaconvError, match="at least 3 are needed"):
            split_windows(count)


def test_fit_statistics_see_only_fit_windows(tiny_model):
    """E[x xᵀ] and μ are those of the fit windows (checked by hand for layer 0); changing the select or the audit
    windows changes none of them in any layer, and each set's measurements move only with that set."""
    src = tiny_model(kv_heads=2, head_dim=16, layers=3)
    spec = SourceSpec.from_config(read_config(src))
    reader = CheckpointReader(src)
    base = random_tokens(12, 24, spec.vocab_size, seed=1)
    split = split_windows(12)
    changed = {}
    for name in ("select", "audit"):
        tokens = base.clone()
        rows = list(getattr(split, name))
        tokens[rows] = random_tokens(len(rows), 24, spec.vocab_size, seed=2)
        changed[name] = tokens
    streamers = {name: SourceStreamer(reader, spec, CalibrationOptions(tokens)) for name, tokens in
                 {"base": base, **changed}.items()}
    shape = AttentionShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    options = LayerOptions(rank=6, rope_dim=8, rope_theta=spec.rope_theta, rope_stride=1)
    slots = torch.arange(4, dtype=torch.float64)
    for i in range(spec.num_layers):
        attention = SourceWeights(reader, spec).attention(i)
        stats = {name: s.stats(i, attention) for name, s in streamers.items()}
        for name in changed:
            assert torch.equal(stats[name].metric, stats["base"].metric)
            assert torch.equal(stats[name].rotation_mean, stats["base"].rotation_mean)
        if i == 0:
            embed = reader.get("model.embed_tokens.weight").double()
            for rows, metric in ((split.fit, stats["base"].metric), (split.audit, streamers["base"].audit_metric(0))):
                x = rms_norm(embed[base[list(rows)]], attention.input_norm.double(), spec.rms_norm_eps).flatten(0, 1)
                assert torch.allclose(metric, x.T @ x / x.shape[0], rtol=0, atol=1e-6)  # float32 norm
        mla, _ = convert_attention(attention, shape, options)
        errors = {name: {w: s.attention_error(i, attention, mla, 6, 8, slots, 1.0, windows=w) for w in ("select", "audit")}
                  for name, s in streamers.items()}
        assert errors["audit"]["select"] == errors["base"]["select"] != errors["select"]["select"]
        assert errors["select"]["audit"] == errors["base"]["audit"] != errors["audit"]["audit"]
        for s in streamers.values():
            s.advance(i, attention)


def test_audit_windows_choose_nothing(tiny_model, tmp_path):
    """Replacing the audit windows changes the audited figures only: the same choices on the select windows and
    byte-identical tensors. Replacing the select windows instead changes what they measure."""
    src = tiny_model(kv_heads=2, head_dim=16, layers=2)
    base = random_tokens(16, 24, 96, seed=3)
    runs = {"base": base}
    for name in ("audit", "select"):
        tokens = base.clone()
        rows = list(getattr(split_windows(16), name))
        tokens[rows] = random_tokens(len(rows), 24, 96, seed=4)
        runs[name] = tokens
    reports = {name: convert(str(src), tmp_path / name, calibrated(tmp_path, tokens, name, rank=6, refine_steps=0,
                                                                   heal_written=0))
               for name, tokens in runs.items()}
    sets = reports["base"].calibration.window_sets
    assert sets.select == list(split_windows(16).select) and sets.audit == list(split_windows(16).audit)
    heal = reports["base"].heal  # healing chose a step, on the select windows, and measured on the audit windows
    assert heal.best_step > 0 and heal.select_windows == sets.select[:4] and heal.held_out_windows == sets.audit[:4]
    assert not set(heal.train_windows) & (set(sets.select) | set(sets.audit))
    assert reports["audit"].calibration.selection == reports["base"].calibration.selection
    assert reports["audit"].layer_variant == reports["base"].layer_variant
    first, second = tensors(tmp_path / "base"), tensors(tmp_path / "audit")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert reports["audit"].attention_error != reports["base"].attention_error
    assert reports["audit"].energy_retained != reports["base"].energy_retained
    assert reports["select"].calibration.selection != reports["base"].calibration.selection


def agreement_by_transformers(source: Path, converted: Path, tokens: torch.Tensor) -> dict:
    """KL(source ‖ converted) per token and top-1 agreement, through transformers' own model classes."""
    with torch.no_grad():
        p = load_causal_lm(source)(tokens).logits.double().log_softmax(-1)
        q = load_causal_lm(converted)(tokens).logits.double().log_softmax(-1)
    return {"kl": (p.exp() * (p - q)).sum(-1).mean().item(), "top1": (p.argmax(-1) == q.argmax(-1)).double().mean().item()}


def test_whole_model_check_is_what_transformers_computes(tiny_model, tmp_path):
    """The streamed whole-model KL and top-1 of the written model on the audit windows equal those of the written
    checkpoint loaded through AutoModelForCausalLM against the source; the other model's figures are reported too."""
    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16, layers=3, eps=1e-5)
    tokens = random_tokens(16, 32, 96, seed=5)
    report = convert(str(src), tmp_path / "out", calibrated(tmp_path, tokens, "calib", rank=8, refine_steps=40,
                                                            dtype="float32", heal_tokens=0))  # healing would
    # change the written model after this check, which measures the calibration's own output
    whole = report.calibration.whole_model
    assert whole.refined is not None and whole.closed_form is not None
    assert whole.tokens == len(report.calibration.window_sets.audit) * 32
    audit = tokens[report.calibration.window_sets.audit]
    measured = agreement_by_transformers(src, tmp_path / "out", audit)
    written, other = ((whole.refined, whole.closed_form) if whole.written == "refined" else
                      (whole.closed_form, whole.refined))
    assert written.kl == pytest.approx(measured["kl"], rel=1e-3, abs=1e-6)
    assert written.top1 == pytest.approx(measured["top1"], abs=1.5 / audit.numel())
    assert other.kl >= written.kl


def test_overfitted_refinement_is_rejected_by_the_whole_model_check(stories, tmp_path, monkeypatch):
    """Refinement overfitted on purpose (many steps at a high rate on one fit window, its best step chosen on that
    same window, so every layer passes its own check) makes the whole model worse on the audit windows: the
    check rejects it, and the written checkpoint is the closed form, tensor for tensor."""
    import mlaconv.conversion.calibrated

    def overfitted(latent, shape, rope_dim, slots, train, select, **kwargs):
        one = (train[0][:1], train[1][:1])
        return refine(latent, shape, rope_dim, slots, one, one, steps=60, lr=0.05, batch=1, check_every=60)

    lines = (stories / "samples.jsonl").read_text().splitlines()
    ids = torch.tensor([t for line in lines for t in json.loads(line)["input_ids"]])[: 16 * 96].view(16, 96)
    closed = convert(str(stories), tmp_path / "closed", calibrated(tmp_path, ids, "calib", rank=24, refine_steps=0))
    monkeypatch.setattr(mlaconv.conversion.calibrated, "refine", overfitted)
    report = convert(str(stories), tmp_path / "overfitted", calibrated(tmp_path, ids, "calib", rank=24, refine_steps=1))
    selection = report.calibration.selection
    assert all(layer.refinement.kept for layer in selection)  # each layer passed its own check
    whole = report.calibration.whole_model
    assert whole.refined.kl > whole.closed_form.kl and whole.written == "closed form"
    assert whole.reason.startswith("the refined model was rejected")
    assert not any("refined" in v for v in report.layer_variant)
    assert report.attention_error == closed.attention_error
    assert all(v.endswith(", refined") for v in report.calibration.refined.layer_variant)
    written, reference = tensors(tmp_path / "overfitted"), tensors(tmp_path / "closed")
    assert written.keys() == reference.keys() and all(torch.equal(written[k], reference[k]) for k in written)
    assert not (tmp_path / "overfitted" / ".pending").exists()


def test_small_calibration_sets_are_refused_or_noted(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16)
    with pytest.raises(MlaconvError, match="at least 3 are needed"):
        convert(str(src), tmp_path / "two", calibrated(tmp_path, random_tokens(2, 24, 96, seed=6), "two", rank=6))
    assert not (tmp_path / "two").exists()
    report = convert(str(src), tmp_path / "five", calibrated(tmp_path, random_tokens(5, 24, 96, seed=6), "five",
                                                             rank=6, refine_steps=0))
    sets = report.calibration.window_sets
    assert (len(sets.fit), len(sets.select), len(sets.audit)) == (3, 1, 1)
    assert "rest on little data" in sets.note
