"""The latent-cache reference decoder against transformers' DeepseekV3ForCausalLM on converted checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import STORIES, make_model, rel_err
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.io.models import load_causal_lm
from mlaconv.runtime import LatentDecoder, generate
from mlaconv.target.absorb import write_absorbed

# fp32: max |Δlogit| / max |logit| over prefill and decode. The absorbed form is exact algebra; what
# remains is float32 rounding in a different order (~1e-6) and the linearised kv_a_layernorm (≤ 5e-6
# relative on the latent in mlaconv checkpoints).
LOGIT_TOLERANCE = 5e-5


def _convert(root, name, src, rank, rope_dim):
    out = root / name
    report = convert(str(src), out, ConvertOptions(rank=rank, rope_dim=rope_dim, verify=False))
    return out, report


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Converted checkpoints: tiny GQA Llama, Qwen2 with biases, Llama with linear RoPE scaling, stories260K."""
    root = tmp_path_factory.mktemp("runtime")
    return {
        "llama": _convert(root, "llama", make_model(root / "src-llama", kv_heads=2, head_dim=16, hidden=64), 24, 16),
        "qwen2": _convert(root, "qwen2", make_model(root / "src-qwen2", family="qwen2", kv_heads=2, head_dim=16,
                                                    hidden=64, eps=1e-5), 24, 16),
        "linear-rope": _convert(root, "linear-rope", make_model(root / "src-lin", kv_heads=2, head_dim=16, hidden=64,
                                rope_scaling={"rope_type": "linear", "factor": 2.0}), 20, 8),
        "stories": _convert(root, "stories", STORIES, 32, 8),
    }


def stories_prompt(length: int) -> torch.Tensor:
    first = json.loads((STORIES / "samples.jsonl").read_text().splitlines()[0])
    return torch.tensor(first["input_ids"][:length])


@pytest.mark.parametrize("name", ["llama", "qwen2", "linear-rope", "stories"])
def test_prefill_and_decode_logits_match_transformers(models, name):
    out, _ = models[name]
    tokens = stories_prompt(48)[None] if name == "stories" else torch.randint(
        0, 96, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = load_causal_lm(out, torch.float32)(tokens).logits  # [B, 48, vocab], one full pass

    model = LatentDecoder.load(out, dtype=torch.float32)
    cache = model.new_cache(batch=tokens.shape[0], max_tokens=48)
    prefill = model.forward(tokens[:, :40], cache)
    decoded = [model.forward(tokens[:, i:i + 1], cache) for i in range(40, 48)]
    logits = torch.cat([prefill, *decoded], dim=1)
    assert cache.length == 48
    assert rel_err(logits, reference) <= LOGIT_TOLERANCE
    assert rel_err(logits, reference) > 0  # really two different computations


@pytest.mark.parametrize("name", ["llama", "stories"])
def test_greedy_continuation_equals_transformers_generate(models, name):
    out, _ = models[name]
    prompt = stories_prompt(12) if name == "stories" else torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))
    reference_model = load_causal_lm(out, torch.float32)
    with torch.no_grad():
        expected = reference_model.generate(prompt[None], max_new_tokens=24, do_sample=False,
                                            attention_mask=torch.ones(1, 12, dtype=torch.long))[0]
    eos = reference_model.generation_config.eos_token_id
    produced = generate(LatentDecoder.load(out), prompt, 24, eos_token_id=eos)
    assert produced.tolist() == expected.tolist()
    assert len(set(produced[12:].tolist())) > 1  # a real continuation, not one repeated token


@pytest.mark.parametrize("name", ["llama", "stories"])
def test_cache_holds_r_plus_R_per_token_and_layer(models, name):
    out, report = models[name]
    config = json.loads((out / "config.json").read_text())
    model = LatentDecoder.load(out)
    cache = model.new_cache(batch=1, max_tokens=30)
    model.forward(torch.zeros(1, 30, dtype=torch.long), cache)
    r, R, layers = config["kv_lora_rank"], config["qk_rope_head_dim"], config["num_hidden_layers"]
    assert cache.elements_per_token_per_layer == r + R == report.kv_elements_per_token_per_layer.converted
    assert cache.rows.numel() == layers * 30 * (r + R)  # the whole decode state: no K/V anywhere else
    assert report.kv_elements_per_token_per_layer.source > r + R


def test_absorbed_folder_on_disk_gives_the_in_memory_result(models):
    out, _ = models["qwen2"]
    tokens = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(5))
    in_memory = LatentDecoder.load(out)
    write_absorbed(out, out / "absorbed-copy")
    from_disk = LatentDecoder.load(out, absorbed=out / "absorbed-copy")
    a = in_memory.forward(tokens, in_memory.new_cache(1, 20))
    b = from_disk.forward(tokens, from_disk.new_cache(1, 20))
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded_and_top_k_one_is_greedy(models):
    out, _ = models["stories"]
    model = LatentDecoder.load(out)
    prompt = stories_prompt(8)
    greedy = generate(model, prompt, 10)
    assert generate(model, prompt, 10, temperature=1.0, top_k=1, seed=0).tolist() == greedy.tolist()
    first = generate(model, prompt, 10, temperature=1.0, seed=7)
    assert generate(model, prompt, 10, temperature=1.0, seed=7).tolist() == first.tolist()
    samples = {tuple(generate(model, prompt, 10, temperature=1.5, seed=s).tolist()) for s in range(3)}
    assert len(samples) > 1  # sampling really samples


def test_a_full_cache_is_refused(models):
    out, _ = models["llama"]
    model = LatentDecoder.load(out)
    cache = model.new_cache(batch=1, max_tokens=4)
    with pytest.raises(MlaconvError, match="the cache holds 4 tokens"):
        model.forward(torch.zeros(1, 5, dtype=torch.long), cache)


def test_bench_decode_cli_reports_the_cache_byte_ratio():
    """One tiny timing through the CLI: the JSON row carries the byte ratio the goal is measured against."""
    from typer.testing import CliRunner

    from mlaconv.cli import app

    result = CliRunner().invoke(app, ["bench", "decode", "--contexts", "64", "--shapes", "llama3-8b", "--dtypes",
                                      "float32", "--repeats", "1", "--warmup", "0", "--warm", "--no-expanded", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])["rows"][0]
    assert row["cache_bytes_read_per_token"] == {"source": 2 * 8 * 128 * 64 * 4, "mla": (512 + 64) * 64 * 4}
    assert row["ideal_speedup"] == pytest.approx(2 * 8 * 128 / (512 + 64))
    assert row["ms"]["expanded"] is None and all(row["ms"][k] > 0 for k in ("source", "absorbed", "factored"))
    assert row["fraction_of_ideal"] == pytest.approx(row["ms"]["source"] / row["ms"]["absorbed"] / row["ideal_speedup"])
