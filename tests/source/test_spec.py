"""arch.py directly: SourceSpec.from_config on real and hand-made config.json dicts, family_for's refusals, and
rope_settings, checked against hand-derived values and transformers' own config classes and RoPE functions."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, SmolLM3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from helpers import CONFIGS, refusal
from mlaconv.errors import MlaconvError
from mlaconv.source.families import FAMILIES, REFUSED, SUPPORTED_TEXT, family_for
from mlaconv.source.spec import SourceSpec, rope_settings

BASE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "intermediate_size": 128, "vocab_size": 96}


def real(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))


def hf_config(cls, config: dict):
    """transformers' config class built from a copy (transformers 5 completes the rope dict it is given in place)."""
    return cls(**copy.deepcopy(config))


def spec(**change) -> SourceSpec:
    return SourceSpec.from_config({**BASE, **change})


# --- real configs: shapes anyone can check on the model card ---------------------------------------------------------

# name → (family, head_dim, rotary_dim, n_kv, KV elements per token and layer = 2·n_kv·d, qkv_bias, tied, dtype)
REAL = {
    "llama-2-7b": ("Llama", 128, 128, 32, 8192, False, False, torch.float16),
    "llama-3.1-8b": ("Llama", 128, 128, 8, 2048, False, False, torch.bfloat16),
    "llama-3.2-1b": ("Llama", 64, 64, 8, 1024, False, True, torch.bfloat16),
    "mistral-7b-v0.3": ("Mistral", 128, 128, 8, 2048, False, False, torch.bfloat16),
    "qwen2.5-0.5b": ("Qwen2", 64, 64, 2, 256, True, True, torch.bfloat16),  # 896 / 14 heads
    "qwen3-0.6b": ("Qwen3", 128, 128, 8, 2048, False, True, torch.bfloat16),  # head_dim 128 ≠ 1024 / 16
    "phi-3.5-mini": ("Phi-3", 96, 96, 32, 6144, False, False, torch.bfloat16),  # 3072 / 32
    "phi-4-mini": ("Phi-3", 128, 96, 8, 2048, False, True, torch.bfloat16),  # 3/4 of 128 rotate
    "granite-3.3-2b": ("Granite", 64, 64, 8, 1024, False, True, torch.bfloat16),
    "smollm3-3b": ("SmolLM3", 128, 128, 4, 1024, False, True, torch.bfloat16),
}


@pytest.mark.parametrize("name", REAL)
def test_real_configs_normalise_to_their_published_shapes(name):
    label, head_dim, rotary_dim, kv_heads, kv_elements, qkv_bias, tied, dtype = REAL[name]
    config = real(name)
    s = SourceSpec.from_config(config)
    assert s.family.label == label
    assert (s.head_dim, s.rotary_dim, s.num_kv_heads) == (head_dim, rotary_dim, kv_heads)
    assert s.attention_shape.cache_elements == kv_elements
    assert (s.qkv_bias, s.o_bias, s.tie_word_embeddings, s.dtype) == (qkv_bias, False, tied, dtype)
    assert (s.hidden_size, s.num_layers, s.num_heads) == (config["hidden_size"], config["num_hidden_layers"],
                                                          config["num_attention_heads"])
    assert (s.intermediate_size, s.vocab_size, s.rms_norm_eps) == (config["intermediate_size"], config["vocab_size"],
                                                                   config["rms_norm_eps"])
    assert len(s.rope_layers) == s.num_layers
    assert s.config is config


def test_llama_3_1_rope():
    s = SourceSpec.from_config(real("llama-3.1-8b"))
    assert s.rope_theta == 500000.0 and s.rope_attention_factor == 1.0
    assert s.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert all(s.rope_layers)


def test_llama_2_has_plain_rope_at_the_default_base():
    s = SourceSpec.from_config(real("llama-2-7b"))
    assert (s.rope_theta, s.rope_scaling, s.max_position_embeddings) == (10000.0, None, 4096)


