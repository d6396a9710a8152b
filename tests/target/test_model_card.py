"""The model card renders from a real conversion report and states its numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from mlaconv.conversion.options import ConvertOptions

from mlaconv.conversion.run import convert
from mlaconv.report import EvalReport
from mlaconv.report.conversion import Agreement, Calibration, LayerFigures, Verification, WholeModel
from mlaconv.report.record import Failure, WindowSets
from mlaconv.target.model_card import render_model_card, write_model_card


@pytest.fixture(scope="module")
def report(stories, tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "stories-mla"
    return convert(str(stories), out, ConvertOptions(rank=24, verify=True, verify_windows=1, verify_window=16))


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_card_from_a_real_report(report, tmp_path):
    write_model_card(tmp_path, report)
    card = (tmp_path / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and meta["tags"] == ["mla", "deepseek_v3", "mlaconv"]
    assert "base_model" not in meta  # a local folder has no hub id
    assert f"mlaconv {report.mlaconv_version}" in card and report.source in card

    kv, kv_bytes = report.kv_elements_per_token_per_layer, report.kv_bytes_per_token
    assert f"| elements per layer | {kv.source} | {kv.converted} (r + R = 24 + 8) |" in card
    assert f"| {kv_bytes.source:,} | {kv_bytes.converted:,} |" in card
    assert "50.0% of the source's" in card
    for name, value in report.settings.items():
        assert f"| {name} |" in card, name

    energy, rope_kept = report.energy_retained.per_layer, report.rope_energy_kept
    for i, (e, k) in enumerate(zip(energy, rope_kept)):
        assert f"| {i} | {e:.4f} | {k:.4f} |" in card
    assert f"| **mean** | **{report.energy_retained.mean:.4f}** | **{report.rope_energy_kept_mean:.4f}** |" in card

    check = report.verify
    assert f"{check.kl:.4g}" in card and f"{check.top1:.2%}" in card and "16 tokens" in card
    for warning in report.serving.warnings:
        assert warning in card
    assert "| Triton MLA (vLLM, SGLang; any GPU): generic | yes |" in card
    assert "AutoModelForCausalLM.from_pretrained" in card and "trust_remote_code=True" not in card
    # r + R = 32 is not a shape vLLM runs: the card says so instead of a command that would fail
    assert "vllm serve" not in card and "# vLLM does not run this checkpoint: r + R = 32" in card
    assert "- vllm: does not run this checkpoint: vllm runs MLA only with" in card
    assert "sglang.launch_server" in card and "--attention-backend triton" in card
    served = replace(report, kv_lora_rank=256, qk_rope_head_dim=64,
                     serving=replace(report.serving, kernels={**report.serving.kernels, "vllm_head_size_whitelist": True}))
    assert "vllm serve" in render_model_card(served) and "--attention-backend TRITON_MLA" in render_model_card(served)
    assert "lm_eval --model hf" in card
    assert "## Evaluation" not in card  # the report has none
    assert "Quality was measured only by" in card


def test_card_names_the_hub_model_and_renders_an_evaluation(report):
    evaluation = EvalReport(
        model=report.output, baseline="/cache/hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abcd",
        data="dataset wikitext:wikitext-2-raw-v1:test", tokenizer=None, window=2048, windows=140, tokens=286580,
        stream_tokens=290000, dropped_tokens=3000, dtype="bfloat16", device="cpu", engine="transformers",
        engine_differences=[], ppl=8.41, ppl_stderr=None, nll=2.13, nll_stderr=None, baseline_ppl=6.85,
        baseline_ppl_stderr=None, drift=0.2277, kl_per_token=0.125, top1_agreement=0.81,
        kv_elements_per_token={}, kv_bytes_per_token={}, notes=["ran one after the other"], seconds=1.0)
    report = replace(report, source="/cache/hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abcd",
                     source_revision="0123abcd", eval=evaluation)
    card = render_model_card(report)
    assert front_matter(card)["base_model"] == "Qwen/Qwen2.5-0.5B"
    assert "[Qwen/Qwen2.5-0.5B](https://huggingface.co/Qwen/Qwen2.5-0.5B) (revision `0123abcd`)" in card
    assert "| perplexity | 6.8500 | 8.4100 |" in card and "+22.77%" in card and "81.00%" in card
    assert "140 windows of 2048 tokens" in card and "- ran one after the other" in card
    assert "tokenizer=Qwen/Qwen2.5-0.5B" in card


@pytest.mark.parametrize("check, expected", [
    (None, "was not run"),
    (Verification(skipped="both models need 30 GiB"), "was skipped: both models need 30 GiB"),
])
def test_card_without_a_check(report, check, expected):
    card = render_model_card(replace(report, verify=check))
    assert expected in card and "built-in check on" not in card


def test_card_renders_a_failed_evaluation(report):
    card = render_model_card(replace(report, eval=Failure("the evaluation failed: no such text file x.txt")))
    assert "## Evaluation\n\n| key | value |\n|---|---|\n| error | the evaluation failed: no such text file x.txt |" in card


def test_card_says_which_layers_were_refined(report):
    figures = LayerFigures(*[[None] * 5] * 9)
    calibration = Calibration(windows=16, window=256, tokens=4096, window_sets=WindowSets([0] * 8, [1] * 4, [2] * 4, None),
                              refine_steps=200, refine_batch=4, refinement="default", selection=[],
                              closed_form=figures, refined=figures,
                              whole_model=WholeModel(4, 1024, Agreement(0.1, 0.9), None, "closed form", "no layer was refined"))
    calibrated = replace(report, mode="calibrated", calibration=calibration, attention_error=[0.1] * 5, layer_variant=[
        "calibrated, refined", "calibrated", "weights-only, refined", "calibrated", "calibrated, attention-weighted latent"])
    card = render_model_card(calibrated)
    assert ("calibrated, on 4,096 calibration tokens (16 windows of 256: 8 to fit, 4 to select, 4 to audit; the window "
            "indices are in `mlaconv.json`), with 2 of 5 layers refined") in card
    assert "not trained or fine-tuned afterwards" in card
    assert "refined" not in render_model_card(report).split("## KV cache")[0]


def test_card_of_a_calibrated_conversion(stories, tmp_path):
    """A real calibrated report: the window sets, the per-layer figures of the written layers (audit windows)
    and the whole-model check with both models' figures."""
    import json

    lines = (stories / "samples.jsonl").read_text().splitlines()
    ids = [t for line in lines for t in json.loads(line)["input_ids"]][: 16 * 96]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": ids[k : k + 96]}) + "\n" for k in range(0, len(ids), 96)))
    report = convert(str(stories), tmp_path / "out", ConvertOptions(
        rank=24, verify=False, calib=[str(calib)], calib_window=96, calib_tokens=16 * 96, refine_steps=20, device="cpu"))
    card = (tmp_path / "out" / "README.md").read_text()
    sets = report.calibration.window_sets
    assert f"({16} windows of 96: {len(sets.fit)} to fit, {len(sets.select)} to select, 4 to audit;" in card
    columns = zip(report.energy_retained.per_layer, report.rope_energy_kept, report.key_error, report.value_error,
                  report.attention_error, report.layer_variant)
    for i, (energy, rope, key, value, attention, variant) in enumerate(columns):
        assert f"| {i} | {energy:.4f} | {rope:.4f} | {key:.4f} | {value:.4f} | {attention:.4f} | {variant} |" in card
    whole = report.calibration.whole_model
    assert f"Written: **{whole.written}**, because {whole.reason}." in card
    for name, figures in (("closed form", whole.closed_form), ("refined", whole.refined)):
        written = " (written)" if name == whole.written else ""
        row = f"| {name}{written} | {figures.kl:.4g} | {figures.top1:.2%} |" if figures else f"| {name} | — |"
        assert row in card, row
    assert "measured on the audit windows" in card
