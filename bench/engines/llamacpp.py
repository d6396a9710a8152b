#!/usr/bin/env python
"""llama.cpp (llama-cpp-python 0.3.36, CPU): the source model versus its MLA conversion.

For each model, the source is written as a plain llama-architecture GGUF by this script (q/k rows
permuted from Hugging Face's rotate-half order to llama.cpp's interleaved pairs; no tokenizer) and
the conversion by ``mlaconv export gguf``. Then, all in llama.cpp:

- perplexity on token ids (stories260K: its bundled samples) in f32, q8_0 (gguf-py, via the export)
  and Q4_K_M (llama.cpp's own ``llama_model_quantize``), and for the conversion Q4_K_M also with
  ``attn_kv_a_mqa`` overridden to f32, next to transformers on the same ids;
- prefill time of a prompt of 1K / 4K / 16K tokens (minus the decode steps), measured once per context, then
  decode tokens/s of that sequence alone (batch 1) and, at ``--parallel-contexts``, of ``--parallel``
  sequences decoding together (llama.cpp's low-level ``llama_batch`` / ``llama_decode``, one token of every
  sequence per call, each sequence in its own KV stream with the full context; the prompt's cache is copied
  to the other sequences with ``llama_memory_seq_cp`` instead of being prefilled again), with the KV-cache
  MiB that llama.cpp logs (f16 cache, its default; all sequences together) and wall and CPU seconds.

Models (none downloaded): stories260K (bundled, real) converted at r = 16 and r = 24 (R = 8), and
a random model with Llama-3.2-1B's layer shapes (hidden 2048, 32 heads, 8 KV heads, head_dim 64,
MLP 8192, vocab 128256) but ``--layers`` layers (default 2) and no rope scaling (deepseek2 cannot
run llama3 scaling), converted at the 512 + 64 recipe shape.

    python -m bench.engines.llamacpp --skip-speed --json bench/_work/engines.json            # perplexity table
    python -m bench.engines.llamacpp --skip-quality --contexts 1024,4096 --decode-tokens 8   # speed, 4 sequences too
    python -m bench.engines.llamacpp --skip-quality --contexts 16384 --parallel-contexts "" --decode-tokens 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from bench.lib import REPO as ROOT
from bench.lib import WORK
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.evaluate.llamacpp import capture_log, kv_cache_mib, nll_sum, perplexity, quantize
from mlaconv.io.models import load_causal_lm
from mlaconv.io.reader import CheckpointReader, read_config
from mlaconv.target.gguf import export_gguf

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


class Decoder:
    """One GGUF in llama.cpp through its low-level API: ``llama_init_from_model`` with ``n_seq_max`` sequences,
    each in its own KV stream of ``n_ctx`` / ``n_seq_max`` cells (not unified, llama.cpp's default), and
    ``llama_batch_init`` / ``llama_decode`` with one token per (sequence, position). (llama-cpp-python's ``Llama``
    does not pass ``n_seq_max`` on: it takes the keyword into ``**kwargs`` and keeps one sequence.)"""

    def __init__(self, path: Path, n_ctx: int, sequences: int, n_batch: int, threads: int | None):
        import llama_cpp

        self.api = llama_cpp
        threads = threads or max(os.cpu_count() // 2, 1)  # llama-cpp-python's default
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, n_batch, sequences
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # llama-cpp-python's default
        self.log: list[str] = []
        with capture_log(self.log):
            self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
            self.ctx = llama_cpp.llama_init_from_model(self.model, params) if self.model else None
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {path}: " + " ".join(self.log[-3:]))
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.capacity = max(n_batch, sequences)
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, sequences)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.threads = threads

    @property
    def kv_cache_mib(self) -> float:
        """The KV-cache size llama.cpp logged for this context, all sequences together."""
        return kv_cache_mib(self.log)

    def decode(self, entries: list[tuple[int, int, int]], logits_last: bool = True) -> None:
        """Decode ``entries`` (token, position, sequence) as one batch; logits for the last entry of each
        sequence only when ``logits_last`` (what a sampler needs), then wait for the result."""
        if len(entries) > self.capacity:
            raise ValueError(f"{len(entries)} tokens in a batch of {self.capacity}")
        last = {seq: i for i, (_, _, seq) in enumerate(entries)}
        for i, (token, pos, seq) in enumerate(entries):
            self.batch.token[i], self.batch.pos[i] = token, pos
            self.batch.n_seq_id[i], self.batch.seq_id[i][0] = 1, seq
            self.batch.logits[i] = logits_last and last[seq] == i
        self.batch.n_tokens = len(entries)
        status = self.api.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        self.api.llama_synchronize(self.ctx)

    def close(self) -> None:
        self.api.llama_batch_free(self.batch)
        self.api.llama_free(self.ctx)
        self.api.llama_model_free(self.model)


def timed(work) -> tuple[float, float]:
    """(wall s, this process's CPU s) of ``work()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def decode_speed(path: Path, contexts: list[int], tokens: int, threads: int | None, parallel: int,
                 parallel_contexts: set[int], n_batch: int = 512) -> list[dict]:
    """Per context length C: prefill C − ``tokens`` random ids into sequence 0 (timed once), decode ``tokens``
    steps of sequence 0 alone (batch 1), then, where C is in ``parallel_contexts``, drop those steps, copy the
    prompt's cache to ``parallel`` − 1 more sequences (each in its own KV stream, as if each had prefilled the
    same prompt) and decode ``tokens`` steps of all ``parallel`` sequences together, one token of each per
    ``llama_decode``. f16 cache (llama.cpp's default), no flash attention (llama-cpp-python's default).
    The KV-cache MiB is llama.cpp's own log line, for all the context's sequences together."""
    rows = []
    rng = np.random.default_rng(0)
    for n_ctx in contexts:
        sequences = parallel if n_ctx in parallel_contexts else 1
        decoder = Decoder(path, n_ctx * sequences, sequences, n_batch, threads)
        try:
            ids = min(1000, decoder.n_vocab)
            prompt = rng.integers(0, ids, n_ctx - tokens).tolist()

            def prefill() -> None:
                began = time.perf_counter()
                for start in range(0, len(prompt), n_batch):
                    chunk = prompt[start:start + n_batch]
                    decoder.decode([(t, start + j, 0) for j, t in enumerate(chunk)],
                                   logits_last=start + n_batch >= len(prompt))
                    if (start // n_batch) % 4 == 3:  # progress, and what a prefill cut short had reached
                        print(f"{path.name}: prefilled {start + len(chunk)} of {len(prompt)} in "
                              f"{time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)

            def steps(seqs: int) -> None:
                for step in range(tokens):
                    decoder.decode([(int(rng.integers(0, ids)), len(prompt) + step, s) for s in range(seqs)])

            prefill_s, prefill_cpu = timed(prefill)
            one_s, one_cpu = timed(lambda: steps(1))
            row = {"context": n_ctx, "sequences_allocated": sequences, "kv_cache_MiB": decoder.kv_cache_mib,
                   "kv_cache_MiB_per_sequence": decoder.kv_cache_mib / sequences, "threads": decoder.threads,
                   "prompt_tokens": len(prompt), "prefill_s": prefill_s, "prefill_cpu_s": prefill_cpu,
                   "decode_tokens": tokens, "decode_tokens_per_s": tokens / one_s,
                   "decode_tokens_per_cpu_s": tokens / one_cpu}
            if sequences > 1:
                api = decoder.api
                if not api.llama_memory_seq_rm(decoder.memory, 0, len(prompt), -1):
                    raise RuntimeError("llama.cpp could not drop the batch-1 decode steps")
                for s in range(1, sequences):
                    api.llama_memory_seq_cp(decoder.memory, 0, s, -1, -1)
                if [api.llama_memory_seq_pos_max(decoder.memory, s) for s in range(sequences)] != [len(prompt) - 1] * sequences:
                    raise RuntimeError("the prompt's cache did not reach every sequence")
                many_s, many_cpu = timed(lambda: steps(sequences))
                row |= {"parallel_sequences": sequences,
                        "parallel_decode_tokens_per_s": sequences * tokens / many_s,
                        "parallel_decode_tokens_per_cpu_s": sequences * tokens / many_cpu}
        finally:
            decoder.close()
        rows.append(row)
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
    parser.add_argument("--work", type=Path, default=WORK / "engines")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="llama.cpp threads (default: llama-cpp-python's, half the cores: 1 here)")
    parser.add_argument("--parallel", type=int, default=4, help="sequences decoded together (speed table)")
    parser.add_argument("--parallel-contexts", default="1024,4096",
                        help="contexts at which the parallel sequences are measured too (each gets the full context)")
    parser.add_argument("--models", default="src,mla", help="speed table: src, mla or both")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--rebuild", action="store_true",
                        help="rebuild the speed table's model and GGUFs even if --work has them")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    windows = [json.loads(line)["input_ids"] for line in (STORIES / "samples.jsonl").read_text().splitlines()]
    results = {"quality": [], "speed": []}
    for rank in (16, 24) if not args.skip_quality else ():
        out = args.work / f"stories-r{rank}"
        convert(str(STORIES), out, ConvertOptions(rank=rank, verify=False, force=True))
        results["quality"] += quality(f"stories-r{rank}", STORIES, out, args.work, windows)
        for row in results["quality"][-10:]:
            print(json.dumps(row), flush=True)
    if not args.skip_speed:
        src_gguf, mla_gguf = args.work / "llama1b-src-f32.gguf", args.work / "llama1b-mla-f32.gguf"
        if args.rebuild or not (src_gguf.is_file() and mla_gguf.is_file()):
            src = args.work / "llama1b-shape"
            if args.rebuild or not (src / "config.json").is_file():
                random_llama(src, args.layers)
            mla = args.work / "llama1b-shape-mla"
            convert(str(src), mla, ConvertOptions(rank=512, rope_dim=64, verify=False, force=True))
            write_llama_gguf(src, src_gguf)
            export_gguf(mla, mla_gguf, force=True)
        contexts = [int(c) for c in args.contexts.split(",")]
        parallel_contexts = {int(c) for c in args.parallel_contexts.split(",") if c}
        for which in args.models.split(","):
            for row in decode_speed(args.work / f"llama1b-{which}-f32.gguf", contexts, args.decode_tokens, args.threads,
                                    args.parallel, parallel_contexts):
                row["which"] = "source" if which == "src" else "converted"
                results["speed"].append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