def test_phi4_mini_longrope_is_completed_as_transformers_completes_it():
    """f = 131072 / 4096 = 32, attention factor √(1 + ln 32 / ln 4096) = √(1 + 5/12)."""
    config = real("phi-4-mini")
    s = SourceSpec.from_config(config)
    scaling = s.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096
    assert scaling["factor"] == 32.0
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == 48 == s.rotary_dim // 2
    assert s.rope_attention_factor == pytest.approx(math.sqrt(17 / 12), rel=1e-12)
    _, attention = ROPE_INIT_FUNCTIONS["longrope"](hf_config(Phi3Config, config), "cpu", seq_len=1)
    assert s.rope_attention_factor == pytest.approx(attention, rel=1e-12)


@pytest.mark.parametrize("length", [100, 4096, 4097, 50000])
def test_phi4_mini_frequencies_match_transformers(length):
    config = real("phi-4-mini")
    s = SourceSpec.from_config(config)
    reference, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config(Phi3Config, config), "cpu", seq_len=length)
    assert reference.shape == (48,)
    torch.testing.assert_close(s.rope_frequencies(length), reference.double(), rtol=1e-5, atol=0)


def test_llama_3_1_frequencies_match_transformers():
    config = real("llama-3.1-8b")
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config(LlamaConfig, config), "cpu")
    torch.testing.assert_close(SourceSpec.from_config(config).rope_frequencies(), reference.double(), rtol=1e-5, atol=0)


def test_smollm3_skips_rope_in_every_fourth_layer():
    s = SourceSpec.from_config(real("smollm3-3b"))
    assert s.rope_layers == tuple(i % 4 != 3 for i in range(36))
    assert s.rope_layers.count(False) == 9


@pytest.mark.parametrize("layers, interval", [(6, 3), (4, 2), (5, 4), (3, 1)])
def test_smollm3_default_no_rope_layers_match_transformers(layers, interval):
    """Without a no_rope_layers list, the interval decides, as transformers' SmolLM3Config fills it in."""
    s = spec(model_type="smollm3", num_hidden_layers=layers, no_rope_layer_interval=interval)
    expected = SmolLM3Config(num_hidden_layers=layers, no_rope_layer_interval=interval).no_rope_layers
    assert s.rope_layers == tuple(bool(flag) for flag in expected)
    assert s.rope_layers.count(False) == layers // interval


def test_smollm3_explicit_no_rope_layers():
    assert spec(model_type="smollm3", no_rope_layers=[0, 1, 0]).rope_layers == (False, True, False)


def test_granite_reads_its_multipliers_and_refuses_bad_ones():
    s = spec(model_type="granite", embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
             logits_scaling=8.0, attention_bias=True)
    assert s.family.label == "Granite" and s.qkv_bias and s.o_bias
    assert "logits_scaling = -1.0 is not a positive number" in refusal({**BASE, "model_type": "granite",
                                                                        "logits_scaling": -1.0})


# --- hand-made configs ------------------------------------------------------------------------------------------------

def test_defaults_of_a_minimal_config():
    s = spec()
    assert (s.head_dim, s.rotary_dim, s.num_kv_heads) == (16, 16, 2)  # 64 / 4 heads
    assert s.attention_shape.cache_elements == 2 * 2 * 16
    assert (s.rms_norm_eps, s.rope_theta, s.rope_scaling, s.max_position_embeddings) == (1e-6, 10000.0, None, 2048)
    assert (s.dtype, s.tie_word_embeddings, s.qkv_bias, s.o_bias) == (torch.float32, False, False, False)
    assert s.rope_layers == (True, True, True)


def test_explicit_head_dim_and_mha_default():
    s = spec(head_dim=24, num_key_value_heads=None)  # no KV head count: MHA
    assert (s.head_dim, s.num_kv_heads) == (24, 4)
    assert s.attention_shape.cache_elements == 2 * 4 * 24


