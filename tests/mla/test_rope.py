"""mla/rope.py, function by function, against hand derivations, plain PyTorch and transformers' own RoPE code (the
frequencies and rope_scaling: test_rope_frequencies.py)."""

from __future__ import annotations

import cmath
import math

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from helpers import generator
from mlaconv.mla import rope

F64 = torch.float64


# --- complex pairs, real rows, interleave ---------------------------------------------------------------------------

def test_complex_pairs_pairs_rows_j_and_j_plus_half_of_each_head():
    heads, d, H = 3, 8, 5
    w = torch.randn(heads * d, H, dtype=F64, generator=generator(0))
    z = rope.complex_pairs(w, heads)
    assert z.shape == (d // 2, heads, H) and z.is_complex()
    for g in range(heads):
        for j in range(d // 2):
            assert torch.equal(z[j, g].real, w[g * d + j])
            assert torch.equal(z[j, g].imag, w[g * d + j + d // 2])


def test_real_rows_inverts_complex_pairs_exactly():
    heads, d, H = 4, 6, 7
    w = torch.randn(heads * d, H, dtype=torch.float32, generator=generator(1))
    assert torch.equal(rope.real_rows(rope.complex_pairs(w, heads)), w)
    z = torch.randn(d // 2, heads, H, dtype=torch.complex128, generator=generator(2))
    assert torch.equal(rope.complex_pairs(rope.real_rows(z), heads), z)


def test_rotate_half_rope_is_multiplication_of_the_complex_pairs():
    """The module's premise: transformers' RoPE at position p multiplies pair j by e^{i·p·ω_j}."""
    heads, d, theta, p = 2, 8, 100.0, 7
    k = torch.randn(heads * d, 1, dtype=F64, generator=generator(3))
    omega = theta ** (-torch.arange(0, d, 2, dtype=F64) / d)
    angle = torch.cat([p * omega, p * omega])
    rotated, _ = apply_rotary_pos_emb(k.view(1, heads, 1, d), k.view(1, heads, 1, d), angle.cos()[None, None],
                                      angle.sin()[None, None])
    expected = rope.complex_pairs(k, heads) * torch.exp(1j * p * omega)[:, None, None]
    torch.testing.assert_close(rope.complex_pairs(rotated.reshape(heads * d, 1), heads), expected)


def test_interleave_puts_real_then_imaginary_part_of_each_slot():
    z = torch.complex(torch.arange(24, dtype=F64).view(2, 3, 4), -torch.arange(24, dtype=F64).view(2, 3, 4) - 100)
    out = rope.interleave(z)
    assert out.shape == (2, 6, 4)
    for slot in range(3):
        assert torch.equal(out[:, 2 * slot], z[:, slot].real)
        assert torch.equal(out[:, 2 * slot + 1], z[:, slot].imag)


# --- Gram and head mix ----------------------------------------------------------------------------------------------

def sampled_metric(samples: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(samples, H, dtype=F64, generator=generator(seed)) * torch.linspace(0.5, 2.0, H, dtype=F64)
    return x, x.T @ x / samples


def test_hermitian_gram_is_the_expected_product_of_head_outputs():
    F, n, H = 3, 2, 6
    z = torch.randn(F, n, H, dtype=torch.complex128, generator=generator(4))
    x, metric = sampled_metric(50, H, seed=5)
    outputs = torch.einsum("fgh,sh->fgs", z, x.to(torch.complex128))  # z_g·x per sample
    expected = outputs @ outputs.conj().transpose(-1, -2) / x.shape[0]  # E[z_g·x · conj(z_g'·x)]
    torch.testing.assert_close(rope.hermitian_gram(z, metric), expected)


def test_hermitian_gram_takes_a_diagonal_metric():
    z = torch.randn(2, 3, 5, dtype=torch.complex128, generator=generator(6))
    m = torch.rand(5, dtype=F64, generator=generator(7)) + 0.1
    torch.testing.assert_close(rope.hermitian_gram(z, m), rope.hermitian_gram(z, torch.diag(m)))


def test_head_mix_of_identical_heads_keeps_all_energy_and_reconstructs_every_head():
    F, n, H = 4, 3, 5
    one = torch.randn(F, 1, H, dtype=torch.complex128, generator=generator(8))
    z = one.expand(F, n, H)
    _, metric = sampled_metric(40, H, seed=9)
    gram = rope.hermitian_gram(z, metric)
    mix = rope.head_mix(gram)
    trace = gram.diagonal(dim1=-2, dim2=-1).real.sum(-1)
    torch.testing.assert_close(mix.energies[:, 0], trace)
    torch.testing.assert_close(mix.energies[:, 1:], torch.zeros(F, n - 1, dtype=F64), atol=1e-10, rtol=0)
    kappa = (mix.b[:, :, None] * z).sum(1)  # [F, H]
    torch.testing.assert_close(mix.a[:, :, None] * kappa[:, None], z)
    torch.testing.assert_close(mix.b.abs().pow(2).sum(-1), torch.ones(F, dtype=F64))


def weighted_residual(z, metric, mix, weights) -> torch.Tensor:
    """Σ_g w_g·E|z_g − a_g·κ|² per frequency, κ = Σ_g b_g z_g, straight from the definition."""
    kappa = (mix.b[:, :, None] * z).sum(1)
    r = z - mix.a[:, :, None] * kappa[:, None]
    per_head = torch.einsum("fgh,hk,fgk->fg", r, metric.to(r.dtype), r.conj()).real
    return (weights * per_head).sum(-1)


@pytest.mark.parametrize("weighted", [False, True])
def test_head_mix_residual_is_the_lower_eigenvalues_and_beats_keeping_one_head(weighted):
    F, n, H = 3, 4, 8
    z = torch.randn(F, n, H, dtype=torch.complex128, generator=generator(10))
    _, metric = sampled_metric(64, H, seed=11)
    weights = torch.rand(F, n, dtype=F64, generator=generator(12)) + 0.2 if weighted else torch.ones(F, n, dtype=F64)
    mix = rope.head_mix(rope.hermitian_gram(z, metric), weights if weighted else None)
    assert (mix.energies[:, :-1] >= mix.energies[:, 1:]).all() and (mix.energies >= 0).all()
    residual = weighted_residual(z, metric, mix, weights)
    torch.testing.assert_close(residual, mix.energies[:, 1:].sum(-1))
    # κ projected back through a returns itself: Σ_g b_g·a_g = 1
    torch.testing.assert_close((mix.a * mix.b).sum(-1), torch.ones(F, dtype=torch.complex128))
    for g in range(n):  # keeping any single head whole (a = b = e_g) loses more
        one_hot = torch.zeros(F, n, dtype=torch.complex128)
        one_hot[:, g] = 1
        keep_g = rope.HeadMix(a=one_hot, b=one_hot, energies=mix.energies)
        assert (weighted_residual(z, metric, keep_g, weights) >= residual - 1e-9).all()


def test_head_weights_decide_which_uncorrelated_head_is_kept():
    """Gram diag(1, 4): unweighted the shared key follows head 1 (energy 4); weights (10, 1) make it head 0 (10)."""
    gram = torch.diag(torch.tensor([1.0, 4.0], dtype=F64)).to(torch.complex128)[None]
    plain = rope.head_mix(gram)
    torch.testing.assert_close(plain.energies, torch.tensor([[4.0, 1.0]], dtype=F64))
    torch.testing.assert_close(plain.b.abs(), torch.tensor([[0.0, 1.0]], dtype=F64))
    weighted = rope.head_mix(gram, torch.tensor([[10.0, 1.0]], dtype=F64))
    torch.testing.assert_close(weighted.energies, torch.tensor([[10.0, 4.0]], dtype=F64))
    torch.testing.assert_close(weighted.b.abs(), torch.tensor([[1.0, 0.0]], dtype=F64))
    torch.testing.assert_close(weighted.a.abs(), torch.tensor([[1.0, 0.0]], dtype=F64))


# --- the data-free rotation mean ------------------------------------------------------------------------------------

def brute_force_mean(omega: float, window: int, power: float) -> complex:
    """Every query m < window spreads its attention over Δ = 0..m ∝ (1 + Δ)^-power; μ = mean over queries."""
    total = 0j
    for m in range(window):
        weights = [(1 + delta) ** -power for delta in range(m + 1)]
        norm = sum(weights)
        total += sum(w / norm * cmath.exp(-1j * delta * omega) for delta, w in enumerate(weights))
    return total / window


def test_prior_rotation_mean_for_two_positions_by_hand():
    omega, c = 0.7, 2 ** -0.5
    p1 = c / (1 + c) / 2  # only the second query sees Δ = 1, with share c / (1 + c)
    expected = (1 - p1) + p1 * cmath.exp(-1j * omega)
    mu = rope.prior_rotation_mean(torch.tensor([omega], dtype=F64), window=2)
    assert mu.dtype == torch.complex128
    assert abs(mu.item() - expected) < 1e-12


@pytest.mark.parametrize("window, power", [(37, 0.5), (64, 1.0), (20, 0.0)])
def test_prior_rotation_mean_matches_the_attention_profile_it_describes(window, power):
    freqs = torch.tensor([0.0, 0.01, 0.3, 1.0, math.pi], dtype=F64)
    mu = rope.prior_rotation_mean(freqs, window, power)
    expected = torch.tensor([brute_force_mean(w, window, power) for w in freqs.tolist()], dtype=torch.complex128)
    torch.testing.assert_close(mu, expected)
    assert (mu.abs() <= 1 + 1e-12).all()
    assert abs(mu[0].item() - 1) < 1e-12  # frequency 0 never turns
    assert mu.abs()[3] < mu.abs()[1]  # faster rotations average out more


# --- strides and the kept grid --------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim, rope_dim, expected", [
    (16, 8, [1, 2]),  # 4 slots over 8 frequencies: 3·s ≤ 7
    (16, 16, [1]),  # every frequency is a slot
    (16, 2, [1]),  # one slot: frequency 0 whatever the stride
    (16, 4, [1, 2, 3, 4, 5, 6, 7]),  # 2 slots: s ≤ 7
    (128, 64, [1, 2]),  # 31·s ≤ 63
    (128, 32, [1, 2, 3, 4]),  # 15·s ≤ 63
])
def test_strides_by_hand(head_dim, rope_dim, expected):
    assert rope.strides(head_dim, rope_dim) == expected
    for s in expected:
        kept = rope.kept_frequencies(rope_dim, s)
        assert kept.tolist() == [s * i for i in range(rope_dim // 2)]
        assert kept.max().item() < head_dim // 2


# energies [F=8, n=2]: column 0 is what the shared key carries at each frequency
ENERGIES = torch.tensor([[8, 1], [1, 1], [4, 1], [1, 1], [2, 1], [1, 1], [1, 1], [1, 1]], dtype=F64)


def test_stride_scores_and_choice_by_hand():
    # total 27; stride 1 keeps frequencies 0..3 (8+1+4+1 = 14), stride 2 keeps 0, 2, 4, 6 (8+4+2+1 = 15)
    scores = rope.stride_scores(ENERGIES, rope_dim=8)
    assert scores.keys() == {1, 2}
    assert scores[1] == pytest.approx(14 / 27) and scores[2] == pytest.approx(15 / 27)
    assert rope.best_stride([scores]) == 2
    choice = rope.choose_frequencies(ENERGIES, rope_dim=8, stride=2)
    assert choice.stride == 2 and choice.frequencies.tolist() == [0, 2, 4, 6]
    assert choice.energy_kept_per_frequency == pytest.approx([8 / 9, 0, 4 / 5, 0, 2 / 3, 0, 1 / 2, 0])
    assert choice.loss_weighted_kept == pytest.approx(15 / 27)


def test_stride_scores_of_zero_energy_are_one():
    assert rope.stride_scores(torch.zeros(8, 2, dtype=F64), rope_dim=8) == {1: 1.0, 2: 1.0}


def test_best_stride_averages_layers_and_breaks_ties_to_the_smaller():
    assert rope.best_stride([{1: 0.6, 2: 0.5}, {1: 0.3, 2: 0.5}]) == 2  # means 0.45 and 0.5
    assert rope.best_stride([{1: 0.6, 2: 0.5}, {1: 0.5, 2: 0.5}]) == 1  # 0.55 and 0.5
    assert rope.best_stride([{1: 0.5, 2: 0.5, 3: 0.5}]) == 1


def test_choose_frequencies_refuses_a_stride_that_does_not_fit():
    with pytest.raises(ValueError, match="stride 3 does not fit 8 rope dims in 8 frequencies"):
        rope.choose_frequencies(ENERGIES, rope_dim=8, stride=3)


# --- DeepSeek's interleaved rotation --------------------------------------------------------------------------------

def test_rotate_interleaved_matches_a_complex_rotation():
    S, R = 5, 8
    x = torch.randn(2, 3, S, R, dtype=F64, generator=generator(13))
    angle = torch.rand(S, R // 2, dtype=F64, generator=generator(14)) * 10
    out = rope.rotate_interleaved(x, angle.cos(), angle.sin())
    pairs = torch.view_as_complex(x.reshape(2, 3, S, R // 2, 2).contiguous())  # (x[2i], x[2i+1]) = x[2i] + i·x[2i+1]
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    torch.testing.assert_close(out, expected)


def test_rotate_interleaved_matches_transformers_deepseek_up_to_its_pair_order():
    """transformers' DeepSeek-V3 rotates the same pairs but writes them rotate-half ordered (evens, then odds)."""
    S, R = 6, 8
    q = torch.randn(1, 2, S, R, dtype=F64, generator=generator(15))
    angle = torch.rand(S, R // 2, dtype=F64, generator=generator(16)) * 5
    cos, sin = torch.cat([angle, angle], -1).cos()[None], torch.cat([angle, angle], -1).sin()[None]
    reference, _ = apply_rotary_pos_emb_interleave(q, q, cos, sin)
    out = rope.rotate_interleaved(q, angle.cos(), angle.sin())
    torch.testing.assert_close(out[..., 0::2], reference[..., : R // 2])
    torch.testing.assert_close(out[..., 1::2], reference[..., R // 2 :])


# --- the unrotation loss --------------------------------------------------------------------------------------------

def test_unrotation_loss_by_hand():
    """F = 3 pairs, N = 2 query heads; μ is [N, F], the energies [F, N].

    total Σ q·k = 1·3 + 2·1 + 1·1 + 1·2 + 0·5 + 4·1 = 12
    compensated q·r·(1 − |μ|²): pair 0: 1·1·0.75 + 2·0.5·0 = 0.75; pair 1: 1·1·0.64 + 1·2·0.91 = 2.46; pair 2: 4·1·1 = 4
    uncompensated q·r·(2 − 2 Re μ): pair 0: 1·(2 − 1) + 1·(2 − 2) = 1; pair 1: 1·2 + 2·(2 − 0.6) = 4.8; pair 2: 4·2 = 8
    """
    query = torch.tensor([[1.0, 2.0], [1.0, 1.0], [0.0, 4.0]], dtype=F64)
    key = torch.tensor([[3.0, 1.0], [1.0, 2.0], [5.0, 1.0]], dtype=F64)
    remainder = torch.tensor([[1.0, 0.5], [1.0, 2.0], [7.0, 1.0]], dtype=F64)
    mean = torch.tensor([[0.5, 0.6j, 0.0], [1.0, 0.3, 0.0]], dtype=torch.complex128)  # [N, F]
    loss = rope.unrotation_loss(query, key, remainder, mean)
    assert loss.compensated_per_frequency == pytest.approx([0.75 / 12, 2.46 / 12, 4 / 12])
    assert loss.compensated == pytest.approx(7.21 / 12)
    assert loss.uncompensated == pytest.approx(13.8 / 12)
    assert loss.recovered == pytest.approx(1 - 7.21 / 13.8)


def test_unrotation_loss_terms_are_the_expected_rotation_errors():
    """E|e − μ|² = 1 − |μ|² and E|e − 1|² = 2 − 2·Re μ for e = e^{-iΔω} over a distribution of distances."""
    omega = torch.tensor([0.4, 1.3], dtype=F64)
    distance = torch.arange(6, dtype=F64)
    p = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05], dtype=F64)
    e = torch.exp(-1j * distance[:, None] * omega[None])  # [Δ, F]
    mu = (p[:, None] * e).sum(0)
    with_mean = (p[:, None] * (e - mu).abs() ** 2).sum(0)
    without = (p[:, None] * (e - 1).abs() ** 2).sum(0)
    ones = torch.ones(2, 1, dtype=F64)
    loss = rope.unrotation_loss(ones, ones, ones, mu[None])
    assert loss.compensated_per_frequency == pytest.approx((with_mean / 2).tolist())
    assert loss.uncompensated == pytest.approx(without.sum().item() / 2)


def test_unrotation_loss_is_zero_when_nothing_is_lost():
    query = torch.rand(4, 2, dtype=F64, generator=generator(17))
    mean = torch.full((2, 4), 0.5 + 0.1j, dtype=torch.complex128)
    loss = rope.unrotation_loss(query, query, torch.zeros_like(query), mean)
    assert loss.compensated == 0 and loss.uncompensated == 0 and loss.recovered == 1.0


def test_unrotation_loss_is_the_expected_score_error_over_the_attention_profile():
    """1 − |μ|² and 2 − 2·Re μ are E|e^{-iΔω} − c|² for c = μ and c = 1: checked by summing over an explicit
    distribution of distances Δ, with random per-pair, per-head query, key and remainder energies."""
    gen = torch.Generator().manual_seed(3)
    F, N, window = 6, 3, 50
    freqs = 10000.0 ** (-torch.arange(F, dtype=torch.float64) / F)
    profile = torch.rand(N, window, generator=gen, dtype=torch.float64)
    profile /= profile.sum(-1, keepdim=True)  # p_h(Δ), one per query head
    turn = torch.exp(-1j * torch.arange(window, dtype=torch.float64)[:, None] * freqs[None, :])  # [Δ, F]
    mean = profile.to(torch.complex128) @ turn  # μ [N, F]
    query, key = torch.rand(F, N, generator=gen, dtype=torch.float64), torch.rand(F, N, generator=gen, dtype=torch.float64)
    remainder = key * torch.rand(F, N, generator=gen, dtype=torch.float64)
    loss = rope.unrotation_loss(query, key, remainder, mean)
    total = (query * key).sum()
    for stand_in, figure in ((mean, loss.compensated), (torch.ones_like(mean), loss.uncompensated)):
        error = ((turn.T[None] - stand_in[:, :, None]).abs() ** 2 * profile[:, None, :]).sum(-1)  # [N, F]
        assert figure == pytest.approx(((query * remainder * error.T).sum() / total).item(), rel=1e-12)
    assert sum(loss.compensated_per_frequency) == pytest.approx(loss.compensated, rel=1e-12)
    assert 0 < loss.recovered < 1
    nothing_lost = rope.unrotation_loss(query, key, torch.zeros_like(key), mean)
    assert (nothing_lost.compensated, nothing_lost.uncompensated, nothing_lost.recovered) == (0.0, 0.0, 1.0)


def test_folded_turn_and_least_rope_dim_by_hand():
    """SmolLM2-135M's rotary frequencies (θ = 10⁵, head_dim 64), written out here: ω_i = θ^(-2i/64)."""
    from mlaconv.mla.rope import folded_turn, least_rope_dim

    freqs = torch.tensor([1e5 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    assert folded_turn(freqs, 64, 1, 8192) == 0.0  # every frequency kept
    assert folded_turn(freqs, 48, 1, 4096) == pytest.approx(1e5 ** -0.75 * 4096)  # ω_24, the fastest folded: 0.73
    assert folded_turn(freqs, 32, 2, 2048) == pytest.approx(1e5 ** (-2 / 64) * 2048)  # stride 2 folds ω_1
    assert least_rope_dim(freqs, 2048, 0.4) == 48  # ω_23·2048 = 0.52 turns, ω_24·2048 = 0.36 does not
    assert least_rope_dim(freqs, 8192, 0.4) == 56  # ω_27·8192 = 0.46, ω_28·8192 = 0.26
    assert least_rope_dim(freqs, 1, 0.4) == 6 and least_rope_dim(freqs, 1, 1.0) == 0  # ω_2 = 0.49, ω_0 = 1
