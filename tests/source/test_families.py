"""The families beyond Llama/Mistral/Qwen2: exact where the layout allows, refused with the reason where not.

Tiny random models come from transformers' own config and model classes; the references are those classes
loaded through AutoModelForCausalLM, never our code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf

from helpers import logits, refusal, rel_err
from mlaconv.calibration.streamer import CalibrationOptions, SourceStreamer
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.io import CheckpointReader, read_config
from mlaconv.io.models import load_causal_lm
from mlaconv.mla.forward import rms_norm
from mlaconv.source.families import Family
from mlaconv.source.names import DOWN, EMBED, FINAL_NORM, GATE, LM_HEAD
from mlaconv.source.spec import SourceSpec
from mlaconv.source.weights import SourceWeights

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHORT_FACTORS = [1.0 + 0.3 * i for i in range(8)]
LONG_FACTORS = [2.0 + 0.5 * i for i in range(8)]


def longrope(pairs: int) -> dict:
    """A fresh LongRoPE setting for ``pairs`` rotating pairs (transformers completes the dict it is given in place)."""
    return {"rope_type": "longrope", "short_factor": SHORT_FACTORS[:pairs], "long_factor": LONG_FACTORS[:pairs]}


def build(path: Path, config: hf.PretrainedConfig, seed: int = 0) -> Path:
    """Save a random model of ``config``'s family (weights ~ N(0, 0.2), norms around 1) to ``path``."""
    torch.manual_seed(seed)
    model = hf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


# name → (config, full-rank shapes for an exact conversion). MQA everywhere: the shared RoPE key is then exact.
EXACT = {
    # Phi-4-mini's shape of things: q/k/v and gate/up fused, 3/4 of each head rotated, LongRoPE (attention factor √2).
    "phi3, partial rotary, longrope": (
        lambda: hf.Phi3Config(**COMMON, num_key_value_heads=1, partial_rotary_factor=0.75, rope_scaling=longrope(6),
                              original_max_position_embeddings=16), dict(rank=20, rope_dim=12)),
    # Phi-3.5-mini's: the whole head rotated, LongRoPE; R = 8 of 16 dims, so the rest lose rotation exactly.
    "phi3, longrope": (
        lambda: hf.Phi3Config(**COMMON, num_key_value_heads=1, original_max_position_embeddings=16,
                              rope_scaling=longrope(8)), dict(rank=16, rope_dim=16)),
    "granite, tied": (
        lambda: hf.GraniteConfig(**{**COMMON, "tie_word_embeddings": True}, num_key_value_heads=1,
                                 embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22,
                                 logits_scaling=8.0), dict(rank=16, rope_dim=16)),
    # Every second layer without RoPE: rank 2·d is those layers' full rank, the others' latents are zero-padded.
    "smollm3": (
        lambda: hf.SmolLM3Config(**{**COMMON, "num_hidden_layers": 4}, num_key_value_heads=1, no_rope_layer_interval=2),
        dict(rank=32, rope_dim=16)),
    "llama, head_dim 24 != hidden/heads": (
        lambda: hf.LlamaConfig(**COMMON, num_key_value_heads=1, head_dim=24), dict(rank=24, rope_dim=24)),
    "mistral, head_dim 8 != hidden/heads": (
        lambda: hf.MistralConfig(**COMMON, num_key_value_heads=1, head_dim=8, sliding_window=None),
        dict(rank=8, rope_dim=8)),
    "ministral": (
        lambda: hf.MinistralConfig(**COMMON, num_key_value_heads=1, head_dim=16, sliding_window=4096),
        dict(rank=16, rope_dim=16)),
}
SHORT = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))  # within LongRoPE's 16
LONG = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))  # past it: the long factors


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name.replace(" ", "_").replace(",", ""), config()) for name, (config, _) in EXACT.items()}


@pytest.mark.parametrize("name", EXACT)
def test_full_rank_mqa_conversion_is_exact(name, sources, tmp_path):
    src = sources[name]
    report = convert(str(src), tmp_path / "out", ConvertOptions(verify=False, **EXACT[name][1]))
    assert type(load_causal_lm(tmp_path / "out")).__name__ == "DeepseekV3ForCausalLM"
    assert report.energy_retained.mean == pytest.approx(1.0)
    assert report.rope_energy_kept == pytest.approx([1.0] * len(report.rope_energy_kept))
    for tokens in (SHORT, LONG):
        assert rel_err(logits(tmp_path / "out", tokens), logits(src, tokens)) <= 1e-4