@pytest.mark.parametrize("model_type, attention_bias, expected", [
    ("llama", True, (True, True)),  # attention_bias switches all four projections' biases
    ("llama", False, (False, False)),
    ("qwen2", None, (True, False)),  # Qwen2: q/k/v always biased, o never
    ("qwen2", False, (True, False)),
    ("mistral", True, (False, False)),  # transformers' Mistral has no attention biases at all
    ("qwen3", True, (True, True)),
])
def test_biases(model_type, attention_bias, expected):
    change = {"model_type": model_type} | ({} if attention_bias is None else {"attention_bias": attention_bias})
    s = spec(**change)
    assert (s.qkv_bias, s.o_bias) == expected


@pytest.mark.parametrize("change, dtype", [
    ({"torch_dtype": "float16"}, torch.float16),
    ({"dtype": "bfloat16"}, torch.bfloat16),  # transformers 5 writes "dtype"
    ({"torch_dtype": "torch.float64"}, torch.float64),
    ({"torch_dtype": "bfloat16", "dtype": "float16"}, torch.bfloat16),
    ({}, torch.float32),
])
def test_dtype(change, dtype):
    assert spec(**change).dtype == dtype


@pytest.mark.parametrize("name", ["float8_e4m3fn", "int8", "auto"])
def test_a_dtype_mlaconv_does_not_read_is_refused(name):
    assert f"dtype {name!r} is not one mlaconv reads" in refusal({**BASE, "torch_dtype": name})


@pytest.mark.parametrize("factor, rotary", [(0.5, 8), (0.75, 12), (1.0, 16), (0.25, 4)])
def test_phi3_partial_rotary(factor, rotary):
    assert spec(model_type="phi3", partial_rotary_factor=factor).rotary_dim == rotary


def test_partial_rotary_in_transformers_5_rope_parameters():
    s = spec(model_type="phi3", rope_parameters={"rope_theta": 5e5, "rope_type": "default", "partial_rotary_factor": 0.5})
    assert (s.rotary_dim, s.rope_theta, s.rope_scaling) == (8, 5e5, None)


@pytest.mark.parametrize("change, reason", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is set, but transformers' Llama rotates the whole head"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.3125}, "rotates 5 of 16 head dims"),
    ({"model_type": "phi3", "partial_rotary_factor": 1.5}, "partial_rotary_factor = 1.5 is not in (0, 1]"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"head_dim": 7}, "head_dim 7 is odd"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu': the DeepSeek-V3 MLP is SwiGLU (silu) only"),
    ({"mlp_bias": True}, "mlp_bias is set"),
    ({"hidden_size": True}, "hidden_size = True is not a positive int"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers = 2.5 is not a positive int"),
    ({"vocab_size": -3}, "vocab_size = -3 is not a positive int"),
    ({"intermediate_size": None}, "config.json lacks 'intermediate_size'"),
    ({"model_type": None}, "config.json has no model_type"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "declares custom code (auto_map)"),
    ({"sliding_window": 64, "max_position_embeddings": 256}, "sliding-window attention (window 64)"),
    ({"sliding_window": "4k", "max_position_embeddings": 256}, "sliding_window = '4k' is not a positive integer"),
    ({"sliding_window": 0, "max_position_embeddings": 256}, "sliding_window = 0 is not a positive integer"),
])
def test_config_refusals_are_one_line_with_the_reason(change, reason):
    assert reason in refusal({**BASE, **change})


def test_sliding_window_settings_that_do_not_slide():
    assert spec(sliding_window=4096, max_position_embeddings=4096).head_dim == 16  # the window covers everything
    assert spec(model_type="qwen2", sliding_window=64, max_position_embeddings=256).qkv_bias  # use_sliding_window off
    assert SourceSpec.from_config({**BASE, "sliding_window": 64, "max_position_embeddings": 256},
                                  allow_sliding_window=True).num_layers == 3
    assert "window 64" in refusal({**BASE, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                                   "max_position_embeddings": 256})


