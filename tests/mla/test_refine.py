"""The layer-wise refinement's optimizer: the best state on the select windows is returned, and the rate backs off
when a check does not improve (issue 16)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mlaconv.mla.layer import LatentAttention

from mlaconv.mla.forward import rms_norm
from mlaconv.mla.layer import AttentionShape
from mlaconv.mla.refine import NormalizedWindows, latent_attention, refine, refinement_flops

SHAPE = AttentionShape(hidden=32, heads=4, kv_heads=2, head_dim=8)
R, RANK = 4, 8


def random_layer(seed: int) -> LatentAttention:
    g = torch.Generator().manual_seed(seed)
    H, N, G, d = SHAPE.hidden, SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim

    def w(*size):
        return torch.randn(*size, generator=g, dtype=torch.float64) / size[-1] ** 0.5

    return LatentAttention(q_nope=w(N * d, H), q_rope=w(N * R, H), down=w(RANK, H), k_rope=w(R, H),
                           up_k=w(G * d, RANK), up_v=w(G * d, RANK), o=w(H, N * d))


def problem():
    """A teacher layer's outputs on random inputs, and a start that is the teacher's factors perturbed."""
    teacher = random_layer(0)
    noise = random_layer(1)
    start = replace(teacher, **{name: t + 0.3 * noise.trainable()[name] for name, t in teacher.trainable().items()})
    slots = torch.tensor([1.0, 0.1])
    angles = torch.arange(16, dtype=torch.float64)[:, None] * slots[None, :]
    x = torch.randn(12, 16, SHAPE.hidden, generator=torch.Generator().manual_seed(2))
    params = {name: t.float() for name, t in teacher.trainable().items()}
    fixed = replace(teacher, o=teacher.o.float())
    with torch.no_grad():
        y = latent_attention(x, params, fixed, SHAPE, R, angles.cos().float(), angles.sin().float())
    return start, slots, (x[:8], y[:8]), (x[8:], y[8:])


def select_error(latent: LatentAttention, slots, data) -> float:
    x, y = data
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * slots[None, :]
    params = {name: t.float() for name, t in latent.trainable().items()}
    with torch.no_grad():
        out = latent_attention(x, params, replace(latent, o=latent.o.float()), SHAPE, R, angles.cos().float(),
                               angles.sin().float())
    return ((out - y).pow(2).sum() / y.pow(2).sum()).item()


def test_refinement_returns_its_best_select_state():
    start, slots, train, select = problem()
    result = refine(start, SHAPE, R, slots, train, select, steps=30, check_every=5)
    assert result.before == pytest.approx(select_error(start, slots, select), rel=1e-6)  # summed a chunk at a time
    assert result.after < 0.7 * result.before
    assert abs(result.after - select_error(result.latent, slots, select)) < 1e-4 * result.before


def test_a_rate_that_is_too_high_backs_off_instead_of_giving_up():
    """At a relative rate of 1 every step overshoots: without back-off no check beats the start and the closed form
    is returned; with it the rate falls by 3 at each failed check until steps help."""
    start, slots, train, select = problem()
    fixed_rate = refine(start, SHAPE, R, slots, train, select, steps=60, lr=1.0, check_every=3, backoff=None)
    backing_off = refine(start, SHAPE, R, slots, train, select, steps=60, lr=1.0, check_every=3)
    assert fixed_rate.after == fixed_rate.before
    assert backing_off.after < 0.8 * backing_off.before


def test_the_error_at_some_positions_is_the_full_layer_there():
    """A step that takes its error at a few positions sees exactly the full causal layer's outputs there."""
    start, slots, (x, _), _ = problem()
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * slots[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    params = {name: t.float() for name, t in start.trainable().items()}
    fixed = replace(start, o=start.o.float())
    at = torch.tensor([0, 3, 4, 11, 15])
    with torch.no_grad():
        full = latent_attention(x, params, fixed, SHAPE, R, cos, sin)
        some = latent_attention(x, params, fixed, SHAPE, R, cos, sin, at)
    assert some.shape == (x.shape[0], len(at), SHAPE.hidden)
    torch.testing.assert_close(some, full[:, at], rtol=1e-5, atol=1e-6)


def test_refinement_on_a_share_of_the_positions_still_finds_a_better_state():
    start, slots, train, select = problem()
    result = refine(start, SHAPE, R, slots, train, select, steps=30, check_every=5, queries=4)
    assert result.before == pytest.approx(select_error(start, slots, select), rel=1e-6)  # summed a chunk at a time
    assert result.after < 0.7 * result.before
    assert abs(result.after - select_error(result.latent, slots, select)) < 1e-4 * result.before


def test_refinement_work_by_hand():
    """Per token the latent and rotated key: 32·(8+4) = 384; per query q, W_o and the rotary scores: 32·4·12 + 32·4·8
    + 16·4·4 = 2816. K and V from the latent and the scores and averages at width d: 16·8·2·2·8 + 2·4·q·16·8 per
    window; in the latent: 2·4·q·16·8 + 2·4·q·8·8, the cheaper at q = 4 (6144 against 8192), never at every position
    (q = 16: 12288 against 16384, but a step at every position takes torch's fused causal kernel). Forward and
    backward ×3, multiply-adds ×2."""
    assert refinement_flops(SHAPE, R, RANK, windows=2, window=16, queries=4) == 6 * 2 * (16 * 384 + 4 * 2816 + 6144)
    assert refinement_flops(SHAPE, R, RANK, 2, 16) == 6 * 2 * (16 * 384 + 16 * 2816 + 4096 + 16384)
    assert refinement_flops(SHAPE, R, RANK, 2, 16) == refinement_flops(SHAPE, R, RANK, 2, 16, queries=16)


@pytest.mark.parametrize("in_latent", [True, False])
def test_a_step_at_some_positions_attends_in_the_latent_or_per_head_alike(monkeypatch, in_latent):
    """The attention at a step's positions is formed per KV head (K and V from the latent) or in the latent with
    up_k and up_v absorbed into the query and output, whichever is less work; both give the full layer's outputs
    there and the same gradients (the reference: per-head keys and values at every position, torch's causal SDPA)."""
    import mlaconv.mla.refine as refinement

    start, slots, (x, _), _ = problem()
    x = x.double()  # in float64, so that the two orders of the same sums agree to far below any real difference
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * slots[None, :]
    cos, sin = angles.cos(), angles.sin()
    at = torch.tensor([0, 3, 4, 11, 15])
    latent_work, expanded_work = refinement._latent_work, refinement._expanded_work
    assert latent_work(SHAPE, RANK, 16, len(at)) < expanded_work(SHAPE, RANK, 16, len(at))  # the latent by default
    if not in_latent:
        monkeypatch.setattr(refinement, "_latent_work", lambda *shape: expanded_work(*shape) + 1)

    def outputs_and_gradients(positions):
        params = {name: t.clone().requires_grad_(True) for name, t in start.trainable().items()}
        out = latent_attention(x, params, start, SHAPE, R, cos, sin, positions)
        out = out if positions is not None else out[:, at]
        out.pow(2).sum().backward()
        return out.detach(), {name: t.grad for name, t in params.items()}

    some, some_grads = outputs_and_gradients(at)
    full, full_grads = outputs_and_gradients(None)
    torch.testing.assert_close(some, full, rtol=1e-12, atol=1e-12)
    for name, grad in full_grads.items():
        torch.testing.assert_close(some_grads[name], grad, rtol=1e-10, atol=1e-12)


def test_the_cheaper_attention_follows_the_shape():
    """At an eighth of the positions of a 256-token window: an MHA layer with a wide latent (4 KV heads, r = 192)
    attends in the latent; a Llama-3.2-1B-shaped layer (32 heads, 8 KV heads, r = 448, windows of 2048) per head."""
    import mlaconv.mla.refine as refinement

    mha = AttentionShape(hidden=256, heads=4, kv_heads=4, head_dim=64)
    assert refinement._latent_work(mha, 192, 256, 32) < refinement._expanded_work(mha, 192, 256, 32)
    llama_1b = AttentionShape(hidden=2048, heads=32, kv_heads=8, head_dim=64)
    assert refinement._latent_work(llama_1b, 448, 2048, 256) > refinement._expanded_work(llama_1b, 448, 2048, 256)


def test_a_closed_form_error_measured_by_the_caller_is_the_bar_to_beat():
    start, slots, train, select = problem()
    own = refine(start, SHAPE, R, slots, train, select, steps=30, check_every=5)
    given = refine(start, SHAPE, R, slots, train, select, steps=30, check_every=5, before=own.before)
    assert (given.before, given.after) == (own.before, own.after)
    unbeatable = refine(start, SHAPE, R, slots, train, select, steps=30, check_every=5, before=0.0)
    assert unbeatable.after == unbeatable.before == 0.0
    assert all(torch.equal(unbeatable.latent.trainable()[name], t.float().double())  # the start, as the steps held it
               for name, t in start.trainable().items())


def test_windows_normalized_on_demand_refine_exactly_as_the_held_inputs():
    """``NormalizedWindows``: rms_norm(h)·γ of the picked windows, formed when indexed, and a refinement trained on
    them takes the same steps as one trained on those inputs held whole."""
    start, slots, train, select = problem()
    g = torch.Generator().manual_seed(3)
    hidden = 3 * torch.randn(20, 16, SHAPE.hidden, generator=g)  # a residual stream of 20 windows
    gamma, eps = torch.rand(SHAPE.hidden, generator=g) + 0.5, 1e-5
    windows = torch.tensor([3, 17, 5, 0, 11, 8, 19, 2])
    lazy = NormalizedWindows(hidden, windows, gamma, eps, torch.device("cpu"))
    held = rms_norm(hidden[windows], gamma, eps)
    assert lazy.shape == held.shape
    pick = torch.tensor([6, 1, 4])
    assert torch.equal(lazy[pick], held[pick]) and torch.equal(lazy[2:5], held[2:5])
    y = train[1]
    by_demand = refine(start, SHAPE, R, slots, (lazy, y), select, steps=12, check_every=4)
    by_tensor = refine(start, SHAPE, R, slots, (held, y), select, steps=12, check_every=4)
    assert by_demand.after == by_tensor.after < by_demand.before
    for name, t in by_tensor.latent.trainable().items():
        assert torch.equal(by_demand.latent.trainable()[name], t)


def test_a_step_taken_a_chunk_of_windows_at_a_time_is_the_whole_batch_step(monkeypatch):
    """Each chunk's share of the error back-propagated on its own adds up to the whole batch's gradient."""
    import mlaconv.mla.refine as refinement

    start, slots, train, select = problem()
    window = train[0].shape[1]
    monkeypatch.setattr(refinement, "CHUNK_SCORES", 2 * SHAPE.heads * window * window)  # two windows a chunk
    chunked = refine(start, SHAPE, R, slots, train, select, steps=12, check_every=4, batch=8)
    monkeypatch.setattr(refinement, "CHUNK_SCORES", 8 * SHAPE.heads * window * window)
    whole = refine(start, SHAPE, R, slots, train, select, steps=12, check_every=4, batch=8)
    assert chunked.after == pytest.approx(whole.after, rel=1e-5) and chunked.after < chunked.before
    for name, t in whole.latent.trainable().items():
        assert torch.allclose(chunked.latent.trainable()[name], t, rtol=1e-4, atol=1e-6)
