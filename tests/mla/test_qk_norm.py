"""Qwen3's QK-norm (an RMSNorm on each query and key head before RoPE): the streamed source forward computes it as
transformers does, the linear stand-in the conversion factors is the least-squares fit of transformers' own
normalised heads, a model whose norms are constant on the data converts exactly, and weights-only is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf
from typer.testing import CliRunner

from helpers import logits, open_source, random_tokens, write_tokens
from mlaconv.calibration.streamer import CalibrationOptions, SourceStreamer
from mlaconv.cli import app
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.io.models import load_causal_lm
from mlaconv.mla.forward import rms_norm
from mlaconv.source.names import FINAL_NORM, LM_HEAD
from mlaconv.source.weights import SourceWeights

VOCAB = 96


@pytest.mark.parametrize("length", [12, 40])
def test_streamed_source_forward_matches_transformers(tiny_model, length):
    src = tiny_model(family="qwen3", kv_heads=2, head_dim=16)
    spec, reader = open_source(src)
    ids = random_tokens(3, length, VOCAB, seed=3)
    streamer = SourceStreamer(reader, spec, CalibrationOptions(ids, batch_size=2))
    for i in range(spec.num_layers):
        attention = SourceWeights(reader, spec).attention(i)
        assert attention.q_norm.shape == attention.k_norm.shape == (16,)
        streamer.stats(i, attention)
        streamer.advance(i, attention)
    final = rms_norm(streamer.hidden, reader.get(FINAL_NORM), spec.rms_norm_eps)
    ours = final.double() @ reader.get(LM_HEAD).double().T
    theirs = logits(src, ids)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5


def test_stand_in_is_the_least_squares_fit_of_transformers_normalised_heads(tiny_model):
    """Reference: the attention inputs and the outputs of transformers' q_norm / k_norm modules on the fit windows,
    caught by hooks, and torch.linalg.lstsq on them."""
    src = tiny_model(family="qwen3", kv_heads=2, head_dim=16)
    spec, reader = open_source(src)
    ids = random_tokens(6, 48, VOCAB, seed=4)
    model = load_causal_lm(src)
    caught: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def keep(key):
            return lambda module, args, output=None: caught.__setitem__(key, (args[0] if output is None else output))
        hooks += [layer.self_attn.q_proj.register_forward_pre_hook(keep((i, "x"))),
                  layer.self_attn.q_norm.register_forward_hook(keep((i, "q"))),
                  layer.self_attn.k_norm.register_forward_hook(keep((i, "k")))]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()

    streamer = SourceStreamer(reader, spec, CalibrationOptions(ids, batch_size=4))
    for i in range(spec.num_layers):
        attention = SourceWeights(reader, spec).attention(i)
        stats = streamer.stats(i, attention)
        linear = streamer.stand_in(i, attention, stats)
        assert linear.q_norm is None and linear.k_norm is None
        fit = list(streamer.split.fit)  # the stand-in is fitted on the fit windows only
        assert 0 < len(fit) < ids.shape[0]
        x = caught[(i, "x")][fit].flatten(0, 1).double()  # [tokens, H]
        for name, ours in (("q", linear.q), ("k", linear.k)):
            normalised = caught[(i, name)][fit].flatten(0, 1).flatten(1).double()  # [tokens, heads·d]
            reference = torch.linalg.lstsq(x, normalised).solution.T  # [heads·d, H]
            assert ((ours - reference).abs().max() / reference.abs().max()).item() <= 1e-4
            fitted = (x @ reference.T - normalised).pow(2).sum() / normalised.pow(2).sum()
            assert 1e-4 < fitted.item() < 1  # the norm is far from linear in a random model, and the fit explains it
        streamer.advance(i, attention)


def constant_norm_qwen3(path: Path) -> Path:
    """A Qwen3 (MQA, head_dim = hidden) whose per-head norms are constant on any input: unit input norms make
    x = ĥ with ‖ĥ‖² ≈ H, and each head's q/k projection is orthogonal, so rms(W_h x) = rms(x) ≈ 1."""
    config = hf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = hf.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "input_layernorm" in name:
                p.fill_(1.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = p.shape[0] // 32
                p.copy_(torch.cat([torch.linalg.qr(torch.randn(32, 32))[0] for _ in range(heads)]))
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def test_constant_norms_convert_exactly_through_the_public_loader(tmp_path):
    src = constant_norm_qwen3(tmp_path / "src")
    calib = write_tokens(tmp_path / "calib.jsonl", random_tokens(8, 32, VOCAB, seed=5))
    report = convert(str(src), tmp_path / "out", ConvertOptions(rank=32, rope_dim=32, verify=False, calib=[str(calib)],
                                                                calib_window=32))
    assert type(load_causal_lm(tmp_path / "out")).__name__ == "DeepseekV3ForCausalLM"
    assert max(report.attention_error) < 1e-8
    ids = random_tokens(2, 40, VOCAB, seed=6)
    theirs = logits(src, ids)
    assert ((logits(tmp_path / "out", ids) - theirs).abs().max() / theirs.abs().max()).item() <= 1e-4


def test_calibrated_conversion_is_measured_against_the_true_norms(tiny_model, tmp_path):
    """At full rank the only loss is the stand-in's: the report's attention errors measure it against the
    QK-normed source (not zero), and the converted checkpoint loads as DeepSeek-V3."""
    src = tiny_model(family="qwen3", kv_heads=1, head_dim=16)
    calib = write_tokens(tmp_path / "calib.jsonl", random_tokens(8, 32, VOCAB, seed=7))
    report = convert(str(src), tmp_path / "out", ConvertOptions(rank=16, rope_dim=16, verify=False,
                                                                calib=[str(calib)], calib_window=32))
    assert report.architecture == "Qwen3" and report.mode == "calibrated"
    assert all(1e-4 < error < 1 for error in report.attention_error)
    assert any(w.startswith("the source's RMSNorm on each query and key head (QK-norm)") for w in
               report.serving.warnings)
    assert "QK-norm" in (tmp_path / "out" / "README.md").read_text()  # the model card says it too
    assert type(load_causal_lm(tmp_path / "out")).__name__ == "DeepseekV3ForCausalLM"


def test_weights_only_conversion_is_refused_in_one_line(tiny_model, tmp_path):
    src = tiny_model(family="qwen3", kv_heads=2, head_dim=16)
    for command in (["convert", str(src), str(tmp_path / "out"), "--kv-keep", "0.5", "--json"],
                    ["inspect", "spectra", str(src), "--json"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 1
        error = json.loads(result.stdout.strip().splitlines()[-1])
        assert error["kind"] == "input"
        assert error["error"].startswith("Qwen3 RMS-normalises each query and key head (q_norm, k_norm)")
        assert "needs calibration data (--calib FILE or --calib-dataset NAME)" in error["error"]
    assert not (tmp_path / "out").exists()
