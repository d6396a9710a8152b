"""The rotary figures (docs/report.md, "Rotary figures"): checked against scores formed pair by pair on explicit
inputs, and, for a calibrated conversion, measured from each layer's own weights on the audit windows: a refined
layer's from its trained q_rope and k_rope, in statistics taken here from transformers on the audit windows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mlaconv.conversion.calibrated import calibrate_layer, calibration_streamer, calibration_tokens, refinement_plan
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipeline import source_layers
from mlaconv.conversion.plan import plan_conversion, with_rope_stride
from mlaconv.mla import metric, rope
from mlaconv.mla.attention import analyse_layer, factor_attention
from mlaconv.mla.layer import AttentionShape, LayerOptions, LayerStats, SourceAttention
from mlaconv.mla.shared_key import RotatedSlots, closed_form_slots, latent_slots, rotary_figures


def rotate(pair: torch.Tensor, angle: float) -> torch.Tensor:
    """A real 2-vector [..., 2] turned by ``angle``."""
    c, s = math.cos(angle), math.sin(angle)
    return torch.stack([c * pair[..., 0] - s * pair[..., 1], s * pair[..., 0] + c * pair[..., 1]], -1)


def sampled_figures(q, k, shape, pairs, frequencies, q_slot, k_slot, x, mean):
    """The figures by their definition on the rows x [T, H], every (query token, key token) pair of them, scores
    formed as real 2-vectors turned by an explicit rotation. q and k in rotate-half rows; q_slot [R/2, N, 2, H] and
    k_slot [R/2, 2, H] real (re, im) rows of the layer's rotated part, in the source's score units."""
    N, G, d = shape.heads, shape.kv_heads, shape.head_dim
    F = d // 2
    slot_of = {int(j): i for i, j in enumerate(frequencies)}
    qs = torch.stack([x @ q.view(N, d, -1)[:, :F].transpose(1, 2), x @ q.view(N, d, -1)[:, F:].transpose(1, 2)], -1)
    ks = torch.stack([x @ k.view(G, d, -1)[:, :F].transpose(1, 2), x @ k.view(G, d, -1)[:, F:].transpose(1, 2)], -1)
    # qs [N, T, F, 2], ks [G, T, F, 2]: the source's pairs at every token
    error, whole = torch.zeros(pairs, N, dtype=torch.float64), torch.zeros(pairs, N, dtype=torch.float64)
    kept, key_energy = torch.zeros(pairs, G, dtype=torch.float64), torch.zeros(pairs, G, dtype=torch.float64)
    for j in range(pairs):
        for h in range(N):
            g = h // shape.group
            source = [rotate(qs[h, :, j], a) @ ks[g, :, j].T for a in (0.0, math.pi / 2)]  # [T, T] each
            layer = [torch.zeros_like(source[0])] * 2
            if j in slot_of:
                qh, kk = x @ q_slot[slot_of[j], h].T, x @ k_slot[slot_of[j]].T  # [T, 2]
                layer = [rotate(qh, a) @ kk.T for a in (0.0, math.pi / 2)]
            # |c|² = Re(c)² + Im(c)²: the score difference at a turn of 0 and of a quarter
            error[j, h] = sum(((s - t) ** 2).mean() for s, t in zip(source, layer))
            whole[j, h] = sum((s ** 2).mean() for s in source)
        for g in range(G):
            z = torch.complex(ks[g, :, j, 0], ks[g, :, j, 1])
            key_energy[j, g] = z.abs().pow(2).mean()
            if j in slot_of:
                kk = x @ k_slot[slot_of[j]].T
                kappa = torch.complex(kk[:, 0], kk[:, 1])
                kept[j, g] = (z * kappa.conj()).mean().abs() ** 2 / kappa.abs().pow(2).mean()
    mu = mean[:, :pairs].T
    cost = 1 - mu.abs() ** 2
    query = torch.stack([torch.complex(qs[h, :, :pairs, 0], qs[h, :, :pairs, 1]).abs().pow(2).mean(0)
                         for h in range(N)], 1)  # [F, N]
    weight = torch.stack([(cost * query)[:, g * shape.group:(g + 1) * shape.group].sum(1) for g in range(G)], 1)
    return {
        "energy_kept": (kept.sum() / key_energy.sum()).item(),
        "per_frequency": ((weight * kept).sum(1) / (weight * key_energy).sum(1)).tolist(),
        "loss_weighted_kept": ((weight * kept).sum() / (weight * key_energy).sum()).item(),
        "score_loss": ((error * cost).sum() / whole.sum()).item(),
        "without_mean_rotation": ((error * (2 - 2 * mu.real)).sum() / whole.sum()).item(),
    }


def as_dict(figures) -> dict:
    return {"energy_kept": figures.energy_kept, "per_frequency": figures.energy_kept_per_frequency,
            "loss_weighted_kept": figures.loss_weighted_kept, "score_loss": figures.score.compensated,
            "without_mean_rotation": figures.score.uncompensated}


def assert_figures(measured: dict, expected: dict, rel: float) -> None:
    for name, value in expected.items():
        assert measured[name] == pytest.approx(value, rel=rel, abs=rel * 1e-3), name


def test_the_figures_are_the_score_errors_formed_pair_by_pair():
    """Any rotated part (random slots, not a closed form): the figures are what explicit scores on explicit rows
    give, with E over independent query and key tokens in their metric."""
    gen = torch.Generator().manual_seed(7)
    shape, pairs, T = AttentionShape(hidden=10, heads=4, kv_heads=2, head_dim=8), 3, 30  # pair 3 does not turn
    q, k = (torch.randn(n * 8, 10, generator=gen, dtype=torch.float64) for n in (4, 2))
    x = torch.randn(T, 10, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 2, 10, dtype=torch.float64)
    mean = torch.polar(torch.rand(4, 4, generator=gen, dtype=torch.float64),
                       torch.randn(4, 4, generator=gen, dtype=torch.float64))
    frequencies = torch.tensor([0, 2])
    q_slot = torch.randn(2, 4, 2, 10, generator=gen, dtype=torch.float64)
    k_slot = torch.randn(2, 2, 10, generator=gen, dtype=torch.float64)
    slots = RotatedSlots(frequencies, torch.complex(q_slot[:, :, 0], q_slot[:, :, 1]),
                         torch.complex(k_slot[:, 0], k_slot[:, 1]))
    measured = as_dict(rotary_figures(q, k, shape, pairs, slots, x.T @ x / T, mean))
    expected = sampled_figures(q, k, shape, pairs, frequencies, q_slot, k_slot, x, mean)
    assert_figures(measured, expected, rel=1e-9)
    assert measured["per_frequency"][1] == 0 and 0 < measured["score_loss"] < measured["without_mean_rotation"]


def test_the_closed_form_in_its_own_statistics_reports_what_its_construction_computes():
    """From the key mix's eigenvalues and remainders (``decompose_keys``, ``rope.unrotation_loss``) and from the
    compact layer's q_rope and k_rope rows alike."""
    gen = torch.Generator().manual_seed(1)
    shape = AttentionShape(hidden=24, heads=4, kv_heads=2, head_dim=16)

    def rows(n):
        return torch.randn(n, 24, generator=gen, dtype=torch.float64)

    src = SourceAttention(q=rows(64), k=rows(32), v=rows(32), o=rows(64).T.contiguous(),
                          input_norm=torch.rand(24, generator=gen, dtype=torch.float64) + 0.5)
    root = rows(24)
    stats = LayerStats(metric=root @ root.T / 24, rotation_mean=torch.polar(
        torch.rand(4, 8, generator=gen, dtype=torch.float64), rows(4)[:, :8]))
    options = LayerOptions(rank=20, rope_dim=8, rope_theta=10000.0, query_weighted_rope=True)
    analysis = analyse_layer(src, shape, options, stats)
    latent, _ = factor_attention(src, shape, options, stats)
    by_rows = rotary_figures(src.q, src.k, shape, 8, latent_slots(latent, shape, 8, analysis.choice.frequencies),
                             stats.metric, stats.rotation_mean)
    by_mix = rotary_figures(src.q, src.k, shape, 8, closed_form_slots(src.q, analysis.mix, analysis.choice,
                                                                      analysis.shared, shape),
                            stats.metric, stats.rotation_mean)
    group = torch.arange(4) // 2

    def energies(rows_, heads):  # E|z·x|² per pair and head [8, heads]
        return metric.energy(rope.complex_pairs(rows_, heads), stats.metric)

    loss = rope.unrotation_loss(energies(src.q, 4), energies(src.k, 2)[:, group],
                                energies(analysis.k_nope, 2)[:, group], stats.rotation_mean)
    construction = {"energy_kept": analysis.rope_energy_kept, "per_frequency": analysis.choice.energy_kept_per_frequency,
                    "loss_weighted_kept": analysis.choice.loss_weighted_kept, "score_loss": loss.compensated,
                    "without_mean_rotation": loss.uncompensated}
    for figures in (by_rows, by_mix):
        assert_figures(as_dict(figures), construction, rel=1e-10)
    rounded = [t.bfloat16() for t in (src.q, src.k)]  # a bfloat16 source's rows are measured as they are
    in_bfloat16 = rotary_figures(*rounded, shape, 8, closed_form_slots(rounded[0], analysis.mix, analysis.choice,
                                                                        analysis.shared, shape),
                                 stats.metric, stats.rotation_mean)
    assert in_bfloat16.energy_kept == pytest.approx(construction["energy_kept"], rel=0.05)
    assert 0.05 < construction["energy_kept"] < 0.95


