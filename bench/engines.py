#!/usr/bin/env python
"""llama.cpp (llama-cpp-python 0.3.36, CPU): the source model versus its MLA conversion.

For each model, the source is written as a plain llama-architecture GGUF by this script (q/k rows
permuted from Hugging Face's rotate-half order to llama.cpp's interleaved pairs; no tokenizer) and
the conversion by ``mlaconv export gguf``. Then, all in llama.cpp:

- perplexity on token ids (stories260K: its bundled samples) in f32, q8_0 (gguf-py, via the export)
  and Q4_K_M (llama.cpp's own ``llama_model_quantize``), and for the conversion Q4_K_M also with
  ``attn_kv_a_mqa`` overridden to f32, next to transformers on the same ids;
- decode tokens/s after a prompt of 1K / 4K / 16K tokens (batch 1), with the KV-cache MiB that
  llama.cpp logs for that context (f16 cache, its default).

Models (none downloaded): stories260K (bundled, real) converted at r = 16 and r = 24 (R = 8), and
a random model with Llama-3.2-1B's layer shapes (hidden 2048, 32 heads, 8 KV heads, head_dim 64,
MLP 8192, vocab 128256) but ``--layers`` layers (default 2) and no rope scaling (deepseek2 cannot
run llama3 scaling), converted at the 512 + 64 recipe shape.

    python bench/engines.py --json bench/_work/engines.json
    python bench/engines.py --contexts 1024,4096,16384 --decode-tokens 16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mlaconv.options import ConvertOptions

from mlaconv.conversion import convert  # noqa: E402
from mlaconv.io.gguf import export_gguf  # noqa: E402
from mlaconv.io.source import CheckpointReader, read_config  # noqa: E402
from mlaconv.llamacpp import nll_sum, open_engine, perplexity, quantize  # noqa: E402
from mlaconv.models import load_causal_lm  # noqa: E402

STORIES = ROOT / "examples" / "stories260K"


def write_llama_gguf(folder: Path, path: Path) -> None:
    """The source checkpoint as a llama-architecture GGUF (f32, no vocabulary)."""
    config, reader = read_config(folder), CheckpointReader(folder)
    H, L, N = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    K = config.get("num_key_value_heads", N)
    d = config.get("head_dim") or H // N
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(H)
    writer.add_block_count(L)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(N)
    writer.add_head_count_kv(K)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_dimension_count(d)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")

    def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:  # rotate-half rows -> (2i, 2i+1) pairs
        return w.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape)

    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight"}
    for i in range(L):
        p = f"model.layers.{i}."
        names.update({f"blk.{i}.{a}.weight": p + b + ".weight" for a, b in (
            ("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
            ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"))})
    for name, source in names.items():  # f32 copies in memory: fine for the bench sizes
        w = reader.get(source).float()
        if name.endswith("attn_q.weight"):
            w = interleave(w, N)
        elif name.endswith("attn_k.weight"):
            w = interleave(w, K)
        writer.add_tensor(name, w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_ppl(folder: Path, windows) -> float:
    model = load_causal_lm(folder, torch.float32)
    with torch.no_grad():
        total = sum(nll_sum(model(torch.tensor([w])).logits[0].double().numpy(), w) for w in windows)
    return math.exp(total / sum(len(w) - 1 for w in windows))


def quality(label: str, source: Path, converted: Path, work: Path, windows) -> list[dict]:
    """Perplexities of one source/conversion pair in llama.cpp (f32, q8_0, Q4_K_M) and transformers."""
    src_f32, mla_f32 = work / f"{label}-src-f32.gguf", work / f"{label}-mla-f32.gguf"
    write_llama_gguf(source, src_f32)
    export_gguf(converted, mla_f32, force=True)
    export_gguf(converted, work / f"{label}-mla-q8_0.gguf", outtype="q8_0", force=True)
    export_gguf(converted, work / f"{label}-mla-q8_0-noguard.gguf", outtype="q8_0", force=True,
                row_error_limit=math.inf)
    quantize(src_f32, work / f"{label}-src-q8_0.gguf", "Q8_0")
    quantize(src_f32, work / f"{label}-src-Q4_K_M.gguf", "Q4_K_M")
    quantize(mla_f32, work / f"{label}-mla-Q4_K_M.gguf", "Q4_K_M")
    quantize(mla_f32, work / f"{label}-mla-Q4_K_M-kva-f32.gguf", "Q4_K_M", keep={"attn_kv_a_mqa": "F32"})
    rows = [{"model": label, "which": "source", "engine": "transformers", "type": "f32",
             "ppl": transformers_ppl(source, windows)},
            {"model": label, "which": "converted", "engine": "transformers", "type": "f32",
             "ppl": transformers_ppl(converted, windows)}]
    for which, kind in (("src", "f32"), ("src", "q8_0"), ("src", "Q4_K_M"), ("mla", "f32"), ("mla", "q8_0"),
                        ("mla", "q8_0-noguard"), ("mla", "Q4_K_M"), ("mla", "Q4_K_M-kva-f32")):
        path = work / f"{label}-{which}-{kind}.gguf"
        rows.append({"model": label, "which": "source" if which == "src" else "converted", "engine": "llama.cpp",
                     "type": kind, "ppl": perplexity(path, windows), "MiB": path.stat().st_size / 2**20})
    return rows


def decode_speed(path: Path, contexts: list[int], tokens: int, threads: int | None) -> list[dict]:
    """Decode tokens/s after a prompt of each length, batch 1, f16 cache; prefill time too."""
    rows = []
    rng = np.random.default_rng(0)
    for n_ctx in contexts:
        prompt = rng.integers(0, 1000, n_ctx - tokens).tolist()
        with open_engine(path, n_ctx=n_ctx, f32_cache=False, logits_all=False, threads=threads) as engine:
            started = time.perf_counter()
            engine.llm.eval(prompt)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            for t in range(tokens):
                engine.llm.eval([int(rng.integers(0, 1000))])
            decode = time.perf_counter() - started
            rows.append({"context": n_ctx, "kv_cache_MiB": engine.kv_cache_mib, "prefill_s": prefill,
                         "decode_tokens_per_s": tokens / decode})
    return rows


def random_llama(folder: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
                         rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "_work" / "engines")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    windows = [json.loads(line)["input_ids"] for line in (STORIES / "samples.jsonl").read_text().splitlines()]
    results = {"quality": [], "speed": []}
    for rank in (16, 24):
        out = args.work / f"stories-r{rank}"
        convert(str(STORIES), out, ConvertOptions(rank=rank, verify=False, force=True))
        results["quality"] += quality(f"stories-r{rank}", STORIES, out, args.work, windows)
        for row in results["quality"][-10:]:
            print(json.dumps(row), flush=True)
    if not args.skip_speed:
        src = args.work / "llama1b-shape"
        if not (src / "config.json").is_file():
            random_llama(src, args.layers)
        mla = args.work / "llama1b-shape-mla"
        convert(str(src), mla, ConvertOptions(rank=512, rope_dim=64, verify=False, force=True))
        write_llama_gguf(src, args.work / "llama1b-src-f32.gguf")
        export_gguf(mla, args.work / "llama1b-mla-f32.gguf", force=True)
        contexts = [int(c) for c in args.contexts.split(",")]
        for which in ("src", "mla"):
            for row in decode_speed(args.work / f"llama1b-{which}-f32.gguf", contexts, args.decode_tokens, args.threads):
                row["which"] = "source" if which == "src" else "converted"
                results["speed"].append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
