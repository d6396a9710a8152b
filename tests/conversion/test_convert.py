"""End to end: convert tiny models and the bundled stories260K, load them through the public loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import logits, rel_err
from mlaconv.conversion.options import ConvertOptions

from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.io.models import load_causal_lm

TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))


def run(src, out, **options):
    options.setdefault("verify", False)
    return convert(str(src), out, ConvertOptions(**options))


def check_by_hand(src, out, report, drop_biases: bool = False) -> dict:
    """The built-in check's KL and top-1 recomputed here: transformers' own models on the check's tokens,
    KL(source ‖ converted) and top-1 agreement in plain PyTorch (``drop_biases``: as vLLM/SGLang run it)."""
    from mlaconv.source.spec import load_source
    from mlaconv.evaluate.verify import verification_tokens

    check = report.verify
    assert check.dtype == "float32"
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    if drop_biases:
        for layer in converted.model.layers:
            for module in (layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.o_proj):
                if module.bias is not None:
                    module.bias.data.zero_()
    tokens = verification_tokens(Path(src), load_source(str(src))[1], check.windows,
                                 check.tokens // check.windows, model=source)
    assert tokens.numel() == check.tokens
    with torch.no_grad():
        logp = torch.log_softmax(source(tokens).logits.double(), -1)
        logq = torch.log_softmax(converted(tokens).logits.double(), -1)
    return {"kl": (logp.exp() * (logp - logq)).sum(-1).mean().item(),
            "top1": (logp.argmax(-1) == logq.argmax(-1)).double().mean().item()}


def test_mqa_full_rank_is_exact_in_float32(tiny_model, tmp_path):
    src = tiny_model(kv_heads=1, head_dim=16)
    report = run(src, tmp_path / "out", rank=16, rope_dim=16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert report.rope_energy_kept == pytest.approx([1.0, 1.0])
    assert report.energy_retained.mean == pytest.approx(1.0)
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


def test_mqa_full_rank_bfloat16_within_rounding(tiny_model, tmp_path):
    src = tiny_model(kv_heads=1, head_dim=16, dtype=torch.bfloat16)
    report = run(src, tmp_path / "out", rank=16, rope_dim=16)
    assert report.dtype == "bfloat16"
    reference = logits(src, TOKENS, dtype=torch.float32)
    # bf16 source evaluated in bf16 differs from its own float32 evaluation by rounding alone; the
    # converted model must stay within a small multiple of that.
    source_bf16 = logits(src, TOKENS, dtype=torch.bfloat16)
    converted_bf16 = logits(tmp_path / "out", TOKENS, dtype=torch.bfloat16)
    rounding = rel_err(source_bf16, reference)
    assert rel_err(converted_bf16, reference) <= 4 * rounding + 1e-2


def test_rank_one_keys_per_frequency_keep_all_rope_and_are_exact(tiny_model, tmp_path):
    """GQA/MHA keys whose heads are complex multiples of one key per frequency: everything stays rotated."""
    for kv_heads in (2, 4):
        src = tiny_model(f"src{kv_heads}", kv_heads=kv_heads, head_dim=16)
        weights = _make_keys_rank_one(src, kv_heads)
        report = run(src, tmp_path / f"out{kv_heads}", rank=min(64, 2 * kv_heads * 16 - 16), rope_dim=16)
        assert min(report.rope_energy_kept) == pytest.approx(1.0, abs=1e-9), weights
        assert report.energy_retained.mean == pytest.approx(1.0)
        assert rel_err(logits(tmp_path / f"out{kv_heads}", TOKENS), logits(src, TOKENS)) <= 1e-4


def _make_keys_rank_one(folder, kv_heads):
    """Rewrite k_proj so that, per frequency, head g's pair is c_g (a complex number) times one shared pair."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in state if n.endswith("k_proj.weight")]:
        w = state[name]
        d = w.shape[0] // kv_heads
        base = w[:d]
        coeff = torch.randn(kv_heads, d // 2, 2, generator=gen)
        rows = []
        for g in range(kv_heads):
            re, im = base[: d // 2], base[d // 2 :]
            cr, ci = coeff[g, :, 0:1], coeff[g, :, 1:2]
            rows.append(torch.cat([cr * re - ci * im, ci * re + cr * im]))
        state[name] = torch.cat(rows).contiguous()
    save_file(state, path, metadata={"format": "pt"})
    return sorted(state)


def test_gqa_error_comes_only_from_unrotated_rope_energy(tiny_model, tmp_path):
    """At full latent rank, logit error shrinks to zero as the RoPE energy kept rises to one."""
    src = tiny_model(kv_heads=2, head_dim=16)
    _make_keys_rank_one(src, 2)
    from safetensors.torch import load_file, save_file

    clean = load_file(src / "model.safetensors")
    noise = {n: torch.randn_like(t) * 0.2 for n, t in clean.items() if n.endswith("k_proj.weight")}
    errors, kept = [], []
    for step, t in enumerate((0.3, 0.1, 0.03, 0.0)):
        state = {n: (w + t * noise[n] if n in noise else w) for n, w in clean.items()}
        save_file(state, src / "model.safetensors", metadata={"format": "pt"})
        report = run(src, tmp_path / f"out{step}", rank=48, rope_dim=16)
        assert report.energy_retained.mean == pytest.approx(1.0)
        kept.append(min(report.rope_energy_kept))
        errors.append(rel_err(logits(tmp_path / f"out{step}", TOKENS), logits(src, TOKENS)))
    assert kept == sorted(kept) and kept[-1] == pytest.approx(1.0)
    assert errors == sorted(errors, reverse=True)
    assert errors[0] > 1e-3 and errors[-1] <= 1e-4


def test_energy_retained_rises_with_rank_to_one(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16)
    energies = [run(src, tmp_path / f"r{r}", rank=r, rope_dim=8).energy_retained.mean for r in (4, 16, 32, 56)]
    assert energies == sorted(energies)
    assert energies[-1] == pytest.approx(1.0)
    assert energies[0] < 0.9


def test_llama_eps_rescale_is_exact(tiny_model, tmp_path):
    src = tiny_model(kv_heads=1, head_dim=16, eps=1e-5, scale=0.02)
    report = run(src, tmp_path / "out", rank=16, rope_dim=16)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6
    assert report.residual_scale == pytest.approx((1e-6 / 1e-5) ** 0.5)
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


def test_qwen2_biases_folded_and_reported_for_transformers(tiny_model, tmp_path):
    src = tiny_model(family="qwen2", kv_heads=1, head_dim=16)
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    for name in state:
        if name.endswith("q_proj.bias"):
            state[name] = torch.zeros_like(state[name])
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    report = run(src, tmp_path / "out", rank=16, rope_dim=16, verify=True, target="transformers")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["attention_bias"] is True and report.dropped_bias == []
    # k and v biases are folded exactly (k's NoPE part is softmax-invariant, v's goes to o_proj.bias).
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4
    assert report.verify.max_rel_logit_diff <= 1e-4
    dropped = check_by_hand(src, tmp_path / "out", report, drop_biases=True)["kl"]
    engines = report.verify.engines
    for name in ("vllm", "sglang"):  # what vLLM/SGLang compute, measured
        assert engines[name]["kl"] == pytest.approx(dropped, rel=1e-6)
        assert engines[name]["differences"] == ["drops kv_a_proj_with_mqa.bias", "drops o_proj.bias"]
    assert dropped > 1e-6
    assert "llama.cpp's deepseek2 has no attention biases" in engines["llamacpp"]["refused"]
    assert any("vLLM and SGLang drop" in w for w in report.serving.warnings)


def test_qwen2_query_bias_is_reported_and_measured(tiny_model, tmp_path):
    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16)
    report = run(src, tmp_path / "out", rank=48, rope_dim=16, verify=True)
    assert report.dropped_bias == ["q_proj.bias"]
    assert any("q_proj.bias" in w for w in report.serving.warnings)
    by_hand = check_by_hand(src, tmp_path / "out", report)
    assert report.verify.kl == pytest.approx(by_hand["kl"], rel=1e-6) and by_hand["kl"] > 1e-6
    assert report.verify.top1 == by_hand["top1"]


def test_mistral_converts(tiny_model, tmp_path):
    src = tiny_model(family="mistral", kv_heads=1, head_dim=16, sliding_window=None)
    run(src, tmp_path / "out", rank=16, rope_dim=16)
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


@pytest.mark.parametrize("rank", [8, 24, 56])
def test_stories260k_converts_and_generates(stories, tmp_path, rank):
    report = run(stories, tmp_path / "out", rank=rank, verify=True, verify_windows=2, verify_window=32)
    kv = report.kv_elements_per_token_per_layer
    assert (kv.source, kv.converted) == (64, rank + 8)
    assert len(report.energy_retained.per_layer) == 5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    generated = model.generate(torch.tensor([[1]]), max_new_tokens=12, do_sample=False)
    assert generated.shape == (1, 13)
    by_hand = check_by_hand(stories, tmp_path / "out", report)
    assert report.verify.top1 == by_hand["top1"]
    assert report.verify.kl == pytest.approx(by_hand["kl"], rel=1e-6)


def test_kv_keep_picks_shapes_within_budget(stories, tmp_path):
    report = run(stories, tmp_path / "out", kv_keep=0.5)
    kv = report.kv_elements_per_token_per_layer
    assert kv.converted <= 32 and report.qk_rope_head_dim % 2 == 0
    with pytest.raises(MlaconvError, match="give exactly one"):
        run(stories, tmp_path / "x", kv_keep=0.5, rank=8)


def test_tiny_latent_bound_holds_for_huge_hidden_states(tiny_model, tmp_path):
    """Hidden states 1e4× larger than usual: every latent stays in the ε-dominated regime and the
    converted model still matches the source."""
    from mlaconv.mla.latent_norm import DEFAULT_DELTA, LATENT_NORM_EPS

    src = tiny_model(kv_heads=1, head_dim=16, eps=1e-5)
    report = run(src, tmp_path / "out", rank=16, rope_dim=16)
    assert report.latent_norm.max_bound <= DEFAULT_DELTA * (1 + 1e-9)
    source = load_causal_lm(src)
    converted = load_causal_lm(tmp_path / "out")
    ratios = []
    for layer in converted.model.layers:
        rank = converted.config.kv_lora_rank
        layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(
            lambda module, args, out: ratios.append((out[..., :rank].double().pow(2).mean(-1) / LATENT_NORM_EPS).max().item()))
    embeds = source.model.embed_tokens(TOKENS).detach() * 1e4
    embeds[:, 5] *= 1e3  # one token far beyond anything in training
    with torch.no_grad():
        expected = source(inputs_embeds=embeds).logits.double()
        got = converted(inputs_embeds=embeds * report.residual_scale).logits.double()
    assert max(ratios) <= DEFAULT_DELTA
    assert rel_err(got, expected) <= 1e-4


def test_llama3_rope_scaling_is_exact_for_transformers_and_reported(tiny_model, tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    src = tiny_model(kv_heads=1, head_dim=16, rope_scaling=scaling, rope_theta=500000.0)
    report = run(src, tmp_path / "out", rank=16, rope_dim=16, target="transformers")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert any("deepseek_yarn" in w for w in report.serving.warnings)
    long_tokens = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(2))
    assert rel_err(logits(tmp_path / "out", long_tokens), logits(src, long_tokens)) <= 1e-4


def offline_hub_cache(folder: Path, tmp_path: Path, monkeypatch, repo: str = "acme/tiny") -> Path:
    """Put ``folder`` into a fresh Hugging Face cache as ``repo``'s main snapshot; switch the hub off."""
    import shutil

    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / ("0" * 40)
    shutil.copytree(folder, snapshot)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0" * 40)
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_hub_id_resolves_from_the_local_cache_offline(tiny_model, tmp_path, monkeypatch):
    """A hub id found in the Hugging Face cache converts with the hub switched off."""
    src = tiny_model(kv_heads=1, head_dim=16)
    offline_hub_cache(src, tmp_path, monkeypatch)
    report = run("acme/tiny", tmp_path / "out", rank=16, rope_dim=16)
    assert report.source_id == "acme/tiny" and report.source_revision == "0" * 40
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


def test_partly_cached_hub_id_is_named_offline(tiny_model, tmp_path, monkeypatch):
    """A snapshot that holds the config but not every shard its index names is reported as partial."""
    src = tiny_model(kv_heads=1, head_dim=16)
    snapshot = offline_hub_cache(src, tmp_path, monkeypatch)
    weights = snapshot / "model.safetensors"
    weights.rename(snapshot / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MlaconvError, match="only partly in the local Hugging Face cache"):
        run("acme/tiny", tmp_path / "out", rank=16, rope_dim=16)
    assert not (tmp_path / "out").exists()


def test_a_cached_snapshot_is_judged_by_the_weights_the_reader_uses(tiny_model, tmp_path, monkeypatch):
    """A complete model.safetensors with a stray .bin index (its shards never downloaded) is complete."""
    src = tiny_model(kv_heads=1, head_dim=16)
    snapshot = offline_hub_cache(src, tmp_path, monkeypatch)
    index = {"weight_map": {"model.embed_tokens.weight": "pytorch_model-00001-of-00002.bin"}}
    (snapshot / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    run("acme/tiny", tmp_path / "out", rank=16, rope_dim=16)
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


def test_small_shards_are_indexed_and_load(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16)
    run(src, tmp_path / "out", rank=24, shard_size=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((tmp_path / "out" / name).is_file() for name in shards)
    assert shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert logits(tmp_path / "out", TOKENS).isfinite().all()


@pytest.mark.parametrize("family, kv_heads", [("llama", 4), ("qwen2", 2)])
def test_a_lossy_float32_factorization_matches_the_float64_one(family, kv_heads, tiny_model, tmp_path, monkeypatch):
    """MHA (more latent rows than inputs) and Qwen2's biases, cut to rank 24: the float32 factorization a 16-bit
    output gets, forced here on float32 outputs, computes what the float64 one does."""
    from mlaconv.conversion import weights_only

    src = tiny_model(family=family, kv_heads=kv_heads, head_dim=16)
    run(src, tmp_path / "f64", rank=24, rope_dim=8)
    monkeypatch.setattr(weights_only, "factor_precision", lambda dtype: torch.float32)
    run(src, tmp_path / "f32", rank=24, rope_dim=8)
    exact = logits(tmp_path / "f64", TOKENS)
    assert rel_err(exact, logits(src, TOKENS)) > 1e-2  # lossy: the comparison below is not between two exact models
    assert rel_err(logits(tmp_path / "f32", TOKENS), exact) <= 1e-4


def test_a_plain_conversion_calibrates_on_the_bundled_text(tiny_model, tmp_path):
    """No --calib and no --weights-only: a source with a tokenizer is calibrated on the shipped general text (and
    says so); without a tokenizer it is converted from its weights, and the report says why."""
    from helpers import ROOT
    from mlaconv.conversion.plan import GENERAL_TEXT

    options = dict(kv_keep=0.5, calib_tokens=2048, calib_window=128, refine_steps=0, heal_tokens=0, verify=False)
    report = convert(str(ROOT / "examples" / "llama-docs"), tmp_path / "out", ConvertOptions(**options))
    assert report.mode == "calibrated" and "bundled general text" in report.calibration_data
    assert report.calibration.windows == 16 and report.settings["calib"] == []
    assert GENERAL_TEXT.is_file() and GENERAL_TEXT.stat().st_size > 400_000
    bare = convert(str(tiny_model(kv_heads=2, head_dim=16)), tmp_path / "bare", ConvertOptions(**options))
    assert bare.mode == "weights-only" and bare.calibration_data.startswith("none: the source has no tokenizer")
