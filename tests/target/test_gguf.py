"""``mlaconv export gguf`` checked in a real engine: llama.cpp (llama-cpp-python 0.3.36) against transformers.

Every model here runs in llama.cpp's own deepseek2 graph with its MLA cache, on token ids, and its
perplexity and logits are compared with the same checkpoint (and, for exact conversions, the
source) in transformers. Tokenizers are checked against Hugging Face ``tokenizers`` or a hand
derivation.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import llama_cpp  # a hard dependency of these tests: the dev extra installs llama-cpp-python
import numpy as np
import pytest
import torch

from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.evaluate.llamacpp import nll_sum, open_engine
from mlaconv.io.models import load_causal_lm
from mlaconv.target.gguf import export_gguf

from helpers import STORIES, invoke, make_model


RANDOM_WINDOWS = [torch.randint(0, 96, (160,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
STORY_WINDOWS = [json.loads(line)["input_ids"] for line in (STORIES / "samples.jsonl").read_text().splitlines()[:6]]


def run_convert(src: Path, out: Path, **options) -> Path:
    convert(str(src), out, ConvertOptions(verify=False, **options))
    return out


def transformers_logits(folder: Path, windows) -> list[np.ndarray]:
    model = load_causal_lm(folder, torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([w])).logits[0].double().numpy() for w in windows]


def llamacpp_logits(path: Path, windows, f32_cache: bool = True) -> list[np.ndarray]:
    with open_engine(path, n_ctx=max(map(len, windows)), f32_cache=f32_cache) as engine:
        return [engine.logits(w) for w in windows]


def ppl(logits: list[np.ndarray], windows) -> float:
    return math.exp(sum(nll_sum(x, w) for x, w in zip(logits, windows)) / sum(len(w) - 1 for w in windows))


def max_rel_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def stories_lossy(tmp_path_factory) -> Path:
    return run_convert(STORIES, tmp_path_factory.mktemp("stories") / "r16", rank=16)


def test_exact_conversion_in_llamacpp_reproduces_the_source(tmp_path):
    """Full-rank MQA: llama.cpp's deepseek2 on the export computes the source model (transformers)."""
    src = make_model(tmp_path / "src", kv_heads=1, head_dim=16)
    out = run_convert(src, tmp_path / "out", rank=16, rope_dim=16)
    report = export_gguf(out, tmp_path / "m.gguf")
    assert report["kv_cache_elements_per_token_per_layer"] == 32 and report["kept_float32"] == []
    engine = llamacpp_logits(tmp_path / "m.gguf", RANDOM_WINDOWS)
    source = transformers_logits(src, RANDOM_WINDOWS)
    converted = transformers_logits(out, RANDOM_WINDOWS)
    assert abs(ppl(engine, RANDOM_WINDOWS) / ppl(source, RANDOM_WINDOWS) - 1) < 1e-3
    assert abs(ppl(engine, RANDOM_WINDOWS) / ppl(converted, RANDOM_WINDOWS) - 1) < 1e-3
    assert max_rel_diff(engine, source) < 1e-3


def test_lossy_stories_in_llamacpp_matches_transformers(stories_lossy, tmp_path):
    """The real bundled model at r = 16: same perplexity and logits in llama.cpp as in transformers."""
    report = export_gguf(stories_lossy, tmp_path / "s.gguf")
    assert report["tensor_types"] == {"F32": report["tensors"]} and report["vocab"]["model"] == "none"
    engine = llamacpp_logits(tmp_path / "s.gguf", STORY_WINDOWS)
    reference = transformers_logits(stories_lossy, STORY_WINDOWS)
    assert abs(ppl(engine, STORY_WINDOWS) / ppl(reference, STORY_WINDOWS) - 1) < 1e-3
    assert max_rel_diff(engine, reference) < 1e-4
    with open_engine(tmp_path / "s.gguf", n_ctx=256) as engine:  # the MLA cache: r + R values, one "head", f32
        assert engine.kv_cache_mib == pytest.approx(256 * 5 * (16 + 8) * 4 / 2**20, abs=0.01)


def test_a_healed_model_runs_in_llamacpp_as_in_transformers(stories_lossy, tmp_path):
    """``mlaconv heal`` keeps the stock layout: its output exports and llama.cpp computes what transformers does."""
    from mlaconv.calibration.windows import CalibrationData
    from mlaconv.heal import HealOptions, heal

    samples = STORIES / "samples.jsonl"
    report = heal(stories_lossy, str(STORIES), tmp_path / "healed", CalibrationData((str(samples),), None, "samples"),
                  HealOptions(window=128, tokens=4 * 128 * 8, lr=0.01, check_every=4))
    assert report.best_step > 0  # the weights did change
    export_gguf(tmp_path / "healed", tmp_path / "h.gguf")
    engine = llamacpp_logits(tmp_path / "h.gguf", STORY_WINDOWS)
    reference = transformers_logits(tmp_path / "healed", STORY_WINDOWS)
    assert abs(ppl(engine, STORY_WINDOWS) / ppl(reference, STORY_WINDOWS) - 1) < 1e-3
    assert max_rel_diff(engine, reference) < 1e-4
    assert max_rel_diff(reference, transformers_logits(stories_lossy, STORY_WINDOWS)) > 1e-3


