"""The bundled llama-docs example: its texts are disjoint, and a calibrated 50% conversion keeps it close.

The reported perplexities are recomputed here with plain PyTorch on the ids of the ``tokenizers`` library
(the tokenizer.json read directly) and the models as transformers' own classes load them.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from typer.testing import CliRunner

from helpers import ROOT
from mlaconv.cli import app

EXAMPLE = ROOT / "examples" / "llama-docs"
from bench.models.overlap import drop_overlapping, shared_shingles, shingles  # noqa: E402

WINDOW = 256


def test_example_texts_share_no_13_word_shingle():
    calib = (EXAMPLE / "calib.txt").read_text(encoding="utf-8")
    evaluation = (EXAMPLE / "eval.txt").read_text(encoding="utf-8")
    assert len(shingles(calib)) > 5000 and len(shingles(evaluation)) > 5000  # both are real texts
    assert shared_shingles(calib, evaluation) == set()


def test_shingle_check_sees_copies_through_case_punctuation_and_document_boundaries():
    run = "the quick brown fox jumps over the lazy dog while seven wizards quietly box"  # 14 words
    reference = f"Intro text. {run.upper().replace(' ', ', ')} and more."
    assert shared_shingles(f"before {run} after", reference)
    assert not shared_shingles(f"before {' '.join(run.split()[:12])} after", reference)  # 12 words are not enough
    docs = ["alpha beta", " ".join(run.split()[:7]), " ".join(run.split()[7:]), "unrelated words only"]
    kept, dropped = drop_overlapping(docs, reference)  # the run straddles documents 1 and 2
    assert dropped == [1, 2] and kept == ["alpha beta", "unrelated words only"]


@torch.no_grad()
def window_scores(model, windows: torch.Tensor, baseline=None) -> dict:
    """Plain next-token NLL (and, against ``baseline``, KL(baseline ‖ model) and top-1 agreement) over windows."""
    nll = kl = agree = 0.0
    count = 0
    for ids in windows.split(8):
        logp = torch.log_softmax(model(ids).logits[:, :-1].double(), -1)
        nll -= logp.gather(-1, ids[:, 1:, None]).sum().item()
        if baseline is not None:
            base = torch.log_softmax(baseline(ids).logits[:, :-1].double(), -1)
            kl += (base.exp() * (base - logp)).sum().item()
            agree += (base.argmax(-1) == logp.argmax(-1)).sum().item()
        count += ids[:, 1:].numel()
    return {"ppl": float(torch.tensor(nll / count).exp()), "kl": kl / count, "top1": agree / count}


def quick_start_command() -> list[str]:
    """The README's first command's ``mlaconv`` arguments, as a new user types them."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.strip().split("&&")[-1])[1:]


def test_the_quick_start_converts_the_example_with_a_small_drift(tmp_path, monkeypatch):
    """The README's first command, run as written (but for OUT and --json): a calibrated 50% cut of the example whose
    reported perplexities plain PyTorch reproduces."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    args = quick_start_command()
    assert args[:2] == ["convert", "examples/llama-docs"] and "--kv-keep" in args and "--eval-text" in args
    out = tmp_path / "mla"
    monkeypatch.chdir(ROOT)  # the command's paths are the checkout's
    result = CliRunner().invoke(app, [*args[:2], str(out), *args[3:], "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["kv_keep"] == 0.5 and report["mode"] == "calibrated"
    evaluation = report["eval"]
    assert evaluation["kv_kept"] == 0.5
    assert evaluation["drift"] <= 0.02 and evaluation["kl_per_token"] <= 0.02 and evaluation["top1_agreement"] >= 0.9

    text = (EXAMPLE / "eval.txt").read_text(encoding="utf-8")
    ids = torch.tensor(Tokenizer.from_file(str(EXAMPLE / "tokenizer.json")).encode(text).ids)
    assert len(ids) == evaluation["stream_tokens"]
    windows = ids[: len(ids) // WINDOW * WINDOW].view(-1, WINDOW)
    assert len(windows) == evaluation["windows"]
    source = LlamaForCausalLM.from_pretrained(EXAMPLE, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(converted).__name__ == "DeepseekV3ForCausalLM"
    expected_source = window_scores(source, windows)
    expected = window_scores(converted, windows, baseline=source)
    assert evaluation["baseline_ppl"] == pytest.approx(expected_source["ppl"], rel=1e-4)
    assert evaluation["ppl"] == pytest.approx(expected["ppl"], rel=1e-4)
    assert evaluation["drift"] == pytest.approx(expected["ppl"] / expected_source["ppl"] - 1, abs=1e-4)
    assert evaluation["kl_per_token"] == pytest.approx(expected["kl"], rel=1e-3, abs=1e-6)
    assert evaluation["top1_agreement"] == pytest.approx(expected["top1"], abs=1e-3)
