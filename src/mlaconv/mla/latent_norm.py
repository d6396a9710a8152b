"""Making DeepSeek's ``kv_a_layernorm`` an exact linear map: the tiny-latent regime.

The stock layer computes kv_b·(w ⊙ c'/√(mean(c'²) + ε)) on the latent c' = β·A·x. If β is so small
that mean(c'²) ≤ δ·ε for every possible token, the norm is the linear map c'·w/√ε up to a relative
error of at most 1 − (1 + δ)^-½ ≈ δ/2. A bound that holds for any token: the attention input is
x = γ ⊙ ĥ with ĥ = h/√(mean(h²) + ε_src), so ‖ĥ‖² < H and

    mean(c²) = ‖A·diag(γ)·ĥ‖² / r ≤ σ_max(A·diag γ)² · H / r.

Hence β = √(δ·ε·r/H) / σ_max(A·diag γ). The norm weight ρ = √ε/(β·τ) then gives the normalised
latent a typical RMS of 1 (τ = typical RMS of A·x), and kv_b_proj carries B·τ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LATENT_NORM_EPS = 1e-6  # hard-coded for kv_a_layernorm in transformers; rms_norm_eps in vLLM/SGLang
DEFAULT_DELTA = 1e-5


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
    scaled = down * gamma[None, :]
    largest = scaled.abs().max().item()
    # σ_max² is the top eigenvalue of the r×r Gram: far cheaper than an SVD of the r×H matrix
    # (formed from the matrix divided by its largest entry, so that it neither underflows nor overflows)
    unit = scaled / largest if largest > 0 else scaled
    sigma_max = largest * math.sqrt(max(torch.linalg.eigvalsh(unit @ unit.T)[-1].item(), 0.0)) if largest > 0 else 0.0
    if sigma_max == 0.0 or typical_rms == 0.0:  # an all-zero latent: any scale is exact
        return TinyLatent(beta=1.0, norm_weight=1.0, up_scale=0.0, bound=0.0)
    beta = math.sqrt(delta * eps * rank / hidden) / sigma_max
    return TinyLatent(
        beta=beta,
        norm_weight=math.sqrt(eps) / (beta * typical_rms),
        up_scale=typical_rms,
        bound=(beta * sigma_max) ** 2 * hidden / rank / eps,
    )

