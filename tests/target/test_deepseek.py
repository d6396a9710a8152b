"""deepseek.py: the config and the layer tensors it writes are the ones transformers' own DeepSeek-V3 builds, with the
shapes worked out by hand, and a written layer reads back unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mlaconv.io import CheckpointReader
from mlaconv.mla.layer import MLAAttention, MLAShape
from mlaconv.source import names
from mlaconv.source.spec import SourceSpec
from mlaconv.target import deepseek

# H = 64, N = 4, d = 16, L = 2 converted at r = 24, R = 8
SOURCE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512,
          "bos_token_id": 1, "eos_token_id": 2}
H, N, d, r, R = 64, 4, 16, 24, 8
SHAPES = {names.INPUT_NORM: (H,), deepseek.Q_PROJ: (N * (d + R), H), deepseek.KV_A_PROJ: (r + R, H),
          deepseek.KV_A_NORM: (r,), deepseek.KV_B_PROJ: (N * 2 * d, r), deepseek.O_PROJ: (H, N * d),
          deepseek.KV_A_BIAS: (r + R,), deepseek.O_BIAS: (H,)}


def config(attention_bias: bool = True) -> dict:
    return deepseek.build_config(SourceSpec.from_config(SOURCE), rank=r, rope_dim=R, rope_theta=100.0,
                                 rope_scaling=None, attention_bias=attention_bias, dtype_name="bfloat16")


def layer(gen: torch.Generator, biases: bool) -> MLAAttention:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return MLAAttention(q_proj=randn(N * (d + R), H), kv_a_proj=randn(r + R, H), kv_a_norm=randn(r),
                        kv_b_proj=randn(N * 2 * d, r), o_proj=randn(H, N * d), input_norm=randn(H),
                        kv_a_bias=randn(r + R) if biases else None, o_bias=randn(H) if biases else None)


def test_the_config_is_a_dense_deepseek_v3_with_full_rank_queries():
    written = config()
    assert {key: written[key] for key in ("num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                          "qk_nope_head_dim", "v_head_dim", "first_k_dense_replace", "rms_norm_eps",
                                          "rope_theta", "rope_interleave", "tie_word_embeddings", "torch_dtype")} == {
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 24, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "first_k_dense_replace": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 100.0, "rope_interleave": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, 2, None)


def test_transformers_builds_exactly_the_tensors_attention_tensors_writes(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(config()))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    prefix = names.layer_prefix(1)
    built = {name[len(prefix):]: tuple(p.shape) for name, p in model.state_dict().items()
             if name.startswith(prefix) and ("self_attn." in name or name.endswith(names.INPUT_NORM))}
    assert built == SHAPES
    written = deepseek.attention_tensors(layer(torch.Generator().manual_seed(0), biases=True), biases=True)
    assert {name: tuple(t.shape) for name, t in written.items()} == SHAPES
    for name in (names.EMBED, names.FINAL_NORM, names.LM_HEAD, prefix + names.GATE,
                 prefix + names.UP, prefix + names.DOWN, prefix + names.POST_ATTENTION_NORM):
        assert name in model.state_dict()


def test_the_bias_tensors_are_zeros_where_the_layer_has_none():
    plain = layer(torch.Generator().manual_seed(1), biases=False)
    assert set(deepseek.attention_tensors(plain, biases=False)) == set(SHAPES) - {deepseek.KV_A_BIAS, deepseek.O_BIAS}
    written = deepseek.attention_tensors(plain, biases=True)
    assert torch.equal(written[deepseek.KV_A_BIAS], torch.zeros(r + R)) and torch.equal(written[deepseek.O_BIAS],
                                                                                         torch.zeros(H))


@pytest.mark.parametrize("biases", [True, False])
def test_a_written_layer_reads_back_unchanged(tmp_path, biases):
    original = layer(torch.Generator().manual_seed(2), biases)
    prefix = names.layer_prefix(3)
    tensors = {prefix + name: t for name, t in deepseek.attention_tensors(original, biases=biases).items()}
    save_file(tensors, tmp_path / "model.safetensors")
    read = deepseek.read_attention(CheckpointReader(tmp_path), 3)
    for name, value in vars(original).items():
        assert (getattr(read, name) is None) if value is None else torch.equal(getattr(read, name), value), name


def test_the_mla_shape_of_a_config_by_hand():
    shape = MLAShape.from_config(config())
    assert vars(shape) == {"hidden": 64, "heads": 4, "rank": 24, "rope_dim": 8, "nope_dim": 16, "v_dim": 16}
    assert shape.cache_elements == 32  # r + R
    assert shape.softmax_scale == pytest.approx(24 ** -0.5)  # (P + R)^-½
