"""Shipped recipes fit their models' published configs, and recipes that do not fit are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import CONFIGS, ROOT, spec_for
from mlaconv.conversion.options import ConvertOptions, load_recipe, merge_options
from mlaconv.conversion.plan import check_recipe, kv_cache_figures, plan_shapes, shape_candidates
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.source.spec import SourceSpec
from mlaconv.target.serving import kernel_fit

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
REQUIRED = {"llama-2-7b", "llama-3.1-8b", "llama-3.2-1b", "llama-3.2-3b", "mistral-7b-v0.3", "qwen2.5-0.5b",
            "qwen2.5-1.5b", "qwen2.5-7b", "phi-3.5-mini", "phi-4-mini", "smollm3-3b", "granite-3.3-2b", "granite-3.3-8b",
            "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "smollm2-1.7b"}


def write(tmp_path: Path, text: str, name: str = "test.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refusal(path: Path, spec: SourceSpec | None = None) -> str:
    """The one-line message with which loading (and, given a spec, checking) the recipe fails."""
    with pytest.raises(MlaconvError) as caught:
        recipe = load_recipe(path)
        if spec is not None:
            check_recipe(recipe, spec)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_every_required_model_has_a_recipe_and_its_config():
    names = {path.stem for path in RECIPES}
    assert REQUIRED <= names
    assert names == {path.stem for path in CONFIGS.glob("*.json")}


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_shipped_recipe_fits_its_model_and_tells_the_truth(path):
    recipe = load_recipe(path)
    spec = spec_for(path.stem)
    shapes = check_recipe(recipe, spec)
    assert recipe.source and recipe.options["dtype"] == "bfloat16"
    assert recipe.kv_cache == kv_cache_figures(spec, shapes, torch.bfloat16)  # the whole block, all correct
    assert recipe.options["calib_dataset"] == "wikitext:wikitext-2-raw-v1:train"
    ConvertOptions(**recipe.options)  # every option is a ConvertOptions field
    # The comments name the kernels serving.kernel_fit finds for these shapes.
    fit = kernel_fit({"kv_lora_rank": shapes.rank, "qk_rope_head_dim": shapes.rope_dim,
                      "qk_nope_head_dim": spec.head_dim, "v_head_dim": spec.head_dim})
    assert ("fits FlashMLA" in path.read_text()) == fit["flashmla"]
    assert shapes.rank + shapes.rope_dim < spec.attention_shape.cache_elements  # a real compression
    assert fit["flashmla"] or spec.attention_shape.cache_elements <= 576  # prefer 512 + 64 where it compresses


def test_configs_have_the_published_shapes():
    one_b = spec_for("llama-3.2-1b")
    assert (one_b.hidden_size, one_b.num_layers, one_b.num_heads, one_b.num_kv_heads, one_b.head_dim,
            one_b.vocab_size, one_b.intermediate_size, one_b.rope_theta) == (2048, 16, 32, 8, 64, 128256, 8192, 5e5)
    assert one_b.rope_scaling["rope_type"] == "llama3" and one_b.rope_scaling["factor"] == 32
    assert one_b.tie_word_embeddings
    qwen = spec_for("qwen2.5-0.5b")
    assert (qwen.hidden_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim,
            qwen.intermediate_size, qwen.vocab_size) == (896, 24, 14, 2, 64, 4864, 151936)
    assert qwen.tie_word_embeddings and qwen.qkv_bias and qwen.rms_norm_eps == 1e-6
    assert spec_for("llama-2-7b").num_kv_heads == 32 and spec_for("llama-2-7b").dtype == torch.float16
    assert spec_for("qwen2.5-7b").vocab_size == 152064 and not spec_for("qwen2.5-7b").tie_word_embeddings


def test_new_family_configs_have_the_published_shapes():
    phi4 = spec_for("phi-4-mini")
    assert (phi4.family.label, phi4.num_heads, phi4.num_kv_heads, phi4.head_dim, phi4.rotary_dim) == ("Phi-3", 24, 8, 128, 96)
    assert phi4.rope_scaling["rope_type"] == "longrope" and phi4.rope_scaling["short_factor"] == [1.0] * 48
    assert phi4.rope_attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    assert phi4.tie_word_embeddings and phi4.vocab_size == 200064
    phi35 = spec_for("phi-3.5-mini")
    assert (phi35.num_heads, phi35.num_kv_heads, phi35.head_dim, phi35.rotary_dim) == (32, 32, 96, 96)
    assert len(phi35.rope_scaling["long_factor"]) == 48 and phi35.rope_scaling["original_max_position_embeddings"] == 4096
    smol = spec_for("smollm3-3b")
    assert [i for i, rotated in enumerate(smol.rope_layers) if not rotated] == list(range(3, 36, 4))
    assert (smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim, smol.rope_theta) == (36, 16, 4, 128, 5e6)
    for size, hidden, attention, logits in (("2b", 2048, 1 / 64, 8.0), ("8b", 4096, 1 / 128, 16.0)):
        granite = spec_for(f"granite-3.3-{size}")
        assert (granite.family.label, granite.hidden_size, granite.num_layers, granite.num_kv_heads) == ("Granite", hidden, 40, 8)
        assert (granite.config["attention_multiplier"], granite.config["logits_scaling"]) == (attention, logits)
        assert granite.config["embedding_multiplier"] == 12.0 and granite.config["residual_multiplier"] == 0.22


def test_qwen3_configs_have_the_published_shapes_and_qk_norm():
    for size, hidden, layers, heads, tied in (("0.6b", 1024, 28, 16, True), ("1.7b", 2048, 28, 16, True),
                                              ("4b", 2560, 36, 32, True), ("8b", 4096, 36, 32, False)):
        qwen3 = spec_for(f"qwen3-{size}")
        assert (qwen3.family.label, qwen3.family.qk_norm, qwen3.hidden_size, qwen3.num_layers, qwen3.num_heads,
                qwen3.num_kv_heads, qwen3.head_dim, qwen3.tie_word_embeddings) == ("Qwen3", True, hidden, layers,
                                                                                    heads, 8, 128, tied)
        assert qwen3.rope_theta == 1e6 and qwen3.rope_scaling is None and not qwen3.qkv_bias


@pytest.mark.parametrize("name, layers, hidden, heads, head_dim", [
    ("phi-3.5-mini", 32, 3072, 32, 96),  # Phi-3-mini's attention shapes (3.5 adds LongRoPE)
    ("smollm2-1.7b", 24, 2048, 32, 64),
    ("llama-2-7b", 32, 4096, 32, 128),
])
def test_mha_configs_keep_one_shared_rope_key_for_every_head(name, layers, hidden, heads, head_dim):
    """Full MHA sources (issue 18): n_kv = n_heads, so the source caches 2·N·d per layer and token, and the
    converted cache holds one R-dim rotary key for all N heads, whatever the split."""
    spec = spec_for(name)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        layers, hidden, heads, heads, head_dim)
    assert spec.attention_shape.cache_elements == 2 * heads * head_dim
    shapes = check_recipe(load_recipe(ROOT / "recipes" / f"{name}.yaml"), spec)
    assert (shapes.rank, shapes.rope_dim) == (512, 64)
    assert (shapes.rank + shapes.rope_dim) / spec.attention_shape.cache_elements == pytest.approx(576 / (2 * heads * head_dim))
    half = plan_shapes(spec, None, 0.5, None)  # --kv-keep 0.5: R = 64 by default, the latent gets the rest
    assert (half.rank, half.rope_dim) == (heads * head_dim - 64, 64)
    candidates = shape_candidates(spec, 0.5)  # what the calibrated split search compares
    assert [c.rope_dim for c in candidates] == [R for R in (16, 32, 48, 64, 96, 128) if R <= head_dim]
    for c in candidates:
        assert c.rank + c.rope_dim <= heads * head_dim and c.rank % 16 == 0


def test_recipe_for_another_model_is_refused():
    message = refusal(ROOT / "recipes" / "llama-3.1-8b.yaml", spec_for("qwen2.5-0.5b"))
    assert message.startswith("recipe llama-3.1-8b.yaml does not fit this Qwen2 model")
    assert "--rank 512 is larger than the matrix allows" in message


def test_rope_dim_larger_than_head_dim_is_refused(tmp_path):
    path = write(tmp_path, "rank: 64\nrope_dim: 128\n", "small.yaml")
    assert "rope-dim 128 is larger than the source head_dim 64" in refusal(path, spec_for("qwen2.5-0.5b"))


def test_rope_stride_that_does_not_fit_is_refused(tmp_path):
    path = write(tmp_path, "rank: 512\nrope_dim: 64\nrope_stride: 3\n")
    assert "rope_stride 3 does not fit 64 rope dims" in refusal(path, spec_for("llama-3.1-8b"))


def test_float16_is_refused(tmp_path):
    path = write(tmp_path, "rank: 512\ndtype: float16\n")
    assert "float16 output is refused" in refusal(path, spec_for("llama-3.1-8b"))


def test_kv_cache_block_that_lies_is_refused(tmp_path):
    text = (ROOT / "recipes" / "llama-3.1-8b.yaml").read_text().replace("converted: 36864", "converted: 18432")
    message = refusal(write(tmp_path, text, "liar.yaml"), spec_for("llama-3.1-8b"))
    assert "kv_cache.bytes_per_token.converted says 18432, the shapes give 36864" in message


@pytest.mark.parametrize("text, expected", [
    ("rank: 512\nrnak: 512\n", "unknown key 'rnak'"),
    ("rank: 512\nkv_cache:\n  bytes: {source: 1}\n", "unknown key kv_cache.'bytes'"),
    ("rank: 512\nkv_cache:\n  bytes_per_token: {before: 1}\n", "unknown key kv_cache.bytes_per_token.'before'"),
    ("rank: '512'\n", "rank must be int, got '512'"),
    ("rank: true\n", "rank must be int, got True"),
    ("kv_keep: half\n", "kv_keep must be float or int"),
    ("rank: 512\ncalib: notes.txt\n", "calib must be a list"),
    ("rank: 512\nverify: 1\n", "verify must be bool"),
    ("rank: 512\nkv_keep: 0.5\n", "must set exactly one of rank and kv_keep"),
    ("rope_dim: 64\n", "must set exactly one of rank and kv_keep"),
    ("- rank\n", "must be a mapping"),
    ("rank: [512\n", "is not valid YAML"),
    ("rank: 512\nsource: 7\n", "source must be a string"),
])
def test_malformed_recipes_are_refused_in_one_line(tmp_path, text, expected):
    assert expected in refusal(write(tmp_path, text))


def test_missing_recipe_is_refused(tmp_path):
    assert "cannot read recipe nothing.yaml" in refusal(tmp_path / "nothing.yaml")


def test_values_are_normalised(tmp_path):
    (tmp_path / "data").mkdir()
    recipe = load_recipe(write(tmp_path, "kv_keep: 1\nshard_size: 500MB\ncalib: [data/a.txt, /abs/b.txt]\n"))
    assert recipe.options == {"kv_keep": 1.0, "shard_size": 500_000_000,
                              "calib": [str(tmp_path / "data" / "a.txt"), "/abs/b.txt"]}
    assert recipe.source is None and recipe.kv_cache is None


def test_command_line_values_override_the_recipe():
    recipe = {"rank": 512, "rope_dim": 64, "dtype": "bfloat16", "calib_dataset": "wikitext", "calib_tokens": 131072}
    assert merge_options(recipe, {"rank": None, "dtype": None}) == recipe
    assert merge_options(recipe, {"dtype": "float32", "calib_tokens": 8192}) == {**recipe, "dtype": "float32",
                                                                                  "calib_tokens": 8192}
    assert merge_options(recipe, {"kv_keep": 0.5}) == {"kv_keep": 0.5, "rope_dim": 64, "dtype": "bfloat16",
                                                       "calib_dataset": "wikitext", "calib_tokens": 131072}
    assert merge_options({"kv_keep": 0.5, "rope_dim": 32}, {"rank": 100}) == {"rank": 100, "rope_dim": 32}
    assert merge_options(recipe, {"calib": ["mine.txt"]})["calib"] == ["mine.txt"]
    assert "calib_dataset" not in merge_options(recipe, {"calib": ["mine.txt"]})
    assert recipe == {"rank": 512, "rope_dim": 64, "dtype": "bfloat16", "calib_dataset": "wikitext",
                      "calib_tokens": 131072}  # not modified in place


def test_kv_cache_block_matches_what_convert_reports(stories, tmp_path):
    """The recipe's figures and the conversion report use the same definitions."""
    path = write(tmp_path, "rank: 24\nrope_dim: 8\ndtype: float32\nkv_cache:\n"
                           "  elements_per_token_per_layer: {source: 64, converted: 32}\n"
                           "  bytes_per_token: {source: 1280, converted: 640}\n", "stories.yaml")
    recipe = load_recipe(path)
    check_recipe(recipe, SourceSpec.from_config(json.loads((stories / "config.json").read_text())))
    options = merge_options(recipe.options, {"verify": False, "rank": None})
    report = convert(str(stories), tmp_path / "out", ConvertOptions(**options))
    assert report.kv_elements_per_token_per_layer.to_json() == recipe.kv_cache["elements_per_token_per_layer"]
    assert report.kv_bytes_per_token.to_json() == recipe.kv_cache["bytes_per_token"]


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_recipe_states_the_cpu_refinement_mlaconv_plans(path):
    """The recipe's note on what a CPU runs is the plan ``refinement_plan`` makes for it (issue 16)."""
    import re

    from mlaconv.calibration.windows import split_windows
    from mlaconv.conversion.calibrated import cpu_refinement

    recipe = load_recipe(path)
    spec = spec_for(path.stem)
    window = recipe.options["calib_window"]
    selected = len(split_windows(recipe.options["calib_tokens"] // window).select)
    cpu = cpu_refinement(spec, check_recipe(recipe, spec), window, selected)
    note = " ".join(line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#"))
    assert f"estimates the full refinement at ~{cpu.full_seconds / 3600:.1f} h for this model" in note
    if cpu.reduced_steps:
        assert f"it runs {cpu.reduced_steps} steps of one window" in note
    else:
        assert cpu.reduced_steps == 0  # none of the shipped recipes fits the full plan on a CPU
        assert re.search(rf"skips it \(even 25 steps of one window: ~{cpu.least_seconds / 3600:.1f} h\)", note)
