"""Healing on a tiny model: the held-out KL falls, frozen tensors keep their bytes, the layout and the tiny-latent
bound hold, a stop mid-way leaves nothing half-written, and bad input is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mlaconv.calibration.windows import CalibrationData
from mlaconv.cli import app
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.heal import HealOptions, heal
from mlaconv.heal import run as heal_run
from mlaconv.heal.distill import POSITION_SPAN, default_position_span
from mlaconv.mla.latent_norm import latent_bound
from mlaconv.report.conversion import HealReport

from helpers import hashes, leftovers, tensors


def sampled_ids(path: Path, count: int = 40, length: int = 48, seed: int = 0) -> Path:
    """Token ids of text-like data for a model without a tokenizer: random ids."""
    generator = torch.Generator().manual_seed(seed)
    path.write_text("".join(json.dumps({"input_ids": torch.randint(0, 96, (length,), generator=generator).tolist()})
                            + "\n" for _ in range(count)))
    return path


@pytest.fixture
def converted(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16, layers=2)
    out = tmp_path / "conv"
    convert(str(src), out, ConvertOptions(rank=8, rope_dim=8, weights_only=True))
    return src, out, sampled_ids(tmp_path / "ids.jsonl")


def run_heal(src, folder, ids, out, force: bool = False, observe=None, **options):
    options = {"window": 24, "tokens": 96 * 60, "lr": 0.1, "check_every": 20, **options}
    return heal(folder, str(src), out, CalibrationData((str(ids),), None, ids.name), HealOptions(**options),
                force=force, observe=observe)


def test_healing_lowers_the_held_out_kl_and_keeps_everything_else(converted, tmp_path):
    src, folder, ids = converted
    before = hashes(folder)
    report = run_heal(src, folder, ids, tmp_path / "healed")
    healed = tmp_path / "healed"
    assert hashes(folder) == before  # the input is never written
    assert report.held_out_after.kl < 0.9 * report.held_out_before.kl, (report.held_out_before, report.held_out_after)
    assert report.select_kl_after < report.select_kl_before and report.best_step > 0
    assert set(report.held_out_windows).isdisjoint(report.select_windows)
    old, new = tensors(folder), tensors(healed)
    assert {n: (t.shape, t.dtype) for n, t in old.items()} == {n: (t.shape, t.dtype) for n, t in new.items()}
    changed = {name for name in old if not torch.equal(old[name], new[name])}
    trained = {f"model.layers.{i}.self_attn.{t}.weight" for i in range(2)
               for t in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj")}
    norms = {f"model.layers.{i}.self_attn.kv_a_layernorm.weight" for i in report.rescaled_layers}
    assert trained <= changed <= trained | norms
    assert json.loads((healed / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    for i in range(2):
        kv_a = new[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
        assert latent_bound(kv_a[:8], new[f"model.layers.{i}.input_layernorm.weight"]) <= 1e-5 * (1 + 1e-9)
    written = json.loads((healed / "mlaconv.json").read_text())
    assert written["heal"]["held_out_after"]["kl"] == report.held_out_after.kl
    assert written["verdict"]["level"] in ("close", "degraded", "broken") and written["output"] == str(healed)
    assert "## Healing" in (healed / "README.md").read_text()


def test_the_healed_model_runs_as_it_was_measured(converted, tmp_path):
    """The held-out figures are the healed folder's own, through AutoModelForCausalLM (recomputed here)."""
    from transformers import AutoModelForCausalLM

    src, folder, ids = converted
    report = run_heal(src, folder, ids, tmp_path / "healed", tokens=96 * 10)
    lines = [json.loads(line)["input_ids"] for line in ids.read_text().splitlines()]
    windows = [ids_[k:k + 24] for ids_ in lines for k in (0, 24)]  # each line of 48 is cut into two windows
    held = torch.tensor([windows[k] for k in report.held_out_windows])
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    healed = AutoModelForCausalLM.from_pretrained(tmp_path / "healed").eval()
    with torch.no_grad():
        p = source(held).logits[:, :-1].double().log_softmax(-1)
        q = healed(held).logits[:, :-1].double().log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).mean().item() == pytest.approx(report.held_out_after.kl, rel=1e-4)


