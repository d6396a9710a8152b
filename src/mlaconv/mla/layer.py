"""The tensor sets and settings of one attention layer: the source's (``SourceAttention``, Llama's canonical
layout), the converted one's (``MLAAttention``, DeepSeek-V3's stock tensors), the shapes, the per-layer options,
the statistics the conversion weighs by, and what it reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mlaconv.mla.latent_norm import DEFAULT_DELTA
from mlaconv.mla.rope import UnrotationLoss


def gqa_cache_elements(kv_heads: int, head_dim: int) -> int:
    """Values an MHA/GQA layer caches per token: a key and a value of d per KV head (2·n_kv·d)."""
    return 2 * kv_heads * head_dim


def mla_cache_elements(rank: int, rope_dim: int) -> int:
    """Values an MLA layer caches per token: the latent and the shared rope key (r + R)."""
    return rank + rope_dim


def kv_cache_elements(config: dict) -> int:
    """KV-cache elements per token and layer a ``config.json`` implies (MLA: r + R; MHA/GQA: 2·n_kv·d). Every KV
    count (``AttentionShape``, ``MLAShape``, a plan's ``ShapeChoice``, a config) is one of the two formulas above."""
    if config.get("kv_lora_rank"):
        return mla_cache_elements(int(config["kv_lora_rank"]), int(config.get("qk_rope_head_dim", 0)))
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return gqa_cache_elements(kv_heads, int(config.get("head_dim") or int(config["hidden_size"]) // heads))


@dataclass(frozen=True)
class AttentionShape:
    hidden: int  # H
    heads: int  # N
    kv_heads: int  # n_kv
    head_dim: int  # d

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def cache_elements(self) -> int:
        return gqa_cache_elements(self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class MLAShape:
    """A DeepSeek-V3 config's attention shape (P = qk_nope_head_dim, V = v_head_dim)."""

    hidden: int  # H
    heads: int  # N
    rank: int  # r
    rope_dim: int  # R
    nope_dim: int  # P
    v_dim: int  # V

    @classmethod
    def from_config(cls, config: dict) -> "MLAShape":
        return cls(hidden=int(config["hidden_size"]), heads=int(config["num_attention_heads"]),
                   rank=int(config["kv_lora_rank"]), rope_dim=int(config["qk_rope_head_dim"]),
                   nope_dim=int(config["qk_nope_head_dim"]), v_dim=int(config["v_head_dim"]))

    @property
    def cache_elements(self) -> int:
        return mla_cache_elements(self.rank, self.rope_dim)

    @property
    def softmax_scale(self) -> float:
        return (self.nope_dim + self.rope_dim) ** -0.5


@dataclass
class SourceAttention:
    """One source layer's attention weights (and the input RMSNorm weight γ that precedes them)."""

    q: torch.Tensor  # [N·d, H]
    k: torch.Tensor  # [n_kv·d, H]
    v: torch.Tensor  # [n_kv·d, H]
    o: torch.Tensor  # [H, N·d]
    input_norm: torch.Tensor  # γ [H]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    rotated: bool = True  # False: the layer applies no RoPE at all (SmolLM3's NoPE layers)
    q_norm: torch.Tensor | None = None  # [d]: RMSNorm weight on each query head before RoPE (Qwen3's QK-norm)
    k_norm: torch.Tensor | None = None  # [d]: the same on each key head
    qk_norm_eps: float = 1e-6

    @property
    def has_qk_norm(self) -> bool:
        return self.q_norm is not None or self.k_norm is not None

    def cast(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "SourceAttention":
        return cast_tensors(self, device, dtype)


def cast_tensors(layer, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """The same layer (a dataclass of tensors) with every tensor moved to ``device`` and/or ``dtype``."""
    return replace(layer, **{name: t.to(device=device, dtype=dtype) for name, t in vars(layer).items()
                             if isinstance(t, torch.Tensor)})


@dataclass(frozen=True)
class LayerOptions:
    rank: int  # r
    rope_dim: int  # R
    rope_theta: float
    rope_scaling: dict | None = None
    rope_stride: int | None = None  # None: chosen from the energies
    rotary_dim: int | None = None  # d_rot: head dims RoPE turns (None: all); the rest are pairs of frequency 0
    context: int = 4096  # window of the data-free attention profile
    query_weighted_rope: bool = False  # weight each KV head's key energy by the query energy it serves
    latent_weighting: str = "balanced"  # "balanced": K and V blocks at equal energy; "attention": keys
    # weighted by the queries that read them (q·k is what matters), values by W_o (W_o·v is)
    value_weight: float = 1.0  # the V block's weighted energy in the latent's basis, relative to the K block's
    residual_scale: float = 1.0  # α: rescales what o_proj writes into the residual stream
    delta: float = DEFAULT_DELTA  # tiny-latent bound on mean(c²)/ε
    biases: bool = True  # False: the output has no bias tensors (a serving target that ignores them); the
    # rope key's bias and W_o·b_v are then dropped here, and a refinement re-fits the layer with them fixed at zero
    precision: torch.dtype = torch.float64  # what the factorization computes in (``conversion.plan.factor_precision``)


@dataclass
class MLAAttention:
    """One converted layer's stock DeepSeek-V3 attention tensors, and the input norm weight that feeds them."""

    q_proj: torch.Tensor  # [N·(d+R), H]
    kv_a_proj: torch.Tensor  # [r+R, H]
    kv_a_norm: torch.Tensor  # [r]
    kv_b_proj: torch.Tensor  # [N·2d, r]
    o_proj: torch.Tensor  # [H, N·d]
    input_norm: torch.Tensor  # [H] the layer's input_layernorm weight s·γ (written in place of the source's γ)
    kv_a_bias: torch.Tensor | None = None  # [r+R]
    o_bias: torch.Tensor | None = None  # [H]

    def cast(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "MLAAttention":
        return cast_tensors(self, device, dtype)


@dataclass
class LatentAttention:
    """One converted layer in its compact, linear form (before the tiny-latent norm and GQA expansion).

    Scores are (q_nope·k_nope + rot(q_rope)·rot(k_rope))·(d+R)^-½ with k_nope = up_k·c, v = up_v·c,
    c = down·x; the query rows already carry the √((d+R)/d) scale change. Weights are in source
    units (no residual rescale).
    """

    q_nope: torch.Tensor  # [N·d, H]
    q_rope: torch.Tensor  # [N·R, H], interleaved pairs
    down: torch.Tensor  # A [r, H]
    k_rope: torch.Tensor  # [R, H], interleaved pairs (the shared rotated key κ)
    up_k: torch.Tensor  # [n_kv·d, r]
    up_v: torch.Tensor  # [n_kv·d, r]
    o: torch.Tensor  # [H, N·d]
    k_rope_bias: torch.Tensor | None = None  # [R]
    o_bias: torch.Tensor | None = None  # [H], W_o·b_v (+ the source's o bias)
    k_nope_target: torch.Tensor | None = None  # [n_kv·d, H] the key remainders up_k·down approximates

    def trainable(self) -> dict[str, torch.Tensor]:
        return {"q_nope": self.q_nope, "q_rope": self.q_rope, "down": self.down, "k_rope": self.k_rope,
                "up_k": self.up_k, "up_v": self.up_v}


@dataclass
class LayerReport:
    energy_retained: float  # latent: 1 − the balanced [K_nope; V] relative error (``latent_errors``)
    rope_energy_kept: float  # fraction of key energy that stays rotated
    rope_energy_kept_per_frequency: list[float]
    rope_loss_weighted_kept: float
    rope_stride: int
    key_error: float  # measured relative error of the NoPE keys through the latent
    value_error: float  # measured relative error of the values through the latent
    latent_bound: float  # proven max over all tokens of mean(c'²)/ε
    dropped_bias: list[str] = field(default_factory=list)  # bias terms no stock DeepSeek tensor can hold
    attention_error: float | None = None  # measured on calibration windows: ‖MLA − source‖²/‖source‖²
    variant: str = "weights-only"  # which conversion variant this layer kept
    objective_retained: float | None = None  # 1 − the relative error in the variant's own latent weighting
    rope_score: UnrotationLoss | None = None  # calibrated: the rotary score error (``shared_key.rotary_figures``),
    # measured on the audit windows like the rope_* figures above then are


@dataclass(frozen=True)
class LayerStats:
    """What calibration knows of one layer (weights-only: ĥ isotropic, no attention profile).

    rotation_mean μ[h, j] = E[e^{-iΔω_j}] over the attention of query head h (Δ = query position −
    key position, weighted by the attention probabilities): the best position-free stand-in for the
    rotation of a key component that loses it. Calibration measures it; without data a prior is used.
    """

    metric: torch.Tensor  # E[x xᵀ] [H, H] float64, or its diagonal [H] (``mla.metric``)
    rotation_mean: torch.Tensor  # μ [N, F] complex128
    mean: torch.Tensor | None = None  # E[x] [H] (calibration only)

    def cast(self, dtype: torch.dtype) -> "LayerStats":
        """The same statistics in ``dtype`` (μ in its complex counterpart)."""
        complex_dtype = torch.complex64 if dtype == torch.float32 else torch.complex128
        return replace(self, metric=self.metric.to(dtype), rotation_mean=self.rotation_mean.to(complex_dtype),
                       mean=None if self.mean is None else self.mean.to(dtype))
