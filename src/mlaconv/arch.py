"""Source architectures as data: one table of families, their tensor names and their quirks.

A supported family is an entry in ``FAMILIES``; adding one that shares Llama's layout is a few lines.
``SourceSpec.from_config`` turns a ``config.json`` into the normalised shapes the converter needs,
and refuses, in one line, anything whose attention the DeepSeek-V3 layout cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mlaconv.errors import MlaconvError

BiasRule = Literal["never", "always", "config"]


@dataclass(frozen=True)
class TensorNames:
    """Tensor names of a Llama-style checkpoint; ``{i}`` is the layer index."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{i}."
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    input_norm: str = "input_layernorm.weight"
    post_attention_norm: str = "post_attention_layernorm.weight"

    def in_layer(self, i: int, name: str) -> str:
        return self.layer.format(i=i) + name


@dataclass(frozen=True)
class Family:
    """One source family: how to recognise it, where its biases are, which config keys it may set."""

    label: str
    model_types: tuple[str, ...]
    qkv_bias: BiasRule = "never"
    o_bias: BiasRule = "never"
    names: TensorNames = field(default_factory=TensorNames)
    sliding_window_flag: str | None = None  # config key that switches sliding windows on (None: window alone)


FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama",), qkv_bias="config", o_bias="config"),
    Family("Mistral", ("mistral",)),
    Family("Qwen2", ("qwen2",), qkv_bias="always", sliding_window_flag="use_sliding_window"),
)

# Families we recognise and refuse, with the reason the DeepSeek-V3 layout cannot hold them.
REFUSED: dict[str, str] = {
    "qwen3": "its per-head q/k RMSNorm (q_norm, k_norm) does not commute with mixing heads for the shared RoPE key",
    "qwen3_moe": "its per-head q/k RMSNorm does not commute with mixing heads, and MoE sources are not handled",
    "gemma": "Gemma scales embeddings and uses (1 + w) norms and GeGLU, which DeepSeek-V3 cannot express",
    "gemma2": "Gemma-2 uses logit soft-capping, sliding-window layers and (1 + w) norms",
    "gemma3": "Gemma-3 uses per-head q/k norms and sliding-window layers",
    "gpt2": "GPT-2 uses learned absolute positions, LayerNorm and a fused c_attn projection",
    "phi3": "Phi-3 uses fused qkv/gate_up projections and longrope scaling",
    "mixtral": "mixture-of-experts sources are not handled",
    "deepseek_v2": "it already is an MLA model",
    "deepseek_v3": "it already is an MLA model",
}

SUPPORTED_TEXT = "supported: Llama (1/2/3.x), Mistral, Qwen2/2.5 (MHA, GQA or MQA)"
_EXACT_ROPE_TYPES = {"default", "linear", "llama3"}


def family_for(model_type: str) -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type in REFUSED:
        raise MlaconvError(f"cannot convert model_type {model_type!r}: {REFUSED[model_type]}; {SUPPORTED_TEXT}")
    raise MlaconvError(f"unsupported architecture {model_type!r}; {SUPPORTED_TEXT}")