def test_a_stop_mid_way_leaves_nothing_half_written(converted, tmp_path, monkeypatch):
    src, folder, ids = converted
    before = hashes(folder)
    real_write = heal_run._rewrite

    def interrupted(folder, into, state):
        real_write(folder, into, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(heal_run, "_rewrite", interrupted)
    for out, force in ((tmp_path / "healed", False), (folder, True)):
        with pytest.raises(KeyboardInterrupt):
            run_heal(src, folder, ids, out, force=force, tokens=96 * 2)
        assert not (tmp_path / "healed").exists() and leftovers(out) == []
        assert hashes(folder) == before


def test_bad_input_is_refused_in_one_line(converted, tmp_path, tiny_model):
    src, folder, ids = converted
    runner = CliRunner()

    def refused(*args) -> dict:
        result = runner.invoke(app, ["heal", "--json", *map(str, args)])
        assert result.exit_code == 1, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    assert "--force" in refused(folder, "--source", src, "--calib", ids)["error"]  # in place needs --force
    other = tiny_model("other", kv_heads=2, head_dim=16, layers=3)
    assert "not the one" in refused(folder, "--source", other, "--calib", ids, "--out", tmp_path / "x")["error"]
    assert "not a folder `mlaconv convert` wrote" in refused(src, "--source", src, "--calib", ids, "--out",
                                                               tmp_path / "y")["error"]
    assert "less than one step" in refused(folder, "--source", src, "--calib", ids, "--out", tmp_path / "z",
                                           "--tokens", 5)["error"]
    assert "no tokenizer" in refused(folder, "--source", src, "--out", tmp_path / "w")["error"]
    assert "--precision must be one of" in refused(folder, "--source", src, "--calib", ids, "--out", tmp_path / "u",
                                                   "--precision", "float16")["error"]
    with pytest.raises(MlaconvError, match="windows"):
        run_heal(src, folder, sampled_ids(tmp_path / "few.jsonl", count=3), tmp_path / "v")
    assert not any((tmp_path / name).exists() for name in "xyzwvu")


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_healing_in_either_precision_heals_and_says_which(converted, tmp_path, precision):
    src, folder, ids = converted
    report = run_heal(src, folder, ids, tmp_path / precision, precision=precision)
    assert report.precision == precision
    assert report.held_out_after.kl < 0.9 * report.held_out_before.kl, (report.held_out_before, report.held_out_after)
    written = json.loads((tmp_path / precision / "mlaconv.json").read_text())
    assert written["heal"]["precision"] == precision


def test_a_conversion_passes_its_healing_precision_on(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16, layers=2)
    ids = sampled_ids(tmp_path / "ids.jsonl")
    options = dict(rank=8, rope_dim=8, calib=[str(ids)], calib_tokens=48 * 24, calib_window=48, refine_steps=0,
                   heal_tokens=1024, verify=False)
    report = convert(str(src), tmp_path / "converted", ConvertOptions(**options, heal_precision="bfloat16")).heal
    assert report.precision == "bfloat16"
    older = {key: value for key, value in report.to_json().items() if key != "precision"}
    assert HealReport.from_json(older).precision == "float32"  # written before the key, when healing ran in float32
    with pytest.raises(MlaconvError, match="--heal-precision must be one of"):
        convert(str(src), tmp_path / "bad", ConvertOptions(**options, heal_precision="half"))
    assert not (tmp_path / "bad").exists()


def test_a_conversion_passes_its_healing_position_span_on(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16, layers=2)
    ids = sampled_ids(tmp_path / "ids.jsonl")
    options = dict(rank=8, rope_dim=8, calib=[str(ids)], calib_tokens=48 * 24, calib_window=48, refine_steps=0,
                   heal_tokens=1024, heal_window=32, verify=False)
    report = convert(str(src), tmp_path / "converted", ConvertOptions(**options, heal_position_span=200)).heal
    assert report.position_span == 200
    assert json.loads((tmp_path / "converted" / "mlaconv.json").read_text())["heal"]["position_span"] == 200
    assert "each spread over 200 positions" in (tmp_path / "converted" / "README.md").read_text()
    # by default up to the served context (the tiny model's 256, or --context), and 0 turns the spread off
    spans = {name: convert(str(src), tmp_path / name, ConvertOptions(**options, **extra)).heal.position_span
             for name, extra in (("default", {}), ("served", {"context": 100}), ("none", {"heal_position_span": 0}))}
    assert spans == {"default": 256, "served": 100, "none": None}
    with pytest.raises(MlaconvError, match=r"--heal-position-span must be 0 \(none\) or at least the healing window"):
        convert(str(src), tmp_path / "bad", ConvertOptions(**options, heal_position_span=31))
    assert not (tmp_path / "bad").exists()


def test_bfloat16_targets_are_the_source_computed_in_bfloat16(converted):
    """Autocast reaches the source's forward pass: its top-k differ from float32's by bfloat16's rounding, no more."""
    from transformers import AutoModelForCausalLM

    from mlaconv.heal.distill import teacher_targets

    src, _, _ = converted
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    windows = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    exact, rounded = (teacher_targets(source, windows, 8, precision=p) for p in ("float32", "bfloat16"))
    with torch.no_grad():
        reference = source(windows).logits.log_softmax(-1).topk(8).values
    assert torch.allclose(exact.logp, reference, atol=1e-5)
    gap = (rounded.logp - exact.logp).abs().max().item()
    assert 0 < gap < 0.1, gap


def test_the_command_line_prints_the_report(converted, tmp_path):
    src, folder, ids = converted
    result = CliRunner().invoke(app, ["heal", "--json", str(folder), "--source", str(src), "--calib", str(ids),
                                      "--out", str(tmp_path / "healed"), "--window", "24", "--tokens", "960"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 10 and report["tokens"] == 960 and report["trained"][0] == "self_attn.q_proj"
    assert report["verdict"]["level"] in ("close", "degraded", "broken")


def test_a_conversion_heals_on_the_window_it_is_given(tiny_model, tmp_path):
    """``convert --heal-window W``: healing's chunks are W tokens and each step holds 2048 tokens; the default is 512
    (here the data's 64, shorter); a window longer than the calibration's is refused before any work."""
    src = tiny_model(kv_heads=2, head_dim=16, layers=2)
    ids = sampled_ids(tmp_path / "ids.jsonl", count=40, length=64)
    options = dict(rank=8, rope_dim=8, calib=[str(ids)], calib_tokens=64 * 24, calib_window=64, refine_steps=0,
                   heal_tokens=2048, verify=False)
    given = convert(str(src), tmp_path / "given", ConvertOptions(**options, heal_window=32)).heal
    default = convert(str(src), tmp_path / "default", ConvertOptions(**options)).heal
    assert (given.window, given.batch, given.steps, given.tokens) == (32, 64, 1, 2048)
    assert (default.window, default.batch, default.steps, default.tokens) == (64, 4, 8, 2048)
    with pytest.raises(MlaconvError, match="--heal-window must be between 2 and --calib-window"):
        convert(str(src), tmp_path / "long", ConvertOptions(**options, heal_window=128))
    assert not (tmp_path / "long").exists()


def test_the_linear_schedule_lowers_the_step_to_zero(converted, tmp_path, monkeypatch):
    """``--lr-schedule linear``: Adam's step at step s of n is lr·(1 − (s − 1)/n) (constant: lr every step); the
    step each ``Adam.step`` call ran at is recorded, and a conversion passes ``--heal-lr-schedule`` on."""
    src, folder, ids = converted
    used: list[float] = []
    step = torch.optim.Adam.step

    def recorded(self, *args, **kwargs):
        used.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recorded)
    for schedule, out in (("linear", "lin"), ("constant", "const")):
        result = CliRunner().invoke(app, ["heal", "--json", str(folder), "--source", str(src), "--calib", str(ids),
                                          "--out", str(tmp_path / out), "--window", "24", "--tokens", "480",
                                          "--lr", "0.05", "--lr-schedule", schedule])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout.strip().splitlines()[-1])["lr_schedule"] == schedule
    assert used == pytest.approx([0.05, 0.04, 0.03, 0.02, 0.01] + [0.05] * 5, rel=1e-12)
    refused = CliRunner().invoke(app, ["heal", "--json", str(folder), "--source", str(src), "--calib", str(ids),
                                       "--out", str(tmp_path / "bad"), "--lr-schedule", "cosine"])
    assert refused.exit_code == 1 and "--lr-schedule must be one of constant, linear" in refused.stdout
    options = dict(rank=8, rope_dim=8, calib=[str(ids)], calib_tokens=48 * 24, calib_window=48, refine_steps=0,
                   heal_tokens=2048, verify=False)
    used.clear()
    report = convert(str(src), tmp_path / "converted", ConvertOptions(**options, heal_lr_schedule="linear")).heal
    assert report.lr_schedule == "linear" and used[0] == report.lr
    assert used[-1] == pytest.approx(report.lr / report.steps)
    older = {key: value for key, value in report.to_json().items() if key != "lr_schedule"}
    assert HealReport.from_json(older).lr_schedule == "constant"  # written before the key, when every step was lr
    with pytest.raises(MlaconvError, match="--heal-lr-schedule must be one of"):
        convert(str(src), tmp_path / "bad-convert", ConvertOptions(**options, heal_lr_schedule="cosine"))
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad-convert").exists()


def test_an_observer_sees_the_start_and_every_check_and_changes_nothing(converted, tmp_path):
    """``observe(step, model)`` (a bench's own measurements) runs at step 0 and at every check, on the model being
    trained as it is then; the healed output is byte for byte the one healed without it."""
    src, folder, ids = converted
    seen = []

    def observe(step, model):
        seen.append((step, model.model.layers[0].self_attn.q_proj.weight.detach().clone()))

    report = run_heal(src, folder, ids, tmp_path / "observed", observe=observe)
    run_heal(src, folder, ids, tmp_path / "plain")
    assert [step for step, _ in seen] == [step for step, _ in report.curve] == [0, 20, 40, 60]
    start = tensors(folder)["model.layers.0.self_attn.q_proj.weight"].float()
    assert torch.allclose(seen[0][1], start, rtol=1e-6, atol=0)
    assert not torch.allclose(seen[-1][1], start, rtol=1e-3, atol=0)  # it saw the model as it trained
    observed, plain = tensors(tmp_path / "observed"), tensors(tmp_path / "plain")
    assert observed.keys() == plain.keys() and all(torch.equal(observed[n], plain[n]) for n in plain)


def test_layers_are_recomputed_when_a_window_would_not_fit(converted, tmp_path, monkeypatch):
    """Where one window's activations would take over half the free memory, each decoder layer runs again in the
    backward pass (one more attention call per trained window) and the report says so; the healed tensors are the
    ones healed without it, and with the memory free nothing is recomputed."""
    src, folder, ids = converted
    calls = {}

    def counting(name):
        def observe(step, model):
            if step == 0:
                calls[name] = 0
                attention = model.model.layers[0].self_attn
                attention.register_forward_hook(lambda *_: calls.__setitem__(name, calls[name] + 1))
        return observe

    plain = run_heal(src, folder, ids, tmp_path / "plain", observe=counting("plain"))
    monkeypatch.setattr(heal_run, "free_memory_bytes", lambda device: 1000)
    recomputed = run_heal(src, folder, ids, tmp_path / "recomputed", observe=counting("recomputed"))
    assert (plain.recompute, recomputed.recompute) == (False, True)
    assert calls["recomputed"] - calls["plain"] == recomputed.steps * recomputed.batch > 0
    a, b = tensors(tmp_path / "plain"), tensors(tmp_path / "recomputed")
    assert a.keys() == b.keys() and all(torch.allclose(a[n].float(), b[n].float(), rtol=1e-5, atol=0) for n in a)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[key], tensors(folder)[key])  # it healed