@pytest.mark.parametrize("name", ["phi3, partial rotary, longrope", "granite, tied", "smollm3"])
def test_calibrated_full_rank_conversion_is_exact(name, sources, tmp_path):
    """The calibrated path (whitened metric, measured profile, streamed source forward) is exact too."""
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": torch.randint(0, VOCAB, (24,)).tolist()}) + "\n"
                             for _ in range(4)))
    report = convert(str(sources[name]), tmp_path / "out",
                     ConvertOptions(verify=False, calib=[str(calib)], calib_window=24, **EXACT[name][1]))
    assert report.mode == "calibrated"
    assert max(report.attention_error) < 1e-8
    assert rel_err(logits(tmp_path / "out", LONG), logits(sources[name], LONG)) <= 1e-4


@pytest.mark.parametrize("name", ["phi3, partial rotary, longrope", "phi3, longrope", "granite, tied", "smollm3"])
@pytest.mark.parametrize("length", [12, 40])
def test_streamed_source_forward_matches_transformers(name, length, sources):
    """Calibration runs the source one layer at a time through the family's canonical tensors: the result is
    what transformers computes (fused tensors split, multipliers folded, NoPE layers unrotated, LongRoPE's
    short and long factors)."""
    src = sources[name]
    spec = SourceSpec.from_config(read_config(src))
    reader = CheckpointReader(src)
    tokens = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(3))
    streamer = SourceStreamer(reader, spec, CalibrationOptions(tokens, batch_size=2))
    for i in range(spec.num_layers):
        attention = SourceWeights(reader, spec).attention(i)
        streamer.stats(i, attention)
        streamer.advance(i, attention)
    weights = SourceWeights(reader, spec)
    final = rms_norm(streamer.hidden, weights.tensor(None, FINAL_NORM), spec.rms_norm_eps)
    ours = final.double() @ weights.tensor(None, LM_HEAD).double().T
    assert rel_err(ours, logits(src, tokens)) <= 1e-5


def test_longrope_is_carried_over_at_the_kept_frequencies(sources, tmp_path):
    """The converted config keeps LongRoPE for the slots' source frequencies; its attention factor is folded."""
    convert(str(sources["phi3, longrope"]), tmp_path / "out", ConvertOptions(verify=False, rank=8, rope_dim=8))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["attention_factor"] == 1.0
    assert scaling["original_max_position_embeddings"] == 16 and len(scaling["short_factor"]) == 4
    stride = json.loads((tmp_path / "out" / "mlaconv.json").read_text())["rope_stride"]
    assert scaling["short_factor"] == pytest.approx([SHORT_FACTORS[stride * i] for i in range(4)])
    assert scaling["long_factor"] == pytest.approx([LONG_FACTORS[stride * i] for i in range(4)])


