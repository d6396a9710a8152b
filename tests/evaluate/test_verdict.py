"""The verdict: thresholds, the measurement it rests on, and a close and a broken conversion as a user sees them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlaconv.cli import app
from mlaconv.evaluate import verdict as verdicts
from mlaconv.report import EvalReport
from mlaconv.report.conversion import Verification
from mlaconv.report.record import Failure


@pytest.mark.parametrize("kl, top1, level", [
    (0.0, 1.0, "close"), (0.049, 0.90, "close"), (0.05, 0.95, "degraded"), (0.01, 0.89, "degraded"),
    (0.28, 0.728, "degraded"), (0.999, 0.40, "degraded"), (1.0, 0.99, "broken"), (0.2, 0.39, "broken"),
    (4.97, 0.07, "broken"),
])
def test_levels_follow_the_documented_thresholds(kl, top1, level):
    assert verdicts.level(kl, top1) == level


def evaluation(kl: float | None, top1: float | None) -> EvalReport:
    return EvalReport(model="m", baseline="s", data="text x.txt", tokenizer=None, window=8, windows=1, tokens=7,
                      stream_tokens=8, dropped_tokens=0, dtype="float32", device="cpu", engine="transformers",
                      engine_differences=[], ppl=2.0, ppl_stderr=None, nll=0.7, nll_stderr=None, kl_per_token=kl,
                      top1_agreement=top1, kv_elements_per_token={}, kv_bytes_per_token={}, notes=[], seconds=0.1)


def test_the_evaluation_wins_over_the_check_and_none_is_said_plainly():
    check = Verification(kl=0.001, top1=1.0, tokens=512)
    assert verdicts.conversion_verdict(check, evaluation(2.0, 0.1)).level == "broken"
    assert "evaluation" in verdicts.conversion_verdict(check, evaluation(2.0, 0.1)).basis
    assert verdicts.conversion_verdict(check, evaluation(None, None)).level == "close"  # eval without KL: the check
    assert verdicts.conversion_verdict(check, Failure("eval failed")).level == "close"
    none = verdicts.conversion_verdict(None, None)
    assert none.level == "none" and "--no-verify" in none.message and none.kl is None
    assert verdicts.conversion_verdict(Failure("boom"), None).level == "none"
    assert verdicts.conversion_verdict(Verification(skipped="too big"), None).level == "none"


def convert_json(*args) -> dict:
    result = CliRunner().invoke(app, ["convert", "--json", *map(str, args)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_exact_conversion_is_close_in_the_console_json_and_card(tiny_model, tmp_path):
    src = tiny_model(kv_heads=1, head_dim=16)
    report = convert_json(src, tmp_path / "out", "--rank", 16, "--rope-dim", 16, "--weights-only")
    assert report["verdict"]["level"] == "close" and report["verdict"]["kl"] < 1e-6
    assert report["verdict"]["kl"] == report["verify"]["kl"]
    assert json.loads((tmp_path / "out" / "mlaconv.json").read_text())["verdict"] == report["verdict"]
    assert "## Verdict\n\nClose to the source." in (tmp_path / "out" / "README.md").read_text()


def test_a_broken_conversion_is_called_broken(tiny_model, tmp_path, monkeypatch):
    """A deliberately broken conversion (every converted query and key scaled up 30×: the attention turns to one-hot
    on arbitrary keys, and o_proj 20× louder) must not look like a success."""
    from mlaconv.conversion import weights_only
    real = weights_only.convert_attention

    def broken(*args, **kwargs):
        mla, report = real(*args, **kwargs)
        mla.q_proj, mla.kv_a_proj, mla.o_proj = 30 * mla.q_proj, 30 * mla.kv_a_proj, 20 * mla.o_proj
        return mla, report

    monkeypatch.setattr(weights_only, "convert_attention", broken)
    src = tiny_model(kv_heads=2, head_dim=16)
    result = CliRunner().invoke(app, ["convert", "--json", str(src), str(tmp_path / "out"), "--rank", "8",
                                      "--rope-dim", "8"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["verdict"]["level"] == "broken", report["verdict"]
    assert report["verdict"]["kl"] >= 1 or report["verdict"]["top1"] < 0.4
    assert "verdict: broken: " in " ".join(result.stderr.split()) and "do not serve" in result.stderr
    assert "**Broken: do not serve**" in (tmp_path / "out" / "README.md").read_text()


def test_no_verify_says_no_verdict_was_made(tiny_model, tmp_path):
    report = convert_json(tiny_model(), tmp_path / "out", "--rank", 16, "--rope-dim", 8, "--no-verify",
                          "--weights-only")
    assert report["verdict"]["level"] == "none" and "--no-verify" in report["verdict"]["message"]
    assert "## Verdict\n\nNo verdict." in (tmp_path / "out" / "README.md").read_text()
