"""Absorbed MLA weights: the folding is exact math, the norm check is a real bound, the files say what they hold."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import make_model
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.mla.layer import MLAAttention, MLAShape
from mlaconv.mla.rope import rope_cos_sin
from mlaconv.runtime.attention import absorbed_attention, expanded_attention, latent_rows, standard_latent_rows
from mlaconv.target.absorb import MANIFEST, absorb_attention, latent_norm_bound, norm_nonlinearity, write_absorbed

F64 = torch.float64


def random_layer(shape: MLAShape, gen: torch.Generator, bias: bool) -> MLAAttention:
    H, N, r, R, P, V = shape.hidden, shape.heads, shape.rank, shape.rope_dim, shape.nope_dim, shape.v_dim

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=F64)

    return MLAAttention(
        q_proj=randn(N * (P + R), H), kv_a_proj=randn(r + R, H) * 1e-3, kv_a_norm=randn(r).abs() + 0.5,
        kv_b_proj=randn(N * (P + V), r), o_proj=randn(H, N * V), input_norm=randn(H).abs() + 0.5,
        kv_a_bias=randn(r + R) * 1e-3 if bias else None, o_bias=randn(H) if bias else None,
    )


shapes = st.builds(MLAShape, hidden=st.integers(2, 12), heads=st.integers(1, 4), rank=st.integers(1, 8),
                   rope_dim=st.sampled_from([2, 4, 6]), nope_dim=st.integers(1, 6), v_dim=st.integers(1, 6))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, batch=st.integers(1, 2), cached=st.integers(0, 5), new=st.integers(1, 4),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_absorbed_equals_expanded_attention_in_float64(shape, batch, cached, new, bias, seed):
    """Same cache rows and the same attention output, to 1e-10, for the linearised latent norm."""
    gen = torch.Generator().manual_seed(seed)
    std = random_layer(shape, gen, bias)
    absorbed = absorb_attention(std, shape)
    x = torch.randn(batch, cached + new, shape.hidden, generator=gen, dtype=F64)
    inv_freq = 10000.0 ** (-torch.arange(0, shape.rope_dim, 2, dtype=F64) / shape.rope_dim)
    cos, sin = rope_cos_sin(torch.arange(cached + new), inv_freq, F64)

    rows_expanded = standard_latent_rows(std, x, cos, sin, shape, linear_norm=True)  # [B, T, r+R]
    rows_absorbed = latent_rows(absorbed, x, cos, sin, shape.rank)
    assert torch.allclose(rows_absorbed, rows_expanded, rtol=1e-12, atol=1e-12 * rows_expanded.abs().max().item())

    new_x, new_cos, new_sin = x[:, cached:], cos[cached:], sin[cached:]
    expanded = expanded_attention(std, new_x, rows_expanded, new_cos, new_sin, shape)  # [B, S, H]
    out = absorbed_attention(absorbed, new_x, rows_absorbed, new_cos, new_sin, shape)
    assert out.shape == (batch, new, shape.hidden)
    assert (out - expanded).abs().max().item() <= 1e-10 * expanded.abs().max().item()


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), delta=st.sampled_from([1e-6, 1e-5, 1e-3]))
def test_latent_norm_bound_is_tight_and_caps_the_real_norm(shape, seed, delta):
    """The worst input reaches the bound; any input's RMSNorm stays within norm_nonlinearity of the linear map."""
    gen = torch.Generator().manual_seed(seed)
    std = random_layer(shape, gen, bias=False)
    # Scale the latent rows so that the bound is exactly delta.
    std.kv_a_proj[: shape.rank] *= math.sqrt(delta / latent_norm_bound(std, shape))
    assert latent_norm_bound(std, shape) == pytest.approx(delta, rel=1e-9)

    weighted = std.kv_a_proj[: shape.rank] * std.input_norm[None, :]
    worst_direction = torch.linalg.svd(weighted).Vh[0]  # unit vector in ĥ-space
    normalised = torch.stack([worst_direction, torch.randn(shape.hidden, generator=gen, dtype=F64)])
    normalised = normalised / normalised.norm(dim=-1, keepdim=True) * math.sqrt(shape.hidden)  # ‖ĥ‖² = H
    x = (normalised * std.input_norm)[None]  # [1, 2, H]
    latent = x @ std.kv_a_proj[: shape.rank].T
    mean_square = latent.pow(2).mean(-1) / LATENT_NORM_EPS  # [1, 2]
    assert mean_square[0, 0].item() == pytest.approx(delta, rel=1e-9)
    assert mean_square[0, 1].item() <= delta * (1 + 1e-9)

    cos, sin = rope_cos_sin(torch.arange(2), torch.ones(shape.rope_dim // 2, dtype=F64), F64)
    linear = standard_latent_rows(std, x, cos, sin, shape, linear_norm=True)[..., : shape.rank]
    real = standard_latent_rows(std, x, cos, sin, shape, linear_norm=False)[..., : shape.rank]
    gap = ((linear - real).norm(dim=-1) / linear.norm(dim=-1)).max().item()
    assert gap <= norm_nonlinearity(delta) * (1 + 1e-6)
    assert gap >= 0.5 * norm_nonlinearity(delta)  # the worst input does reach it


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("absorb")
    src = make_model(root / "src", kv_heads=2, head_dim=16, hidden=64)
    out = root / "out"
    report = convert(str(src), out, ConvertOptions(rank=24, rope_dim=16, verify=False))
    return out, report


def test_written_files_load_and_the_manifest_describes_them(converted):
    out, report = converted
    manifest = write_absorbed(out, out / "absorbed-test")
    folder = out / "absorbed-test"
    on_disk = json.loads((folder / MANIFEST).read_text())
    assert on_disk == {k: v for k, v in manifest.items() if k != "folder"}

    config = json.loads((out / "config.json").read_text())
    shape = MLAShape.from_config(config)
    H, N, r, R = shape.hidden, shape.heads, shape.rank, shape.rope_dim
    expected = {"rope.inv_freq": [R // 2]}
    for i in range(config["num_hidden_layers"]):
        expected.update({f"layers.{i}.q_latent": [N, r, H], f"layers.{i}.q_rope": [N * R, H],
                         f"layers.{i}.kv_down": [r + R, H], f"layers.{i}.o_latent": [H, N * r]})
    assert {name: entry["shape"] for name, entry in manifest["tensors"].items()} == expected

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for name, entry in manifest["tensors"].items():
        with safe_open(str(folder / entry["file"]), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        assert list(tensor.shape) == entry["shape"] and index[name] == entry["file"]
        assert str(tensor.dtype) == "torch." + entry["dtype"]
    assert manifest["dtype"] == "float32"
    assert manifest["cache"]["elements_per_token_per_layer"] == r + R == report.kv_elements_per_token_per_layer.converted
    assert manifest["softmax_scale"] == pytest.approx((shape.nope_dim + R) ** -0.5)
    assert manifest["rope"]["theta"] == config["rope_theta"]
    inv_freq = load_file(folder / manifest["tensors"]["rope.inv_freq"]["file"])["rope.inv_freq"]
    assert inv_freq.tolist() == pytest.approx(manifest["rope"]["inv_freq"], rel=1e-6)
    assert inv_freq.tolist() == pytest.approx([config["rope_theta"] ** (-2 * i / R) for i in range(R // 2)], rel=1e-6)
    assert 0 < manifest["latent_norm"]["max_relative_nonlinearity"] <= 1e-5


def absorbed_attention_by_hand(weights: dict, manifest: dict, i: int, x: torch.Tensor) -> torch.Tensor:
    """The manifest's formulas in plain PyTorch, float64, causal, positions 0..T-1: x [T, H] → [T, H]."""
    shape = manifest["shapes"]
    N, r, R = shape["num_heads"], shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    T = x.shape[0]
    layer = {name: weights[f"layers.{i}.{name}"].double() for name in ("q_latent", "q_rope", "kv_down", "o_latent")}
    angles = torch.arange(T, dtype=F64)[:, None] * weights["rope.inv_freq"].double()[None]  # [T, R/2]
    turn = torch.polar(torch.ones_like(angles), angles)

    def rotate(v):  # [T, ..., R] interleaved pairs (2i, 2i+1) as complex numbers, turned by position
        z = torch.view_as_complex(v.reshape(*v.shape[:-1], R // 2, 2).contiguous())
        return torch.view_as_real(z * turn.reshape(T, *([1] * (z.dim() - 2)), R // 2)).flatten(-2)

    q_latent = torch.einsum("nrh,th->tnr", layer["q_latent"], x)  # [T, N, r]
    q_rope = rotate((x @ layer["q_rope"].T).reshape(T, N, R))  # [T, N, R]
    row = x @ layer["kv_down"].T  # [T, r+R]
    latent, k_rope = row[:, :r], rotate(row[:, r:])
    scores = (torch.einsum("snr,tr->nst", q_latent, latent) + torch.einsum("snd,td->nst", q_rope, k_rope))
    scores = scores * manifest["softmax_scale"]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    mixed = torch.einsum("nst,tr->snr", scores.softmax(-1), latent)  # [T, N, r]
    return mixed.reshape(T, N * r) @ layer["o_latent"].T


def test_stored_absorbed_weights_compute_what_transformers_deepseek_v3_attention_computes(converted, tmp_path):
    """Independent reference: the stock DeepseekV3 attention of the checkpoint, through transformers."""
    from transformers import AutoModelForCausalLM

    out, _ = converted
    manifest = write_absorbed(out, tmp_path / "absorbed")
    weights = {}
    for entry in {entry["file"] for entry in manifest["tensors"].values()}:
        weights.update(load_file(tmp_path / "absorbed" / entry))
    model = AutoModelForCausalLM.from_pretrained(out).double().eval()
    seen = {}

    def capture(i):
        def hook(module, args, kwargs, output):
            seen[i] = (kwargs.get("hidden_states", args[0] if args else None)[0], output[0][0])
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(capture(i), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(5)))
    assert sorted(seen) == list(range(len(model.model.layers)))
    for i, (x, expected) in seen.items():
        got = absorbed_attention_by_hand(weights, manifest, i, x)
        assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item(), i


def test_default_folder_bfloat16_and_refusing_to_overwrite(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    convert(str(src), tmp_path / "out", ConvertOptions(rank=16, rope_dim=8, verify=False))
    manifest = write_absorbed(tmp_path / "out")
    assert manifest["folder"] == str(tmp_path / "out" / "absorbed")
    assert manifest["checkpoint"] == ".."  # relative: the pair can be moved together
    assert manifest["dtype"] == "bfloat16"
    assert {entry["dtype"] for name, entry in manifest["tensors"].items() if name.startswith("layers.")} == {"bfloat16"}
    with pytest.raises(MlaconvError, match="already exists"):
        write_absorbed(tmp_path / "out")
    write_absorbed(tmp_path / "out", force=True)


def test_attention_biases_are_absorbed(tiny_model, tmp_path):
    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16)
    convert(str(src), tmp_path / "out", ConvertOptions(rank=24, rope_dim=16, verify=False, target="transformers"))
    manifest = write_absorbed(tmp_path / "out")
    assert manifest["tensors"]["layers.0.kv_down_bias"]["shape"] == [24 + 16]
    assert manifest["tensors"]["layers.0.o_bias"]["shape"] == [64]


def test_a_latent_outside_the_tiny_regime_is_refused(converted, tmp_path):
    out, _ = converted
    import shutil

    copy = tmp_path / "big-latent"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("absorbed*"))
    shard = next(copy.glob("model-*.safetensors"))
    state = load_file(shard)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    state[name][:24] *= 1000.0  # mean(c²) grows 10⁶-fold: the norm is no longer linear
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(MlaconvError, match="layer 0: kv_a_layernorm is not a linear map"):
        write_absorbed(copy)
    assert not (copy / "absorbed").exists()


def test_convert_absorbed_flag_writes_the_artefact(stories, tmp_path):
    from mlaconv.conversion.options import ConvertOptions
    from mlaconv.conversion.run import convert

    report = convert(str(stories), tmp_path / "out", ConvertOptions(rank=16, verify=False, absorbed=True))
    assert (tmp_path / "out" / "absorbed" / "absorbed.json").is_file()
    assert report.absorbed.tensors == 4 * 5 + 1  # four per layer and the rope frequencies (no biases)
    assert 0 < report.absorbed.max_relative_nonlinearity < 1e-5