def test_linear_rope_scaling_is_reproduced(tmp_path):
    """llama.cpp scales deepseek2 scores by (1 + 0.1 ln 4)² under linear scaling; the folded attn_q cancels it."""
    src = make_model(tmp_path / "src", kv_heads=1, head_dim=16, rope_scaling={"rope_type": "linear", "factor": 4.0})
    out = run_convert(src, tmp_path / "out", rank=16, rope_dim=16)
    report = export_gguf(out, tmp_path / "m.gguf")
    assert report["q_scale_folded"] == pytest.approx(1 / (1 + 0.1 * math.log(4)) ** 2)
    engine = llamacpp_logits(tmp_path / "m.gguf", RANDOM_WINDOWS)
    source = transformers_logits(src, RANDOM_WINDOWS)
    assert abs(ppl(engine, RANDOM_WINDOWS) / ppl(source, RANDOM_WINDOWS) - 1) < 1e-3
    assert max_rel_diff(engine, source) < 1e-3


def test_zero_biases_export_and_nonzero_biases_are_refused(tmp_path):
    """Qwen2 outputs for --target transformers carry kv_a / o_proj biases that deepseek2 lacks: fine when zero,
    refused otherwise."""
    zero = make_model(tmp_path / "zero", "qwen2", kv_heads=1, head_dim=16)
    from safetensors.torch import load_file, save_file

    state = load_file(zero / "model.safetensors")
    save_file({n: torch.zeros_like(t) if n.endswith(".bias") else t for n, t in state.items()},
              zero / "model.safetensors", metadata={"format": "pt"})
    out = run_convert(zero, tmp_path / "zero_out", rank=16, rope_dim=16, target="transformers")
    export_gguf(out, tmp_path / "zero.gguf")
    engine = llamacpp_logits(tmp_path / "zero.gguf", RANDOM_WINDOWS)
    assert abs(ppl(engine, RANDOM_WINDOWS) / ppl(transformers_logits(zero, RANDOM_WINDOWS), RANDOM_WINDOWS) - 1) < 1e-3

    biased = make_model(tmp_path / "biased", "qwen2", kv_heads=1, head_dim=16)
    out = run_convert(biased, tmp_path / "biased_out", rank=16, rope_dim=16, target="transformers")
    with pytest.raises(MlaconvError, match=r"attention bias tensors are not zero \(.*kv_a_proj_with_mqa.bias"):
        export_gguf(out, tmp_path / "biased.gguf")
    assert not (tmp_path / "biased.gguf").exists()


def test_q8_0_penalty_exact_and_lossy(stories_lossy, tmp_path):
    """q8_0 through gguf-py costs little perplexity on the source-equivalent (exact) and the lossy export alike,
    with every matrix rounded: the conversion's input scale keeps attn_kv_a_mqa's rows within q8_0's range."""
    src = make_model(tmp_path / "src", kv_heads=1, head_dim=16, hidden=128)
    exact = run_convert(src, tmp_path / "exact", rank=16, rope_dim=16)
    penalties = {}
    for label, folder, windows in (("exact", exact, RANDOM_WINDOWS), ("lossy", stories_lossy, STORY_WINDOWS)):
        full = export_gguf(folder, tmp_path / f"{label}-f32.gguf")
        quant = export_gguf(folder, tmp_path / f"{label}-q8_0.gguf", outtype="q8_0")
        assert quant["tensor_types"]["Q8_0"] > 0
        assert not [name for name in quant["kept_float32"] if "attn_kv_a_mqa" in name], quant["kept_float32"]
        assert quant["bytes"] < 0.5 * full["bytes"]
        f32_ppl = ppl(llamacpp_logits(tmp_path / f"{label}-f32.gguf", windows), windows)
        q8_ppl = ppl(llamacpp_logits(tmp_path / f"{label}-q8_0.gguf", windows), windows)
        penalties[label] = q8_ppl / f32_ppl - 1
    # the source stories260K itself loses 4.7% under llama.cpp's q8_0 (bench/README.md)
    assert abs(penalties["exact"]) < 0.01 and abs(penalties["lossy"]) < 0.02, penalties


