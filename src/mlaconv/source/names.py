"""Canonical tensor names: Llama's, which are also DeepSeek-V3's for the embedding, the head, the norms and the MLP.

A family's checkpoint is read in these names (``families``: a family that stores a tensor another way says where it
lies); the output is written in them, with the DeepSeek-V3 attention names of ``target.deepseek``.
"""

from __future__ import annotations

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
Q, K, V, O = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
GATE, UP, DOWN = "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"
INPUT_NORM = "input_layernorm.weight"
Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
POST_ATTENTION_NORM = "post_attention_layernorm.weight"
W, B = ".weight", ".bias"


def layer_prefix(i: int) -> str:
    """Layer ``i``'s tensor names start with this."""
    return f"model.layers.{i}."


def layer_name(i: int, key: str) -> str:
    return layer_prefix(i) + key