def test_healing_spreads_its_windows_over_the_default_span_or_the_context_where_shorter():
    assert default_position_span(None, 512, 8192) == POSITION_SPAN == 4096
    assert default_position_span(None, 512, 2048) == 2048
    assert default_position_span(None, 512, 512) == 0  # a context no longer than the window: nothing to spread
    assert default_position_span(1000, 512, 8192) == 1000
    assert default_position_span(0, 512, 8192) == 0


def test_skipped_positions_spread_each_window_over_the_span_in_two_chunks():
    positions = heal_run.skipped_positions(200, 24, 256, seed=3)
    assert positions.shape == (200, 24) and torch.equal(positions, heal_run.skipped_positions(200, 24, 256, seed=3))
    assert not torch.equal(positions, heal_run.skipped_positions(200, 24, 256, seed=4))
    assert (positions[:, 0] == 0).all() and (positions[:, -1] <= 255).all()
    steps = positions.diff(dim=1)
    assert ((steps == 1).sum(1) >= 22).all() and (steps >= 1).all()  # one skip at most, never backwards
    skips = positions[:, -1] - 23
    assert skips.min() < 20 and skips.max() > 210  # spread from no skip to the whole span


def test_position_spanned_healing_trains_source_and_model_at_the_same_positions(converted, tmp_path, monkeypatch):
    """``heal --position-span``: the source's targets on the training windows are its distributions at the skipped
    positions (recomputed here through transformers' own model), not at 0 … S − 1, and every training forward of the
    model being trained gets the same windows' positions; the select windows stay at their own."""
    from transformers import AutoModelForCausalLM

    src, folder, ids = converted
    captured, seen = {}, []
    original = heal_run.teacher_targets

    def capturing(model, windows, top_k, progress, label, positions=None, precision=None):
        targets = original(model, windows, top_k, progress, label, positions, precision)
        captured[label] = (windows, targets)
        return targets

    def observe(step, model):
        if step == 0:
            model.model.register_forward_pre_hook(
                lambda module, args, kwargs: seen.append((kwargs.get("position_ids"), kwargs.get("attention_mask"))),
                with_kwargs=True)

    monkeypatch.setattr(heal_run, "teacher_targets", capturing)
    report = run_heal(src, folder, ids, tmp_path / "spanned", observe=observe, position_span=400, precision="float32")
    assert report.position_span == 400
    windows, targets = captured["source on the training windows"]
    assert torch.equal(targets.positions, heal_run.skipped_positions(len(windows), 24, 400, seed=0))
    assert captured["source on the select windows"][1].positions is None
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    k = int(targets.positions.diff(dim=1).max(1).values.argmax())  # the window with the longest skip
    split = int((targets.positions[k].diff() > 1).nonzero()[0, 0]) + 1
    window, positions, top_k = windows[k: k + 1], targets.positions[k: k + 1], targets.logp.shape[-1]
    with torch.no_grad():  # with the first chunk in view, at the skipped positions; at 0 … S − 1; the second chunk alone
        at = source(window, position_ids=positions, attention_mask=torch.ones_like(window)).logits.log_softmax(-1)
        plain = source(window).logits.log_softmax(-1)
        alone = source(window[:, split:], position_ids=positions[:, split:]).logits.log_softmax(-1)
    assert torch.allclose(at.topk(top_k).values, targets.logp[k], atol=1e-5)
    assert not torch.allclose(plain.topk(top_k).values, targets.logp[k], atol=1e-3)
    assert not torch.allclose(alone.topk(top_k).values, targets.logp[k, split:], atol=1e-3)
    trained = [(ids, mask) for ids, mask in seen if ids is not None]
    assert len(trained) == report.steps * report.batch
    rows = {tuple(row.tolist()) for row in targets.positions}
    assert all(tuple(ids[0].tolist()) in rows and bool(mask.all()) for ids, mask in trained)
    refused = CliRunner().invoke(app, ["heal", "--json", str(folder), "--source", str(src), "--calib", str(ids),
                                       "--out", str(tmp_path / "bad"), "--window", "24", "--position-span", "16"])
    assert refused.exit_code == 1 and "--position-span must be 0 (none) or at least --window (24)" in refused.stdout
    assert not (tmp_path / "bad").exists()