@dataclass(frozen=True)
class SourceSpec:
    """The normalised shape of a source model (notation: H hidden, N heads, n_kv KV heads, d head dim)."""

    family: Family
    config: dict
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    dtype: torch.dtype

    @property
    def names(self) -> TensorNames:
        return self.family.names

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config: dict, allow_sliding_window: bool = False) -> "SourceSpec":
        """Validate ``config.json`` and normalise it; raise ``MlaconvError`` for what cannot be converted."""
        if config.get("auto_map"):
            raise MlaconvError("the config declares custom code (auto_map); mlaconv never runs remote code")
        model_type = config.get("model_type")
        if not model_type:
            raise MlaconvError("config.json has no model_type; is this a Hugging Face causal LM?")
        family = family_for(model_type)

        def number(key: str, default=None, kind: type = int):
            """config[key] as a positive ``kind``; a one-line error if it is missing (without default) or malformed."""
            value = config.get(key)
            if value is None:
                if default is None:
                    raise MlaconvError(f"config.json lacks {key!r}")
                return default
            try:
                converted = kind(value)
            except (TypeError, ValueError):
                converted = None
            if isinstance(value, bool) or converted is None or converted != value or converted <= 0:
                raise MlaconvError(f"config.json: {key} = {value!r} is not a positive {kind.__name__}")
            return converted

        hidden = number("hidden_size")
        heads = number("num_attention_heads")
        kv_heads = number("num_key_value_heads", heads)
        head_dim = number("head_dim", hidden // heads)
        if heads % kv_heads:
            raise MlaconvError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise MlaconvError(f"head_dim {head_dim} is odd; RoPE needs pairs")
        if config.get("hidden_act", "silu") != "silu":
            raise MlaconvError(f"hidden_act {config['hidden_act']!r}: the DeepSeek-V3 MLP is SwiGLU (silu) only")
        if config.get("mlp_bias"):
            raise MlaconvError("mlp_bias is set: the DeepSeek-V3 MLP has no biases")
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise MlaconvError("partial_rotary_factor != 1 (partial-rotary sources) is not supported")
        _check_sliding_window(family, config, allow_sliding_window)
        rope_theta, rope_scaling = rope_settings(config)
        qkv_bias = _bias(family.qkv_bias, config)
        o_bias = _bias(family.o_bias, config)
        return cls(
            family=family,
            config=config,
            hidden_size=hidden,
            num_layers=number("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=number("intermediate_size"),
            vocab_size=number("vocab_size"),
            rms_norm_eps=number("rms_norm_eps", 1e-6, float),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=number("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            dtype=_dtype(config),
        )

    def check_tensors(self, reader) -> None:
        """Check that every tensor the config implies exists with the right shape (headers only)."""
        n = self.names
        H, N, K, d, F, V = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                            self.intermediate_size, self.vocab_size)
        expected = {n.embed: (V, H), n.final_norm: (H,)}
        if not self.tie_word_embeddings or n.lm_head in reader:
            expected[n.lm_head] = (V, H)
        for i in range(self.num_layers):
            layer = {
                n.q + ".weight": (N * d, H), n.k + ".weight": (K * d, H), n.v + ".weight": (K * d, H),
                n.o + ".weight": (H, N * d), n.gate + ".weight": (F, H), n.up + ".weight": (F, H),
                n.down + ".weight": (H, F), n.input_norm: (H,), n.post_attention_norm: (H,),
            }
            if self.qkv_bias:
                layer.update({n.q + ".bias": (N * d,), n.k + ".bias": (K * d,), n.v + ".bias": (K * d,)})
            if self.o_bias:
                layer[n.o + ".bias"] = (H,)
            expected.update({n.in_layer(i, key): shape for key, shape in layer.items()})
        for name, shape in expected.items():
            if name not in reader:
                raise MlaconvError(f"config and weights disagree: tensor {name} is missing")
            if tuple(reader.shape(name)) != shape:
                raise MlaconvError(
                    f"config and weights disagree: {name} has shape {list(reader.shape(name))}, expected {list(shape)}"
                )


def _bias(rule: BiasRule, config: dict) -> bool:
    return rule == "always" or (rule == "config" and bool(config.get("attention_bias", False)))


def _check_sliding_window(family: Family, config: dict, allow: bool) -> None:
    window = config.get("sliding_window")
    if window is None:
        return
    if family.sliding_window_flag is not None and not config.get(family.sliding_window_flag, False):
        return
    if int(window) >= int(config.get("max_position_embeddings", 0) or 0):
        return
    if not allow:
        raise MlaconvError(
            f"this {family.label} model uses sliding-window attention (window {window}), which DeepSeek-V3 cannot "
            f"express; pass --allow-sliding-window to convert it with full attention (identical up to {window} tokens)"
        )


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the 4.x keys or the 5.x ``rope_parameters``; rope_scaling is
    None for plain RoPE, and only the types whose frequencies are fixed per pair are accepted."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta")
        theta = 10000.0 if theta is None else theta
        scaling = config.get("rope_scaling") or None
        if scaling is not None and not isinstance(scaling, dict):
            raise MlaconvError(f"config.json: rope_scaling = {scaling!r} is not a mapping")
        scaling = dict(scaling) if scaling else None
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise MlaconvError(f"config.json: rope_theta = {theta!r} is not a positive number")
    theta = float(theta)
    if scaling is not None:
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "default":
            scaling = None
        elif rope_type not in _EXACT_ROPE_TYPES:
            raise MlaconvError(
                f"rope_scaling type {rope_type!r} is not supported (its frequencies depend on the head size); "
                "supported: none, linear, llama3"
            )
    return theta, scaling


def _dtype(config: dict) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
    return table.get(str(name).replace("torch.", ""), torch.float32)
