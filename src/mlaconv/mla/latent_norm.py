"""Making DeepSeek's ``kv_a_layernorm`` an exact linear map: the tiny-latent regime, and where its smallness lives.

The stock layer computes kv_b·(w ⊙ c'/√(mean(c'²) + ε)) on the latent c' = β·A·x. If β is so small
that mean(c'²) ≤ δ·ε for every possible token, the norm is the linear map c'·w/√ε up to a relative
error of at most 1 − (1 + δ)^-½ ≈ δ/2. A bound that holds for any token: the attention input is
x = γ ⊙ ĥ with ĥ = h/√(mean(h²) + ε_src), so ‖ĥ‖² < H and

    mean(c²) = ‖A·diag(γ)·ĥ‖² / r ≤ σ_max(A·diag γ)² · H / r.

Hence β = √(δ·ε·r/H) / σ_max(A·diag γ). The norm weight ρ = √ε/(β·τ) then gives the normalised
latent a typical RMS of 1 (τ = typical RMS of A·x), and kv_b_proj carries B·τ.

β is ~1e-7: written as kv_a's latent rows it would sit below what float16 and the float16 block
scales of llama.cpp's q8_0/Q4_K hold (they come back as zeros). Only the product β·A·x must be tiny, so
the smallness is split between the weights and the attention input (``input_scale``): the layer's
input_layernorm weight becomes s·γ (a 1-D tensor, kept in float32 by llama.cpp and never quantized),
and both readers of x, q_proj and kv_a_proj_with_mqa, are divided by s. Scores, values and the bound
are unchanged; s is a power of two, so s·γ and the divisions are exact in every float format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LATENT_NORM_EPS = 1e-6  # hard-coded for kv_a_layernorm in transformers; rms_norm_eps in vLLM/SGLang
DEFAULT_DELTA = 1e-5
MAX_ENTRY = 2.0**13  # the largest weight the input scale may create: float16's 65504 with an 8× margin


@dataclass(frozen=True)
class TinyLatent:
    beta: float  # scale of the latent rows of kv_a_proj_with_mqa
    norm_weight: float  # every entry of kv_a_layernorm.weight
    up_scale: float  # multiply the up-projection (kv_b_proj) by this
    bound: float  # the proven bound on mean(c'²)/ε over all tokens (≤ delta)


def tiny_latent(down: torch.Tensor, gamma: torch.Tensor, typical_rms: float,
                delta: float = DEFAULT_DELTA, eps: float = LATENT_NORM_EPS) -> TinyLatent:
    """β, the norm weight and the up-projection scale for a latent ``down`` [r, H] read after norm weight γ [H]."""
    rank, hidden = down.shape
    sigma_max = largest_singular_value(down * gamma[None, :])
    if sigma_max == 0.0 or typical_rms == 0.0:  # an all-zero latent: any scale is exact
        return TinyLatent(beta=1.0, norm_weight=1.0, up_scale=0.0, bound=0.0)
    beta = math.sqrt(delta * eps * rank / hidden) / sigma_max
    return TinyLatent(
        beta=beta,
        norm_weight=math.sqrt(eps) / (beta * typical_rms),
        up_scale=typical_rms,
        bound=(beta * sigma_max) ** 2 * hidden / rank / eps,
    )


def largest_singular_value(matrix: torch.Tensor) -> float:
    """σ_max of an [r, H] matrix, r ≤ H: the top eigenvalue of the r×r Gram, far cheaper than an SVD (formed from the
    matrix divided by its largest entry, so that it neither underflows nor overflows)."""
    largest = matrix.abs().max().item()
    if largest == 0:
        return 0.0
    unit = matrix / largest
    return largest * math.sqrt(max(torch.linalg.eigvalsh(unit @ unit.T)[-1].item(), 0.0))


def latent_bound(latent_rows: torch.Tensor, input_norm: torch.Tensor, eps: float = LATENT_NORM_EPS) -> float:
    """The proven bound on mean(c²)/ε over all tokens for the latent c = latent_rows·(input_norm ⊙ ĥ), ‖ĥ‖² < H: what
    ``tiny_latent`` guarantees of the rows it makes, for rows as a checkpoint stores them (kv_a's first r rows and
    the layer's input_layernorm weight)."""
    rank, hidden = latent_rows.shape
    sigma_max = largest_singular_value(latent_rows.double() * input_norm.double()[None, :])
    return sigma_max**2 * hidden / rank / eps


def input_scale(latent_rows: torch.Tensor, readers: list[torch.Tensor], input_rms: float,
                max_entry: float = MAX_ENTRY) -> float:
    """The power of two s ≤ 1 by which the attention input is scaled (γ' = s·γ, readers ÷ s).

    latent_rows: kv_a's latent rows β·A [r, H] as they read the unscaled input; readers: every weight
    that reads x (q_proj, kv_a_proj_with_mqa); input_rms: the typical RMS of x.

    The latent c' = (β·A/s)·(s·x) is a product of a weight and an activation, and llama.cpp stores
    both with float16 block scales (q8_0 weights meet q8_0 activations), so s makes their typical
    magnitudes equal: RMS(β·A)/s = s·input_rms. No reader may then exceed ``max_entry``.
    """
    weight_rms = latent_rows.pow(2).mean().sqrt().item()
    if weight_rms == 0.0 or input_rms == 0.0:
        return 1.0
    exponent = round(0.5 * math.log2(weight_rms / input_rms))
    largest = max(max(-low.item(), high.item()) for low, high in map(torch.aminmax, readers))  # no |t| copy
    if largest > 0:
        exponent = max(exponent, math.ceil(math.log2(largest / max_entry)))
    return 2.0 ** min(exponent, 0)
