"""The convert command as a user runs it: recipes with overrides, --json, evaluation in the report."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from helpers import ROOT, invoke
from mlaconv.cli import app



def convert(*args):
    return invoke("convert", *args)


def test_recipe_applies_and_flags_override_it(stories, tmp_path):
    recipe = tmp_path / "stories.yaml"
    recipe.write_text(f"source: {stories}\nrank: 24\ndtype: float32\nverify: false\n")
    result = convert("--recipe", recipe, "--json", "--rank", 16, "--no-verify", stories, tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["kv_lora_rank"] == 16 and report["recipe"] == str(recipe)
    assert report["settings"]["rank"] == 16 and report["dtype"] == "float32"
    assert (tmp_path / "out" / "README.md").is_file() and (tmp_path / "out" / "mlaconv.json").is_file()


def test_recipe_source_is_the_default_source(stories, tmp_path):
    recipe = tmp_path / "stories.yaml"
    recipe.write_text(f"source: {stories}\nkv_keep: 0.5\nverify: false\n")
    result = convert("--recipe", recipe, "--json", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["kv_elements_per_token_per_layer"]["converted"] <= 32


def test_recipe_for_another_model_is_refused_in_one_line(stories, tmp_path):
    result = convert("--recipe", ROOT / "recipes" / "llama-3.1-8b.yaml", stories, tmp_path / "out")
    assert result.exit_code == 1
    message = result.output.strip()
    assert message.startswith("error:") and "llama-3.1-8b.yaml does not fit" in message
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_eval_runs_the_perplexity_command_on_the_result(stories, tmp_path):
    result = convert(stories, tmp_path / "out", "--rank", 56, "--no-verify", "--json",
                     "--eval-tokens", stories / "samples.jsonl")
    assert result.exit_code == 0, result.output
    evaluation = json.loads(result.stdout.strip().splitlines()[-1])["eval"]
    assert abs(evaluation["baseline_ppl"] - 17.66) < 0.01
    standalone = CliRunner().invoke(app, ["eval", "perplexity", str(tmp_path / "out"), "--baseline", str(stories),
                                          "--tokens", str(stories / "samples.jsonl"), "--json"])
    again = json.loads(standalone.stdout.strip().splitlines()[-1])
    assert again["ppl"] == evaluation["ppl"] and again["kl_per_token"] == evaluation["kl_per_token"]


def test_eval_inputs_are_checked_before_converting(stories, tmp_path):
    result = convert(stories, tmp_path / "out", "--rank", 8, "--eval-text", tmp_path / "missing.txt")
    assert result.exit_code == 1 and "evaluation file not found" in result.output
    assert not (tmp_path / "out").exists()


def test_a_failing_check_keeps_the_conversion(stories, tmp_path, monkeypatch):
    import mlaconv.evaluate.verify
    from mlaconv.errors import MlaconvError

    def broken(*args, **kwargs):
        raise MlaconvError("simulated failure")

    monkeypatch.setattr(mlaconv.evaluate.verify, "verify", broken)
    result = convert(stories, tmp_path / "out", "--rank", 8, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "simulated failure" in report["verify"]["error"]
    assert (tmp_path / "out" / "config.json").is_file()


def test_eval_without_room_for_both_models_reports_no_kl(stories, tmp_path, monkeypatch):
    import mlaconv.evaluate.perplexity

    monkeypatch.setattr(mlaconv.evaluate.perplexity, "free_memory_bytes", lambda device: 1)
    result = convert(stories, tmp_path / "out", "--rank", 8, "--no-verify", "--eval-tokens", stories / "samples.jsonl",
                     "--json")
    assert result.exit_code == 0, result.output
    evaluation = json.loads(result.stdout)["eval"]
    assert evaluation["kl_per_token"] is None and evaluation["top1_agreement"] is None
    assert abs(evaluation["baseline_ppl"] - 17.66) < 0.01  # the perplexities are still measured
    assert any("ran one after the other" in note for note in evaluation["notes"])
    assert "(KL and top-1 not measured: the two models did not fit in memory together)" in result.stderr


def test_unusable_device_is_one_line(stories, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, wherever this runs
    result = convert(stories, tmp_path / "out", "--rank", 8, "--device", "cuda", "--json")
    assert result.exit_code == 1 and "Traceback" not in result.output
    error = json.loads(result.stdout)
    assert error["kind"] == "input" and "no CUDA device" in error["error"]
    assert result.stderr.strip().splitlines() == [f"error: {error['error']}"]
    assert not (tmp_path / "out").exists()


def test_rope_stride_with_kv_keep_search(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=32, hidden=128, heads=4)
    ids = "".join(json.dumps({"input_ids": [(7 * i + j) % 96 for j in range(48)]}) + "\n" for i in range(8))
    (tmp_path / "calib.jsonl").write_text(ids)
    result = convert(src, tmp_path / "out", "--kv-keep", 0.5, "--rope-stride", 2, "--calib", tmp_path / "calib.jsonl",
                     "--calib-window", 48, "--no-verify", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rope_stride"] == 2


def test_calibrated_summary_shows_variants_errors_and_refinement(stories, tmp_path):
    ids = [json.loads(line)["input_ids"][:64] for line in (stories / "samples.jsonl").read_text().splitlines()[:4]]
    (tmp_path / "calib.jsonl").write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids))
    result = CliRunner().invoke(app, ["convert", str(stories), str(tmp_path / "out"), "--rank", "24", "--no-verify",
                                      "--calib", str(tmp_path / "calib.jsonl"), "--calib-window", "64",
                                      "--refine-steps", "0"])
    assert result.exit_code == 0, result.output
    assert "attention error" in result.output and "variant" in result.output
    assert ("calibration: 4 windows of 64 tokens (2 fit, 1 select, 1 audit); refinement: off (--refine-steps 0)"
            in result.output)
    assert "whole model on the 1 audit windows (64 tokens): closed form KL " in result.output
    assert "written: closed form (no layer was refined)" in result.output


def test_calibration_uses_the_gpu_when_torch_sees_one(monkeypatch):
    import torch

    from mlaconv.conversion.options import ConvertOptions
    from mlaconv.inspect.spectra import SpectraOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ConvertOptions().calibration_device == "cuda"
    assert SpectraOptions().convert_options().calibration_device == "cuda"
    assert ConvertOptions().device is None  # so the evaluation stays where the user did not move it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ConvertOptions().calibration_device == "cpu" and SpectraOptions().convert_options().calibration_device == "cpu"
    assert ConvertOptions(device="cpu").calibration_device == "cpu"
