"""bench.real.loss_by_component puts a broken tensor's loss on the component that holds it, and nowhere else."""

from __future__ import annotations

import torch

from bench.real.loss_by_component import MODES, Components, bucket_means
from helpers import make_model, random_tokens, rel_err
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.io.models import load_causal_lm

TOKENS = random_tokens(1, 48, seed=3)


def component_logits(source_dir, converted) -> dict[str, torch.Tensor]:
    components = Components(load_causal_lm(source_dir), converted)
    return {mode: components.logits(TOKENS, mode).double() for mode in MODES}


def test_each_mode_sees_only_the_tensors_it_converts(tmp_path):
    source_dir = make_model(tmp_path / "src", kv_heads=1, head_dim=16)  # MQA with R = d: the conversion is exact
    convert(str(source_dir), tmp_path / "out", ConvertOptions(rank=16, rope_dim=16, verify=False))
    with torch.no_grad():
        reference = load_causal_lm(source_dir)(TOKENS).logits.double()
    exact = component_logits(source_dir, load_causal_lm(tmp_path / "out"))
    assert max(rel_err(exact[mode], reference) for mode in MODES) <= 1e-4

    broken_values = load_causal_lm(tmp_path / "out")
    for layer in broken_values.model.layers:  # kv_b_proj rows per head: [k_nope (16); v (16)]
        attn = layer.self_attn
        rows = attn.kv_b_proj.weight.data.view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, -1)
        rows[:, attn.qk_nope_head_dim:] *= 0.5
    got = component_logits(source_dir, broken_values)
    assert rel_err(got["exact"], reference) <= 1e-4 and rel_err(got["scores"], reference) <= 1e-4
    assert rel_err(got["values"], reference) > 1e-2 and rel_err(got["converted"], reference) > 1e-2

    broken_scores = load_causal_lm(tmp_path / "out")
    for layer in broken_scores.model.layers:  # q_proj rows per head: [q_nope (16); q_pe (16)]
        attn = layer.self_attn
        rows = attn.q_proj.weight.data.view(attn.num_heads, attn.qk_head_dim, -1)
        rows[:, attn.qk_nope_head_dim:] *= 3.0
    got = component_logits(source_dir, broken_scores)
    assert rel_err(got["exact"], reference) <= 1e-4 and rel_err(got["values"], reference) <= 1e-4
    assert rel_err(got["scores"], reference) > 1e-2 and rel_err(got["converted"], reference) > 1e-2


def test_positions_are_averaged_per_bucket_and_over_all():
    values = torch.cat([torch.zeros(2, 512), torch.ones(2, 1536), torch.full((2, 2048), 3.0)], dim=1).double()
    assert bucket_means(values) == {"all": (1536 + 3 * 2048) / 4096, "0-512": 0.0, "512-2048": 1.0,
                                    "2048-4096": 3.0}
    assert bucket_means(values[:, :600]) == {"all": 88 / 600, "0-512": 0.0, "512-600": 1.0}
