"""The convert command as a user runs it: recipes with overrides, --json, evaluation in the report."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mlaconv.cli import app

ROOT = Path(__file__).resolve().parents[1]


def convert(*args):
    return CliRunner().invoke(app, ["convert", *map(str, args)])


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
