"""A source model as data: ``SourceSpec.from_config`` turns a ``config.json`` into the normalised shapes the
converter needs, and refuses, in one line and with the reason, anything whose computation the DeepSeek-V3 layout
cannot hold (the family table and the refused families are in ``families``); ``load_source`` opens one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaconv.devices import DTYPES
from mlaconv.errors import MlaconvError
from mlaconv.io import CheckpointReader, read_config, resolve_source
from mlaconv.mla import rope
from mlaconv.mla.layer import AttentionShape
from mlaconv.source.families import BiasRule, Family, family_for
from mlaconv.source.names import EMBED, FINAL_NORM, LM_HEAD, layer_name

_EXACT_ROPE_TYPES = {"default", "linear", "llama3", "longrope"}
_CODE_KEYS = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")  # auto_map entries that would run model code


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
    rotary_dim: int  # d_rot: the head dims RoPE turns (the first ones; the rest pass unrotated)
    rope_layers: tuple[bool, ...]  # per layer: whether it applies RoPE at all
    rope_attention_factor: float = 1.0  # LongRoPE's scale on cos and sin (folded into the query)

    @property
    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim)

    def rope_frequencies(self, length: int | None = None) -> torch.Tensor:
        """ω of the rotating pairs [d_rot/2] in a rotated layer (LongRoPE: for sequences of ``length``)."""
        return rope.scaled_frequencies(self.rope_theta, self.rotary_dim, self.rope_scaling, length)

    @classmethod
    def from_config(cls, config: dict, allow_sliding_window: bool = False) -> "SourceSpec":
        """Validate ``config.json`` and normalise it; raise ``MlaconvError`` for what cannot be converted."""
        model_type = config.get("model_type")
        if not model_type:
            raise MlaconvError("config.json has no model_type; is this a Hugging Face causal LM?")
        family = family_for(model_type)
        _check_auto_map(family, config.get("auto_map"))
        family.check_config(config)

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
        layers = number("num_hidden_layers")
        if heads % kv_heads:
            raise MlaconvError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise MlaconvError(f"head_dim {head_dim} is odd; RoPE needs pairs")
        if config.get("hidden_act", "silu") != "silu":
            raise MlaconvError(f"hidden_act {config['hidden_act']!r}: the DeepSeek-V3 MLP is SwiGLU (silu) only")
        if config.get("mlp_bias"):
            raise MlaconvError("mlp_bias is set: the DeepSeek-V3 MLP has no biases")
        _check_sliding_window(family, config, allow_sliding_window)
        max_positions = number("max_position_embeddings", 2048)
        rope_theta, rope_scaling = rope_settings(config)
        rotary_dim = _rotary_dim(family, config, head_dim)
        if rope_scaling and rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(rope_scaling[key]) != rotary_dim // 2:
                    raise MlaconvError(f"rope_scaling.{key} has {len(rope_scaling[key])} entries, the rotary dims "
                                       f"need {rotary_dim // 2}")
        return cls(
            family=family,
            config=config,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=number("intermediate_size"),
            vocab_size=number("vocab_size"),
            rms_norm_eps=number("rms_norm_eps", 1e-6, float),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=_bias(family.qkv_bias, config),
            o_bias=_bias(family.o_bias, config),
            dtype=_dtype(config),
            rotary_dim=rotary_dim,
            rope_layers=family.rope_layers(config, layers),
            rope_attention_factor=rope_scaling.get("attention_factor", 1.0) if rope_scaling else 1.0,
        )

    def check_tensors(self, reader) -> None:
        """Check that every tensor the config implies exists with the right shape (headers only)."""
        expected = {EMBED: (self.vocab_size, self.hidden_size), FINAL_NORM: (self.hidden_size,)}
        if not self.tie_word_embeddings or LM_HEAD in reader:
            expected[LM_HEAD] = (self.vocab_size, self.hidden_size)
        layer = self.family.layer_shapes(self)
        for i in range(self.num_layers):
            expected.update({layer_name(i, key): shape for key, shape in layer.items()})
        for name, shape in expected.items():
            if name not in reader:
                raise MlaconvError(f"config and weights disagree: tensor {name} is missing")
            if tuple(reader.shape(name)) != shape:
                raise MlaconvError(
                    f"config and weights disagree: {name} has shape {list(reader.shape(name))}, expected {list(shape)}"
                )


def _check_auto_map(family: Family, auto_map) -> None:
    """Refuse custom code, unless every model/config class it names is one transformers ships for this family
    (Phi-3's published checkpoints point at the code that became transformers' own Phi3); none of it ever runs."""
    if not auto_map:
        return
    named = [auto_map.get(key) for key in _CODE_KEYS if auto_map.get(key)] if isinstance(auto_map, dict) else [auto_map]
    if not named or any(entry not in family.upstreamed_code for entry in named):
        raise MlaconvError("the config declares custom code (auto_map); mlaconv never runs remote code")


def _rotary_dim(family: Family, config: dict, head_dim: int) -> int:
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor is None or factor == 1.0:
        return head_dim
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise MlaconvError(f"config.json: partial_rotary_factor = {factor!r} is not in (0, 1]")
    if not family.partial_rotary:
        raise MlaconvError(f"partial_rotary_factor {factor} is set, but transformers' {family.label} rotates the "
                           "whole head (it does not read the setting)")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2 or (head_dim - rotary) % 2:
        raise MlaconvError(f"partial_rotary_factor {factor} rotates {rotary} of {head_dim} head dims; mlaconv needs "
                           "an even number of rotated and of unrotated dims")
    return rotary


def _bias(rule: BiasRule, config: dict) -> bool:
    return rule == "always" or (rule == "config" and bool(config.get("attention_bias", False)))


def _check_sliding_window(family: Family, config: dict, allow: bool) -> None:
    window = config.get("sliding_window")
    if window is None:
        return
    if family.sliding_window_flag is not None and not config.get(family.sliding_window_flag, False):
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise MlaconvError(f"config.json: sliding_window = {window!r} is not a positive integer")
    if window >= int(config.get("max_position_embeddings", 0) or 0):
        return
    if not allow:
        raise MlaconvError(
            f"this {family.label} model uses sliding-window attention (window {window}), which DeepSeek-V3 cannot "
            f"express; pass --allow-sliding-window to convert it with full attention (identical up to {window} tokens)"
        )


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the 4.x keys or the 5.x ``rope_parameters``; rope_scaling is
    None for plain RoPE, and only the types whose frequencies are fixed per pair are accepted. LongRoPE's
    settings are completed as transformers completes them (its original length, factor and attention factor)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        scaling = config.get("rope_scaling") or None
        if scaling is not None and not isinstance(scaling, dict):
            raise MlaconvError(f"config.json: rope_scaling = {scaling!r} is not a mapping")
        # transformers 5 also writes rope_theta inside rope_scaling; left there it would override the output's θ
        theta = config.get("rope_theta", (scaling or {}).get("rope_theta"))
        theta = 10000.0 if theta is None else theta
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")} if scaling else None
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise MlaconvError(f"config.json: rope_theta = {theta!r} is not a positive number")
    theta = float(theta)
    if scaling is not None:
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type") == "su":  # LongRoPE's first name
            scaling["rope_type"] = "longrope"
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "default":
            scaling = None
        elif rope_type not in _EXACT_ROPE_TYPES:
            raise MlaconvError(
                f"rope_scaling type {rope_type!r} is not supported (its frequencies depend on the head size); "
                "supported: none, linear, llama3, longrope"
            )
        elif rope_type == "longrope":
            scaling = _longrope(config, scaling)
    return theta, scaling


def _longrope(config: dict, scaling: dict) -> dict:
    """LongRoPE's settings, complete: per-pair short/long factors, the original length that switches between
    them, and the attention factor transformers derives (√(1 + ln f / ln L) for f = max length / L)."""
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not isinstance(value, list) or not all(isinstance(x, (int, float)) and x > 0 for x in value):
            raise MlaconvError(f"config.json: rope_scaling.{key} must be a list of positive numbers")
    original = config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    maximum = config.get("max_position_embeddings")
    if not isinstance(original, int) or not isinstance(maximum, int) or original < 1:
        raise MlaconvError("config.json: longrope needs original_max_position_embeddings and max_position_embeddings")
    factor = scaling.get("factor") or maximum / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in scaling["short_factor"]],
            "long_factor": [float(x) for x in scaling["long_factor"]], "original_max_position_embeddings": original,
            "factor": float(factor), "attention_factor": float(attention)}


def _dtype(config: dict) -> torch.dtype:
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").replace("torch.", "")
    table = {**DTYPES, "float64": torch.float64}
    if name not in table:
        raise MlaconvError(f"config.json: dtype {name!r} is not one mlaconv reads (float32, bfloat16, float16, float64)")
    return table[name]


def load_source(source: str, revision: str | None = None,
                allow_sliding_window: bool = False) -> tuple[Path, SourceSpec, CheckpointReader]:
    """Resolve, validate and open a source checkpoint (headers only)."""
    folder = resolve_source(source, revision)
    spec = SourceSpec.from_config(read_config(folder), allow_sliding_window=allow_sliding_window)
    reader = CheckpointReader(folder)
    spec.check_tensors(reader)
    return folder, spec, reader