def test_the_row_guard_keeps_a_tensor_the_type_cannot_hold(stories_lossy, tmp_path):
    """A checkpoint whose kv_a rows are ~1e-7 (as an unscaled latent would be): q8_0's f16 block scales would
    zero them, so the export keeps that tensor f32 and names it; without the guard the model breaks."""
    from safetensors.torch import load_file, save_file

    tiny = tmp_path / "tiny"
    shutil.copytree(stories_lossy, tiny)
    shard = next(tiny.glob("*.safetensors"))
    state = load_file(shard)
    rank = json.loads((tiny / "config.json").read_text())["kv_lora_rank"]
    kv_a, norm = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"
    state[kv_a][:rank] *= 2.0**-16  # the latent stays far below the norm's ε: the norm is linear, so ×2^16 undoes it
    state[norm] *= 2.0**16
    save_file(state, shard, metadata={"format": "pt"})
    full = ppl(llamacpp_logits(export_gguf(tiny, tmp_path / "f32.gguf")["output"], STORY_WINDOWS), STORY_WINDOWS)
    quant = export_gguf(tiny, tmp_path / "q8_0.gguf", outtype="q8_0")
    assert quant["kept_float32"] == ["blk.0.attn_kv_a_mqa.weight"] and quant["worst_row_error"] <= 0.05
    guarded = ppl(llamacpp_logits(tmp_path / "q8_0.gguf", STORY_WINDOWS), STORY_WINDOWS)
    unguarded = export_gguf(tiny, tmp_path / "q8_0-unguarded.gguf", outtype="q8_0", row_error_limit=math.inf)
    assert unguarded["kept_float32"] == []
    broken = ppl(llamacpp_logits(tmp_path / "q8_0-unguarded.gguf", STORY_WINDOWS), STORY_WINDOWS)
    reference = ppl(llamacpp_logits(export_gguf(stories_lossy, tmp_path / "r.gguf")["output"], STORY_WINDOWS),
                    STORY_WINDOWS)
    assert abs(full / reference - 1) < 1e-3  # the rescaled checkpoint computes the same model
    assert abs(guarded / full - 1) < 0.02 < broken / full - 1, (guarded, broken, full)


def test_half_precision_exports_run(stories_lossy, tmp_path):
    """bf16 and f16 exports load, round every matrix, and stay close to the f32 perplexity."""
    reference = ppl(transformers_logits(stories_lossy, STORY_WINDOWS), STORY_WINDOWS)
    for outtype in ("bf16", "f16"):
        report = export_gguf(stories_lossy, tmp_path / f"{outtype}.gguf", outtype=outtype)
        assert report["tensor_types"].get(outtype.upper(), 0) > 0
        assert not [name for name in report["kept_float32"] if "attn_kv_a_mqa" in name], report["kept_float32"]
        got = ppl(llamacpp_logits(tmp_path / f"{outtype}.gguf", STORY_WINDOWS), STORY_WINDOWS)
        assert abs(got / reference - 1) < 0.02, (outtype, got, reference)


# ---- tokenizers ----

LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
TEXTS = ["Hello world, it's 2024!\nThe quick brown fox jumps.", "  spaces   and\ttabs 1234567 can't won't",
         "Ünïcödé café naïve — 東京 🙂", "numbers 3.14159 and 1,000,000\n\n\nnew lines"]


@pytest.fixture(scope="module")
def tiny_out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    src = make_model(root / "src", kv_heads=1, head_dim=16, vocab=400)
    return run_convert(src, root / "out", rank=16, rope_dim=16)


def _bpe_tokenizer(kind: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(ignore_merges=kind == "llama-bpe"))
    if kind == "gpt-2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        regex = LLAMA3 if kind == "llama-bpe" else QWEN2
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = (STORIES / "README.md").read_text() * 3 + " ".join(TEXTS)
    tokenizer.train_from_iterator([corpus], trainer)
    return tokenizer


@pytest.mark.parametrize("kind", ["llama-bpe", "qwen2", "gpt-2"])
def test_bpe_tokenizer_matches_hugging_face(kind, tiny_out, tmp_path):
    """llama.cpp tokenizes like the tokenizer.json it was exported from (Llama 3, Qwen2, GPT-2 pre-tokenizers)."""
    folder = Path(shutil.copytree(tiny_out, tmp_path / "out"))
    tokenizer = _bpe_tokenizer(kind)
    tokenizer.save(str(folder / "tokenizer.json"))
    report = export_gguf(folder, tmp_path / "m.gguf")
    assert report["vocab"] == {"model": "gpt2", "pre": kind, "tokens": 400}
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            expected = tokenizer.encode(text, add_special_tokens=False).ids
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == expected, text
            assert llm.detokenize(expected).decode() == text
        assert llm.tokenize(b"<|end|>", add_bos=False, special=True) == [tokenizer.token_to_id("<|end|>")]
    finally:
        llm.close()


