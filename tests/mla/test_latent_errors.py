"""key_error and value_error: relative errors through the latent, and what they read on a block without energy.

An MQA layer whose one key head is rotated in every dimension leaves nothing for the NoPE key: its target is
rounding noise, and the reconstruction's noise over it read 10 on an exactly converted layer. Such a block is
measured against 1e-9 of the other block's energy (``latent_errors``), so an exact layer reads 0."""

from __future__ import annotations

import pytest
import torch
import transformers as hf

from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.mla.attention import latent_errors

H, D, R = 32, 8, 6


def factors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    down = torch.randn(R, H, generator=g, dtype=torch.float64)
    up_v = torch.randn(D, R, generator=g, dtype=torch.float64)
    return down, up_v, up_v @ down  # an exact value block


def test_a_key_of_rounding_noise_reconstructed_as_noise_reads_zero():
    down, up_v, v = factors()
    metric = torch.ones(H, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    k_nope = 1e-17 * torch.randn(D, H, generator=g, dtype=torch.float64)  # no energy: rounding noise
    up_k = 1e-17 * torch.randn(D, R, generator=g, dtype=torch.float64)  # its "reconstruction": other noise
    key_error, value_error, energy = latent_errors(k_nope, v, up_k, up_v, down, metric)
    assert key_error < 1e-12 and value_error < 1e-12 and energy == pytest.approx(1.0)


def test_a_key_without_energy_that_the_latent_fills_reads_large():
    down, up_v, v = factors()
    up_k = 1e-2 * torch.randn(D, R, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    key_error, _, energy = latent_errors(torch.zeros(D, H, dtype=torch.float64), v, up_k, up_v, down,
                                         torch.ones(H, dtype=torch.float64))
    assert key_error > 1e3  # energy the source does not have, against 1e-9 of the values'
    assert energy == pytest.approx(1.0)  # energy_retained leaves the empty block out, as before


def test_a_key_with_energy_keeps_its_relative_error():
    down, up_v, v = factors()
    k_nope = torch.randn(D, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    up_k = torch.zeros(D, R, dtype=torch.float64)
    key_error, _, energy = latent_errors(k_nope, v, up_k, up_v, down, torch.ones(H, dtype=torch.float64))
    assert key_error == pytest.approx(1.0) and energy == pytest.approx(0.5)
    assert latent_errors(torch.zeros(D, H), torch.zeros(D, H), torch.zeros(D, R), torch.zeros(D, R),
                         torch.zeros(R, H), torch.ones(H))[:2] == (0.0, 0.0)  # nothing at all: no error


def test_an_exact_mqa_smollm3_conversion_reports_no_key_error(tmp_path):
    """SmolLM3 with one KV head, every second layer without RoPE, at r = 2·d: exact in every layer. In the layers
    with RoPE the whole key head is the shared rotated key, so the NoPE key has no energy (key_error read 10.3)."""
    config = hf.SmolLM3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=1, no_rope_layer_interval=2,
                              max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "src")
    report = convert(str(tmp_path / "src"), tmp_path / "out", ConvertOptions(verify=False, rank=32, rope_dim=16))
    assert report.source_shape.layers_without_rope == [1, 3]
    assert max(report.key_error) < 1e-9 and max(report.value_error) < 1e-9
    assert report.energy_retained.per_layer == pytest.approx([1.0] * 4)
