"""QK-norm (an RMSNorm on each query and key head before RoPE, Qwen3's) replaced by calibration-fitted linear maps.

Source, per head h with d dims, norm weight g and attention input x [H]:

    q̃_h(x) = g ⊙ W_h x / rms(W_h x)          (rms over the head's d dims; keys likewise per KV head)

1/rms is a per-token, per-head factor, so q̃ is no linear map of x, while DeepSeek-V3's query and shared
RoPE key are linear in x and its ``kv_a_layernorm`` divides the whole K/V latent (values included) by one
RMS, not each key head by its own. So the conversion factors a linear stand-in L·x ≈ q̃(x), fitted by
least squares on the calibration inputs:

    L = E[q̃ xᵀ] Σ⁻¹                          Σ = E[x xᵀ]

the best linear map in the mean (it scales down the input directions in which ‖W_h x‖, hence the
norm's divisor, is large; a single scale per head is the special case L_h = s_h·diag(g)·W_h).
What the stand-in still misses is measured as the layer's attention error against the true QK-normed
source, whose outputs are also what the layer-wise refinement then fits. Biases (if any) sit inside the
norm and are fitted through, not kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mlaconv.mla import metric as metric_math

RIDGE = 1e-6  # Σ + RIDGE·mean(diag Σ)·I when inverting it: directions the calibration never visits stay unused


@dataclass(frozen=True)
class NormMoments:
    """Cross moments of the normalised heads with the attention input, over the calibration tokens (float64)."""

    query: torch.Tensor  # E[q̃ xᵀ] [N·d, H]
    key: torch.Tensor  # E[k̃ xᵀ] [n_kv·d, H]


def folded(w: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """diag(g)·W_h for every head of w [heads·d, H]: the rows the norm would scale, without its 1/rms."""
    d = norm.shape[0]
    return (w.reshape(-1, d, w.shape[-1]) * norm[None, :, None]).reshape(w.shape)


def linear_fit(cross: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """argmin_L E‖y − L x‖² = E[y xᵀ] Σ⁻¹ for cross = E[y xᵀ] [m, H], Σ = E[x xᵀ] [H, H] (ridge-regularised)."""
    sigma = 0.5 * (metric + metric.T)
    ridge = RIDGE * sigma.diagonal().mean().clamp_min(torch.finfo(sigma.dtype).tiny)
    regularised = sigma + ridge * torch.eye(sigma.shape[0], dtype=sigma.dtype)
    return torch.linalg.solve(regularised, cross.T).T  # Σ symmetric: (Σ⁻¹ Cᵀ)ᵀ = C Σ⁻¹


def stand_in(src, metric: torch.Tensor, moments: NormMoments):
    """The layer ``src`` (a ``SourceAttention`` with q_norm/k_norm) with its queries and keys replaced by their
    least-squares linear stand-ins; the result has no norms and no q/k biases, and converts like any layer."""
    metric = metric.to(torch.float64)
    return replace(src, q=linear_fit(moments.query, metric), k=linear_fit(moments.key, metric),
                   q_bias=None, k_bias=None, q_norm=None, k_norm=None)


def weights_only_keys(k: torch.Tensor, norm: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Without data, a QK-normed key's stand-in: diag(g)·W_g with each head scaled so that its mean square is
    1 on inputs x = γ ⊙ ĥ with ĥ isotropic (E[x xᵀ] = diag γ²). Only the rope stride is chosen from it."""
    d = norm.shape[0]
    rows = k.to(torch.float64).reshape(-1, d, k.shape[-1])
    mean_square = metric_math.energy(rows, gamma.to(torch.float64) ** 2).mean(-1)  # [n_kv]
    scale = mean_square.clamp_min(torch.finfo(torch.float64).tiny).rsqrt()
    return folded((rows * scale[:, None, None]).reshape(k.shape), norm.to(torch.float64))