def _proto_field(number: int, wire: int, payload: bytes) -> bytes:
    def varint(n: int) -> bytes:
        out = b""
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out

    body = payload if wire != 2 else varint(len(payload)) + payload
    return varint(number << 3 | wire) + body


def _sentencepiece_model(pieces: list[tuple[str, float, int]]) -> bytes:
    """A tokenizer.model written from the published sentencepiece_model.proto field numbers."""
    data = b""
    for text, score, kind in pieces:
        piece = (_proto_field(1, 2, text.encode()) + _proto_field(2, 5, struct.pack("<f", score))
                 + _proto_field(3, 0, bytes([kind])))
        data += _proto_field(1, 2, piece)
    normalizer = _proto_field(3, 0, b"\x01") + _proto_field(4, 0, b"\x01")  # add_dummy_prefix, remove_extra_ws
    return data + _proto_field(3, 2, normalizer)


def test_sentencepiece_tokenizer_model(tiny_out, tmp_path):
    """A tokenizer.model read from its protobuf: llama.cpp merges by score and falls back to bytes, as derived by hand."""
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    words = ["▁h", "▁he", "▁hel", "▁hell", "▁hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world"]
    pieces += [("▁", -1.0, 1)] + [(c, -2.0, 1) for c in "helowrd"] + [(w, -10.0 + len(w), 1) for w in words]
    folder = Path(shutil.copytree(tiny_out, tmp_path / "out"))
    (folder / "tokenizer.model").write_bytes(_sentencepiece_model(pieces))
    report = export_gguf(folder, tmp_path / "m.gguf")
    assert report["vocab"] == {"model": "llama", "pre": None, "tokens": 400}
    ids = {text: i for i, (text, _, _) in enumerate(pieces)}
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    try:
        assert llm.tokenize(b"hello world", add_bos=False) == [ids["▁hello"], ids["▁world"]]
        assert llm.tokenize(b"hi!", add_bos=False) == [ids["▁h"], ids["<0x69>"], ids["<0x21>"]]
        assert llm.tokenize(b"hello", add_bos=True)[0] == ids["<s>"]
        assert llm.detokenize([ids["▁hello"], ids["▁world"]]) == b" hello world"  # ▁ pieces carry their space
    finally:
        llm.close()


# ---- the command line ----

def cli(*args):
    return invoke("export", "gguf", *args)


def test_cli_writes_atomically_and_refuses_to_overwrite(stories_lossy, tmp_path):
    target = tmp_path / "s.gguf"
    result = cli(stories_lossy, target, "--outtype", "q8_0", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["output"] == str(target) and report["bytes"] == target.stat().st_size
    assert report["llama_cpp_checked"].startswith("llama.cpp 0c1e57098")
    before = target.read_bytes()
    again = cli(stories_lossy, target, "--json")
    assert again.exit_code == 1
    assert json.loads(again.stdout.strip()) == {"error": f"{target} already exists; pass --force to replace it",
                                                "kind": "input"}
    assert again.stderr.strip() == f"error: {target} already exists; pass --force to replace it"
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.gguf"]
    default = cli(stories_lossy)
    assert default.exit_code == 0 and (stories_lossy.parent / "r16-f32.gguf").is_file()


def test_cli_refuses_llama3_rope_scaling_in_one_line(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    src = make_model(tmp_path / "src", kv_heads=1, head_dim=16, rope_scaling=scaling, rope_theta=500000.0)
    out = run_convert(src, tmp_path / "out", rank=16, rope_dim=16, target="transformers")  # llama3 kept as is
    result = cli(out, tmp_path / "m.gguf", "--json")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rope_scaling llama3 cannot be reproduced")
    assert json.loads(result.stdout)["error"].startswith("rope_scaling llama3")
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob(".m.gguf*"))
    portable = run_convert(src, tmp_path / "portable", rank=16, rope_dim=16)  # llama3 written as yarn
    result = cli(portable, tmp_path / "m.gguf", "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["error"].startswith("rope_scaling 'yarn'")
    assert not (tmp_path / "m.gguf").exists()


def test_cli_refuses_a_source_checkpoint(tmp_path):
    result = cli(STORIES, tmp_path / "m.gguf")
    assert result.exit_code == 1
    assert result.stderr.strip() == ("error: model_type 'llama' is not deepseek_v3: export gguf takes the output "
                                     "folder of mlaconv convert")