# --- a calibrated conversion: each layer's own weights, on the audit windows ---------------------------------


def audit_statistics(src_folder, tokens, layer: int):
    """The attention inputs x [T, H] of ``layer`` on ``tokens`` and its attention profile μ [N, d/2], from
    transformers' own forward (hidden states and eager attention probabilities)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src_folder, attn_implementation="eager", dtype=torch.float64)
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True, output_attentions=True)
    block = model.model.layers[layer]
    x = block.input_layernorm(out.hidden_states[layer]).flatten(0, 1)  # [T, H]
    probs = out.attentions[layer]  # [B, N, S, S]
    S, config = tokens.shape[1], model.config
    d = config.hidden_size // config.num_attention_heads
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or config.rope_theta
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    distance = torch.arange(S)[:, None] - torch.arange(S)[None, :]  # m − n
    turn = torch.exp(-1j * distance[:, :, None] * freqs)  # [S, S, d/2]
    mean = torch.einsum("bhmn,mnf->hf", probs.to(torch.complex128), turn) / (tokens.shape[0] * S)
    return x, mean, block


def written_slots(mla, gamma, shape: AttentionShape, rope_dim: int):
    """A converted layer's rotated rows in the source's units: the rope rows of q_proj and kv_a_proj, read on the
    source's input (its input norm is a per-channel multiple of the source's), the query's softmax factor undone;
    (re, im) interleaved pairs → [R/2, N, 2, H] and [R/2, 2, H]."""
    N, d, R = shape.heads, shape.head_dim, rope_dim
    ratio = (mla.input_norm.double() / gamma.double())[None, :]
    q = mla.q_proj.double().view(N, d + R, -1)[:, d:] * ratio * math.sqrt(d / (d + R))  # [N, R, H]
    k = mla.kv_a_proj.double()[-R:] * ratio  # [R, H]
    return q.view(N, R // 2, 2, -1).transpose(0, 1), k.view(R // 2, 2, -1)


@pytest.fixture(scope="module")
def calibrated_layers(tmp_path_factory):
    """convert's calibrated steps on each layer of a small GQA model (16 windows: 8 fit, 4 select, 4 audit), at a
    rank low enough that 20 refinement steps beat the closed form on the select windows in both layers."""
    from helpers import make_model

    tmp = tmp_path_factory.mktemp("rope")
    src = make_model(tmp / "src", "llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=2)
    ids = torch.randint(0, 96, (16, 24), generator=torch.Generator().manual_seed(4))
    (tmp / "calib.jsonl").write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    options = ConvertOptions(rank=12, rope_dim=8, calib=[str(tmp / "calib.jsonl")], calib_window=24, refine_steps=20,
                             device="cpu")
    plan = plan_conversion(str(src), options)
    tokens = calibration_tokens(plan)
    streamer = calibration_streamer(plan, tokens)
    refinement = refinement_plan(plan, streamer)
    plan = with_rope_stride(plan)
    layers = [calibrate_layer(source, plan, True, refinement) for source in source_layers(plan.reader, plan.spec, streamer)]
    plan.reader.close()
    return src, plan, tokens, streamer.split, layers


def test_a_refined_layer_is_measured_from_its_own_weights_on_the_audit_windows(calibrated_layers):
    src, plan, tokens, split, layers = calibrated_layers
    shape, R = plan.shape, plan.layer.rope_dim
    frequencies = rope.kept_frequencies(R, plan.layer.rope_stride)
    refined_layers = [i for i, layer in enumerate(layers) if layer.refined is not None]
    assert refined_layers, "no layer refined: the test would check nothing"
    for i in refined_layers:
        layer = layers[i]
        audit_x, audit_mean, block = audit_statistics(src, tokens[list(split.audit)], i)
        fit_x, fit_mean, _ = audit_statistics(src, tokens[list(split.fit)], i)
        attention = block.self_attn
        q, k = attention.q_proj.weight.double(), attention.k_proj.weight.double()
        gamma = block.input_layernorm.weight
        pairs = shape.head_dim // 2
        for mla, report in ((layer.refined, layer.record.refined), (layer.closed, layer.record.closed)):
            q_slot, k_slot = written_slots(mla, gamma, shape, R)
            measured = {"energy_kept": report.rope_energy_kept, "per_frequency": report.rope_energy_kept_per_frequency,
                        "loss_weighted_kept": report.rope_loss_weighted_kept,
                        "score_loss": report.rope_score.compensated,
                        "without_mean_rotation": report.rope_score.uncompensated}
            assert_figures(measured, sampled_figures(q, k, shape, pairs, frequencies, q_slot, k_slot, audit_x,
                                                     audit_mean), rel=1e-4)
            in_fit = sampled_figures(q, k, shape, pairs, frequencies, q_slot, k_slot, fit_x, fit_mean)
            assert abs(measured["score_loss"] - in_fit["score_loss"]) > 1e-3  # not the fit windows' figure
        refined, closed = layer.record.refined, layer.record.closed
        # refinement moved the rotated rows, by 10× the agreement above: the refined layer's own figure is told
        # apart from the closed form's
        assert refined.rope_score.compensated != pytest.approx(closed.rope_score.compensated, rel=1e-3)
        assert refined.rope_energy_kept != pytest.approx(closed.rope_energy_kept, rel=1e-3)