def test_phi3_auto_map_to_its_upstreamed_classes_is_accepted():
    auto_map = {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    assert spec(model_type="phi3", auto_map=auto_map).family.label == "Phi-3"
    assert "auto_map" in refusal({**BASE, "auto_map": auto_map})  # Llama has no such upstreamed code


# --- family_for -------------------------------------------------------------------------------------------------------

def test_every_supported_model_type_maps_to_its_family():
    assert {t for f in FAMILIES for t in f.model_types} == {"llama", "mistral", "ministral", "qwen2", "phi3", "granite",
                                                           "smollm3", "qwen3"}
    for family in FAMILIES:
        for model_type in family.model_types:
            assert family_for(model_type) is family
    assert not {t for f in FAMILIES for t in f.model_types} & REFUSED.keys()


@pytest.mark.parametrize("model_type, reasons", [
    ("gemma2", ["Gemma-2 has", "soft-capping", "post-norms", "sliding-window layers", "GeGLU"]),
    ("olmo2", ["OLMo-2 has", "post-norms", "over all heads at once"]),
    ("gemma", ["would fold exactly into the weights", "GeGLU"]),
    ("mixtral", ["Mixtral has mixture-of-experts layers"]),
    ("qwen3_moe", ["mixture-of-experts", "alone would convert with calibration, as Qwen3's does"]),
    ("gpt2", ["learned absolute position embeddings", "LayerNorm"]),
    ("bloom", ["ALiBi"]),
    ("nemotron", ["LayerNorm1P", "ReLU²"]),
    ("deepseek_v3", ["already is an MLA model"]),
])
def test_refused_families_name_their_reason(model_type, reasons):
    with pytest.raises(MlaconvError) as caught:
        family_for(model_type)
    message = str(caught.value)
    assert message.startswith(f"cannot convert model_type '{model_type}': ")
    assert message.endswith(f"; {SUPPORTED_TEXT}")
    for reason in reasons:
        assert reason in message
    assert message == refusal({**BASE, "model_type": model_type})  # from_config says the same


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_every_refusal_is_one_line(model_type):
    with pytest.raises(MlaconvError) as caught:
        family_for(model_type)
    assert "\n" not in str(caught.value) and REFUSED[model_type] in str(caught.value)


def test_unknown_model_type():
    with pytest.raises(MlaconvError, match=r"^unsupported architecture 'gpt_bigcode'; supported: Llama"):
        family_for("gpt_bigcode")


# --- rope_settings ----------------------------------------------------------------------------------------------------

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
          "rope_type": "llama3"}


@pytest.mark.parametrize("config, expected", [
    ({}, (10000.0, None)),
    ({"rope_theta": 500000}, (500000.0, None)),
    ({"rope_theta": None}, (10000.0, None)),
    ({"rope_scaling": None}, (10000.0, None)),
    ({"rope_scaling": {"rope_type": "default"}}, (10000.0, None)),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, (10000.0, {"rope_type": "linear", "factor": 2.0})),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0, "partial_rotary_factor": 0.5}},
     (10000.0, {"rope_type": "linear", "factor": 4.0})),
    ({"rope_theta": 5e5, "rope_scaling": LLAMA3}, (5e5, LLAMA3)),
    ({"rope_parameters": {"rope_theta": 5e5, **LLAMA3}}, (5e5, LLAMA3)),  # transformers 5's layout
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, (1e6, None)),
    # the rotated share is not a scaling setting (it would make a DeepSeek target rotate part of its R dims)
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     (1e4, {"rope_type": "linear", "factor": 2.0})),
    # θ written inside a 4.x rope_scaling (as transformers 5 writes it) is θ, not a scaling setting: left in the
    # scaling dict it would be copied to the output config, where transformers 5 reads it over the output's θ
    ({"rope_scaling": {"rope_theta": 5e5, **LLAMA3}}, (5e5, LLAMA3)),
    ({"rope_theta": 1e6, "rope_scaling": {"rope_theta": 5e5, "rope_type": "default"}}, (1e6, None)),
])
def test_rope_settings(config, expected):
    theta, scaling = rope_settings(config)
    assert isinstance(theta, float)
    assert (theta, scaling) == expected