def test_smollm3_layers_without_rope_keep_no_rotated_key(sources, tmp_path):
    report = convert(str(sources["smollm3"]), tmp_path / "out", ConvertOptions(verify=False, rank=32, rope_dim=16))
    assert report.source_shape.layers_without_rope == [1, 3]
    from safetensors.torch import load_file

    tensors = {k: v for shard in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(shard).items()}
    for i in range(4):
        rope_rows = tensors[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"][32:]
        assert (rope_rows.abs().max() == 0) == (i in (1, 3))


def test_smollm3_rank_limit_counts_the_layers_without_rope(sources, tmp_path):
    with pytest.raises(MlaconvError, match="at most 32 for this model"):
        convert(str(sources["smollm3"]), tmp_path / "out", ConvertOptions(verify=False, rank=33, rope_dim=16))


def test_phi3_auto_map_to_transformers_own_code_converts_and_other_code_is_refused(tmp_path):
    src = build(tmp_path / "phi3", hf.Phi3Config(**COMMON, num_key_value_heads=2))
    config = json.loads((src / "config.json").read_text())
    upstreamed = {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    (src / "config.json").write_text(json.dumps(config | {"auto_map": upstreamed}))
    assert convert(str(src), tmp_path / "out", ConvertOptions(verify=False, rank=16)).architecture == "Phi-3"
    (src / "config.json").write_text(json.dumps(config | {"auto_map": {**upstreamed,
                                                                       "AutoModelForCausalLM": "modeling_x.Phi3X"}}))
    with pytest.raises(MlaconvError, match=r"custom code \(auto_map\)"):
        convert(str(src), tmp_path / "out2", ConvertOptions(verify=False, rank=16))


def test_longrope_refuses_the_absorbed_form(sources, tmp_path):
    with pytest.raises(MlaconvError, match="--absorbed is refused for this model: the absorbed form describes one set"):
        convert(str(sources["phi3, longrope"]), tmp_path / "out", ConvertOptions(verify=False, rank=8, absorbed=True))
    assert not (tmp_path / "out").exists()


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.mark.parametrize("config, reasons", [
    (lambda: hf.Olmo2Config(**SMALL), ["OLMo-2", "post-norms", "(q_norm, k_norm)", "over all heads at once"]),
    (lambda: hf.Gemma3TextConfig(**SMALL), ["Gemma-3", "sliding-window layers", "GeGLU", "q/k RMSNorm alone would"]),
    (lambda: hf.GemmaConfig(**SMALL), ["would fold exactly", "GeGLU MLP (gelu_pytorch_tanh)", "SiLU only"]),
    (lambda: hf.Gemma2Config(**SMALL), ["soft-capping", "sliding-window layers", "GeGLU"]),
    (lambda: hf.OlmoConfig(**SMALL), ["non-parametric LayerNorm"]),
    (lambda: hf.CohereConfig(**SMALL), ["LayerNorm", "parallel block"]),
    (lambda: hf.StableLmConfig(**SMALL), ["LayerNorm"]),
    (lambda: hf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
     ["LayerNorm", "parallel block", "GELU MLP"]),
    (lambda: hf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
     ["LayerNorm", "parallel block"]),
    (lambda: hf.PhiConfig(**SMALL), ["Phi-1/2", "LayerNorm", "parallel block"]),
    (lambda: hf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4), ["learned absolute position embeddings"]),
    (lambda: hf.MixtralConfig(**SMALL), ["mixture-of-experts"]),
    (lambda: hf.Qwen3MoeConfig(**SMALL), ["mixture-of-experts", "q/k RMSNorm alone would convert with calibration"]),
])
def test_refusals_name_the_reason(config, reasons):
    message = refusal(config())
    assert message.startswith("cannot convert model_type")
    for reason in reasons:
        assert reason in message, message


@pytest.mark.parametrize("change, reason", [
    (dict(partial_rotary_factor=0.5), "transformers' Llama rotates the whole head"),
    (dict(model_type="phi3", partial_rotary_factor=0.3125), "rotates 5 of 16 head dims; mlaconv needs an even number"),
    (dict(model_type="phi3", original_max_position_embeddings=16, rope_scaling={**longrope(8), "short_factor": [1.0]}),
     "rope_scaling.short_factor has 1 entries, the rotary dims need 8"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn' is not supported"),
    (dict(model_type="smollm3", no_rope_layers=[1]), "no_rope_layers must list 0 or 1 for each of the 2 layers"),
    (dict(model_type="granite", attention_multiplier=0), "attention_multiplier = 0 is not a positive number"),
    (dict(sliding_window=8, max_position_embeddings=256, model_type="mistral"), "sliding-window attention (window 8)"),
    (dict(model_type="gpt_bigcode"), "unsupported architecture 'gpt_bigcode'"),
])
def test_config_level_refusals(change, reason):
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 256}
    assert reason in refusal(base | change)


def test_gqa_partial_rotary_is_exact_when_each_rotated_frequency_is_one_key(tmp_path):
    """GQA Phi-3 whose KV heads agree, per rotated frequency, up to a complex factor: the shared key keeps every
    rotated component, and the unrotated dims (independent per head) go whole into the latent at no cost."""
    from safetensors.torch import load_file, save_file

    src = build(tmp_path / "phi3", hf.Phi3Config(**COMMON, num_key_value_heads=2, partial_rotary_factor=0.75))
    state = load_file(src / "model.safetensors")
    N, G, d, rot = 4, 2, 16, 12
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in state if n.endswith("qkv_proj.weight")]:
        k = state[name][N * d : (N + G) * d].reshape(G, d, -1)
        re, im = k[0, : rot // 2], k[0, rot // 2 : rot]
        coeff = torch.randn(G, rot // 2, 2, generator=gen)
        for g in range(1, G):
            cr, ci = coeff[g, :, 0:1], coeff[g, :, 1:2]
            k[g, :rot] = torch.cat([cr * re - ci * im, ci * re + cr * im])
        state[name][N * d : (N + G) * d] = k.reshape(G * d, -1)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    report = convert(str(src), tmp_path / "out", ConvertOptions(verify=False, rank=2 * G * d - rot, rope_dim=rot))
    assert report.rope_energy_kept == pytest.approx([1.0, 1.0], abs=1e-9)
    assert report.source_shape.rotary_dim == rot
    assert rel_err(logits(tmp_path / "out", SHORT), logits(src, SHORT)) <= 1e-4
    # With the rotated frequencies left as they were (heads not aligned), the shared key cannot keep them all.
    lossy = build(tmp_path / "phi3-lossy", hf.Phi3Config(**COMMON, num_key_value_heads=2, partial_rotary_factor=0.75))
    report = convert(str(lossy), tmp_path / "out2", ConvertOptions(verify=False, rank=2 * G * d - rot, rope_dim=rot))
    assert max(report.rope_energy_kept) < 0.99
    assert rel_err(logits(tmp_path / "out2", SHORT), logits(lossy, SHORT)) > 1e-3


@pytest.mark.parametrize("name", EXACT)
def test_a_float32_factorization_is_exact_to_float32_rounding(name, sources, tmp_path, monkeypatch):
    """The float32 factorization a 16-bit output gets (``weights_only.factor_precision``), forced here on a float32
    output so that nothing rounds it further: still exact through transformers."""
    from mlaconv.conversion import weights_only

    monkeypatch.setattr(weights_only, "factor_precision", lambda dtype: torch.float32)
    convert(str(sources[name]), tmp_path / "out", ConvertOptions(verify=False, **EXACT[name][1]))
    for tokens in (SHORT, LONG):
        assert rel_err(logits(tmp_path / "out", tokens), logits(sources[name], tokens)) <= 1e-4


def test_only_what_a_family_leaves_as_it_is_is_copied_unread(sources):
    """``SourceWeights.stored``: Phi-3's fused gate and Granite's folded multipliers (a tied head included) are read
    and changed; the rest is the checkpoint's own bytes."""
    def stored(name: str, i: int | None, key: str) -> bool:
        reader = CheckpointReader(sources[name])
        spec = SourceSpec.from_config(read_config(sources[name]))
        return SourceWeights(reader, spec).stored(i, key, torch.float32) is not None

    assert not stored("phi3, longrope", 0, GATE) and stored("phi3, longrope", 0, DOWN)
    assert stored("phi3, longrope", None, LM_HEAD) and stored("granite, tied", 1, GATE)
    assert not any(stored("granite, tied", i, key) for i, key in ((0, DOWN), (None, EMBED), (None, LM_HEAD)))
    assert stored("granite, tied", None, FINAL_NORM) and stored("smollm3", 3, DOWN)
    reader = CheckpointReader(sources["smollm3"])
    spec = SourceSpec.from_config(read_config(sources["smollm3"]))
    assert SourceWeights(reader, spec).stored(3, DOWN, torch.bfloat16) is None  # another dtype: read and cast


def test_a_family_that_reads_its_own_way_names_what_it_stores():
    """A tensor is copied unread by ``stored_name`` and ``factor``: a family that slices in ``read`` must say so in
    ``stored_name``, and folds go through ``factor`` (``modify`` applies it), never around it."""
    families = Family.__subclasses__()
    assert {f.__name__ for f in families} >= {"Phi3", "Granite", "SmolLM3"}
    for family in families:
        assert "modify" not in vars(family)
        assert ("read" in vars(family)) <= ("stored_name" in vars(family)), family.__name__
