"""The target format: a dense DeepSeek-V3 checkpoint that stock transformers, vLLM and SGLang load.

The attention tensor names (the others are Llama's, ``source.names``), the config, one layer's attention tensor set
(``attention_tensors``, ``read_attention``) and the one loop over a converted checkpoint's layers
(``checkpoint_layers``) live here; the numbers come from ``mlaconv.mla``. The config is written
with the transformers 4.x rope keys (``rope_theta``/``rope_scaling``), which 5.x also reads, so one
file loads in every version from 4.53 on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from mlaconv.io import CheckpointReader
from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.mla.layer import MLAAttention
from mlaconv.source.names import INPUT_NORM, layer_prefix
from mlaconv.source.spec import SourceSpec

ATTENTION = "self_attn."
Q_PROJ = ATTENTION + "q_proj.weight"
KV_A_PROJ = ATTENTION + "kv_a_proj_with_mqa.weight"
KV_A_BIAS = ATTENTION + "kv_a_proj_with_mqa.bias"
KV_A_NORM = ATTENTION + "kv_a_layernorm.weight"
KV_B_PROJ = ATTENTION + "kv_b_proj.weight"
O_PROJ = ATTENTION + "o_proj.weight"
O_BIAS = ATTENTION + "o_proj.bias"

N_ROUTED_EXPERTS = 8  # unused (every layer dense) but must be an int; 256 would trigger SGLang's MoE heuristics


def build_config(spec: SourceSpec, *, rank: int, rope_dim: int, rope_theta: float, rope_scaling: dict | None,
                 attention_bias: bool, dtype_name: str) -> dict:
    """config.json of the converted model (dense DeepSeek-V3, full-rank q, interleaved RoPE); ``rope_scaling``
    is the source's as the kept frequencies need it (``rope.target_rope_scaling``)."""
    src = spec.config
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "q_lora_rank": None,
        "kv_lora_rank": rank,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": spec.head_dim,
        "v_head_dim": spec.head_dim,
        "first_k_dense_replace": spec.num_layers,
        "moe_layer_freq": 1,
        "n_routed_experts": N_ROUTED_EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": LATENT_NORM_EPS,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "initializer_range": src.get("initializer_range", 0.02),
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
        "pad_token_id": src.get("pad_token_id"),
        "torch_dtype": dtype_name,
    }
    return config



def attention_tensors(mla: MLAAttention, biases: bool) -> dict[str, torch.Tensor]:
    """One layer's attention and its input norm as checkpoint tensors (names without the layer prefix). With
    ``biases`` (the config's attention_bias) both bias tensors go in, zeros where the layer has none."""
    tensors = {INPUT_NORM: mla.input_norm, Q_PROJ: mla.q_proj, KV_A_PROJ: mla.kv_a_proj, KV_A_NORM: mla.kv_a_norm,
               KV_B_PROJ: mla.kv_b_proj, O_PROJ: mla.o_proj}
    if biases:
        tensors[KV_A_BIAS] = mla.kv_a_bias if mla.kv_a_bias is not None else torch.zeros(mla.kv_a_proj.shape[0])
        tensors[O_BIAS] = mla.o_bias if mla.o_bias is not None else torch.zeros(mla.o_proj.shape[0])
    return tensors


def read_attention(reader: CheckpointReader, i: int) -> MLAAttention:
    """Layer ``i``'s attention tensors and input norm, as stored in a DeepSeek-V3 checkpoint."""
    p = layer_prefix(i)

    def optional(name: str) -> torch.Tensor | None:
        return reader.get(p + name) if p + name in reader else None

    return MLAAttention(q_proj=reader.get(p + Q_PROJ), kv_a_proj=reader.get(p + KV_A_PROJ),
                        kv_a_norm=reader.get(p + KV_A_NORM), kv_b_proj=reader.get(p + KV_B_PROJ),
                        o_proj=reader.get(p + O_PROJ), input_norm=reader.get(p + INPUT_NORM),
                        kv_a_bias=optional(KV_A_BIAS), o_bias=optional(O_BIAS))


@dataclass(frozen=True)
class CheckpointLayer:
    """Layer ``index`` of a converted DeepSeek-V3 checkpoint."""

    index: int
    reader: CheckpointReader

    @property
    def prefix(self) -> str:
        """The layer's tensor names start with this."""
        return layer_prefix(self.index)

    def read_attention(self) -> MLAAttention:
        return read_attention(self.reader, self.index)


def checkpoint_layers(reader: CheckpointReader, num_layers: int) -> Iterator[CheckpointLayer]:
    """Every layer of a converted checkpoint in order: the loop everything that reads one back (``absorb``, the GGUF
    export, the latent-cache runtime, heal) iterates."""
    for i in range(num_layers):
        yield CheckpointLayer(i, reader)