def test_rope_settings_read_what_transformers_5_writes():
    """LlamaConfig(**the 4.x json).to_dict() moves rope_theta/rope_scaling into rope_parameters: same settings."""
    config = real("llama-3.1-8b")
    rewritten = hf_config(LlamaConfig, config).to_dict()
    assert "rope_parameters" in rewritten
    assert rope_settings(rewritten) == rope_settings(config) == (500000.0, LLAMA3)


@pytest.mark.parametrize("name", ["phi-4-mini", "phi-3.5-mini"])
def test_longrope_settings_match_transformers_attention_factor(name):
    config = real(name)
    theta, scaling = rope_settings(config)
    _, attention = ROPE_INIT_FUNCTIONS["longrope"](hf_config(Phi3Config, config), "cpu", seq_len=1)
    assert scaling["attention_factor"] == pytest.approx(attention, rel=1e-12)
    assert scaling["factor"] == 131072 / 4096
    assert scaling["short_factor"] == [float(x) for x in config["rope_scaling"]["short_factor"]]
    # and the same from what transformers 5 writes for it
    assert rope_settings(hf_config(Phi3Config, config).to_dict()) == (theta, scaling)


def test_longrope_old_name_and_given_factors():
    scaling = {"type": "su", "short_factor": [1, 2], "long_factor": [3, 4], "factor": 2.0, "attention_factor": 1.5}
    theta, out = rope_settings({"rope_scaling": scaling, "original_max_position_embeddings": 100,
                                "max_position_embeddings": 1000})
    assert out == {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
                   "original_max_position_embeddings": 100, "factor": 2.0, "attention_factor": 1.5}
    _, derived = rope_settings({"rope_scaling": {**scaling, "attention_factor": None, "factor": None},
                                "original_max_position_embeddings": 100, "max_position_embeddings": 1000})
    assert derived["factor"] == 10.0  # 1000 / 100
    assert derived["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(10) / math.log(100)))  # √1.5
    _, unstretched = rope_settings({"rope_scaling": {**scaling, "attention_factor": None, "factor": None},
                                    "original_max_position_embeddings": 100, "max_position_embeddings": 100})
    assert unstretched["attention_factor"] == 1.0


@pytest.mark.parametrize("config, reason", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}}, "type 'yarn' is not supported"),
    ({"rope_scaling": [1, 2]}, "rope_scaling = [1, 2] is not a mapping"),
    ({"rope_theta": -1.0}, "rope_theta = -1.0 is not a positive number"),
    ({"rope_theta": True}, "rope_theta = True is not a positive number"),
    ({"rope_theta": "1e4"}, "rope_theta = '1e4' is not a positive number"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": 1.0, "long_factor": [1.0]},
      "original_max_position_embeddings": 16, "max_position_embeddings": 64}, "rope_scaling.short_factor must be a list"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [0.0]},
      "original_max_position_embeddings": 16, "max_position_embeddings": 64}, "rope_scaling.long_factor must be a list"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
      "max_position_embeddings": 64}, "longrope needs original_max_position_embeddings"),
])
def test_rope_settings_refusals(config, reason):
    with pytest.raises(MlaconvError) as caught:
        rope_settings(config)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_longrope_factor_count_must_match_the_rotary_pairs():
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    base = {**BASE, "model_type": "phi3", "original_max_position_embeddings": 16, "max_position_embeddings": 64}
    assert SourceSpec.from_config({**base, "rope_scaling": longrope}).rotary_dim == 16
    assert SourceSpec.from_config({**base, "rope_scaling": {k: v[:4] if isinstance(v, list) else v
                                                            for k, v in longrope.items()},
                                   "partial_rotary_factor": 0.5}).rotary_dim == 8
    assert "rope_scaling.short_factor has 8 entries, the rotary dims need 4" in refusal(
        {**base, "rope_scaling": longrope, "partial_rotary_factor": 0.5})
