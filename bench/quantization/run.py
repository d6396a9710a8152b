"""Quantization bench (issue 12): what the formats users apply cost a converted checkpoint, next to its source.

Each model (source) and its conversion are measured under the same weight formats, each against its own
float32 logits: PPL penalty and KL per token.
  llama.cpp   (with --llama-cpp DIR, a llama.cpp source tree): the stock convert_hf_to_gguf.py writes an
              f32 GGUF, llama.cpp's own quantizer (llama_model_quantize) makes f16 / q8_0 / Q4_K_M, and
              llama-cpp-python runs them (weights and activations as llama.cpp computes them on CPU).
  per-channel FP8 (e4m3) and INT8 weights (one float32 scale per output row, as vLLM/SGLang store them),
              emulated in PyTorch and run through transformers' DeepseekV3ForCausalLM in float32.
``--layouts scaled,unscaled`` also converts with the input scale s forced to 1 (the tiny latent kept in
kv_a's weights, the layout before issue 12) for comparison.

The bench models have no tokenizer: the GGUFs get llama.cpp's "none" vocabulary and are fed token ids,
and the converted GGUF gets ``deepseek2.attention.q_lora_rank = 0`` (what ``--override-kv
deepseek2.attention.q_lora_rank=int:0`` does at load time; the stock converter omits the key).

    python -m bench.quantization.run --llama-cpp /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp --layouts scaled,unscaled
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.lib import REPO
from bench.lib import WORK as BENCH_WORK

WORK = BENCH_WORK / "quantization"
STORIES = REPO / "examples" / "stories260K"
LLAMA_CPP_FORMATS = {"f16": 1, "q8_0": 7, "q4_k_m": 15}  # llama_ftype
TORCH_FORMATS = ("fp8-channel", "int8-channel")


def random_mqa(folder: Path) -> Path:
    """A seeded random Llama with one KV head (hidden 256, head_dim 64): converts exactly at r = R = 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
                             max_position_embeddings=256, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.05)
        model.save_pretrained(folder)
    return folder


def tokens_for(name: str, source: Path) -> torch.Tensor:
    if name.startswith("stories"):
        lines = (STORIES / "samples.jsonl").read_text().splitlines()
        return torch.tensor([json.loads(line)["input_ids"] for line in lines[:24]])
    from mlaconv.source.spec import SourceSpec
    from mlaconv.io import read_config
    from mlaconv.io.models import load_causal_lm
    from mlaconv.evaluate.verify import verification_tokens

    model = load_causal_lm(source, torch.float32)
    with torch.no_grad():
        return verification_tokens(source, SourceSpec.from_config(read_config(source)), 8, 128, model=model, seed=3)


def convert_layout(source: Path, out: Path, layout: str, **shape) -> Path:
    import mlaconv.mla.attention as attention
    from mlaconv.conversion.options import ConvertOptions
    from mlaconv.conversion.run import convert

    chosen = attention.input_scale
    if layout == "unscaled":
        attention.input_scale = lambda *args, **kwargs: 1.0
    try:
        convert(str(source), out, ConvertOptions(verify=False, force=True, dtype="float32", **shape))
    finally:
        attention.input_scale = chosen
    return out


def scores(logprobs: torch.Tensor, reference: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """(PPL, mean KL(reference ‖ logprobs)) over next-token predictions; log-probs [B, S-1, V]."""
    nll = -logprobs.gather(-1, ids[:, 1:, None]).mean().item()
    kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
    return math.exp(nll), kl


# ---------------------------------------------------------------------------------------- per-channel formats


def per_channel(w: torch.Tensor, fmt: str) -> torch.Tensor:
    top = w.abs().amax(1, keepdim=True)
    levels = 448.0 if fmt == "fp8-channel" else 127.0
    scale = torch.where(top > 0, top / levels, torch.ones_like(top))
    if fmt == "fp8-channel":
        return (w / scale).to(torch.float8_e4m3fn).float() * scale
    return (w / scale).round().clamp(-127, 127) * scale


def torch_logprobs(folder: Path, ids: torch.Tensor, fmt: str | None) -> torch.Tensor:
    from mlaconv.io.models import load_causal_lm

    model = load_causal_lm(folder, torch.float32)
    with torch.no_grad():
        if fmt is not None:
            for p in model.parameters():
                if p.ndim == 2:
                    p.copy_(per_channel(p, fmt))
        return torch.log_softmax(model(ids).logits[:, :-1].double(), -1)


# ---------------------------------------------------------------------------------------------- llama.cpp

GGUF_WRAPPER = """
import runpy, sys
script, model, out = sys.argv[1:4]
import conversion, gguf  # llama.cpp's own, from the tree to_gguf puts on PYTHONPATH
chosen = conversion.get_model_class
def model_class(*args, **kwargs):
    cls = chosen(*args, **kwargs)
    def set_vocab(self):
        self.gguf_writer.add_tokenizer_model("none")
        if self.model_arch != gguf.MODEL_ARCH.DEEPSEEK2:
            self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])
        elif self.hparams.get("q_lora_rank") is None:
            self.gguf_writer.add_q_lora_rank(0)
    cls.set_vocab = set_vocab
    return cls
conversion.get_model_class = model_class
sys.argv = [script, model, "--outtype", "f32", "--outfile", out]
runpy.run_path(script, run_name="__main__")
"""


def to_gguf(llama_cpp_dir: Path, folder: Path, out: Path) -> Path:
    script = llama_cpp_dir / "convert_hf_to_gguf.py"
    path = [str(llama_cpp_dir), str(llama_cpp_dir / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]
    subprocess.run([sys.executable, "-c", GGUF_WRAPPER, str(script), str(folder), str(out)], check=True,
                   capture_output=True, env=os.environ | {"PYTHONPATH": os.pathsep.join(path)})
    return out


def quantize_gguf(src: Path, out: Path, ftype: int) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")
    return out


def llama_cpp_logprobs(path: Path, ids: torch.Tensor) -> torch.Tensor:
    import llama_cpp
    import numpy as np

    model = llama_cpp.Llama(str(path), n_ctx=ids.shape[1], n_batch=ids.shape[1], logits_all=True, verbose=False,
                            n_threads=2)
    rows = []
    for row in ids.tolist():
        model.reset()
        model.eval(row)
        logits = torch.tensor(np.array(model.scores[: len(row)]), dtype=torch.float64)[:-1]
        rows.append(torch.log_softmax(logits, -1))
    model.close()
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------------- bench


def measure(label: str, folder: Path, ids: torch.Tensor, llama_cpp_dir: Path | None) -> dict:
    row: dict = {"model": label}
    reference = torch_logprobs(folder, ids, None)
    row["ppl"] = scores(reference, reference, ids)[0]
    for fmt in TORCH_FORMATS:
        ppl, kl = scores(torch_logprobs(folder, ids, fmt), reference, ids)
        row[fmt] = {"penalty": ppl / row["ppl"] - 1, "kl": kl, "engine": "transformers (emulated weights)"}
    if llama_cpp_dir is not None:
        f32 = to_gguf(llama_cpp_dir, folder, WORK / f"{label}.f32.gguf")
        reference = llama_cpp_logprobs(f32, ids)
        row["llama.cpp f32 ppl"] = scores(reference, reference, ids)[0]
        for fmt, ftype in LLAMA_CPP_FORMATS.items():
            path = quantize_gguf(f32, WORK / f"{label}.{fmt}.gguf", ftype)
            ppl, kl = scores(llama_cpp_logprobs(path, ids), reference, ids)
            row[fmt] = {"penalty": ppl / row["llama.cpp f32 ppl"] - 1, "kl": kl, "engine": "llama.cpp"}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    parser.add_argument("--layouts", default="scaled", help="scaled and/or unscaled (comma-separated)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    cases = [("stories260K", STORIES, {"kv_keep": 1.0}), ("stories260K", STORIES, {"kv_keep": 0.5}),
             ("random-mqa", random_mqa(WORK / "random-mqa"), {"rank": 64, "rope_dim": 64})]
    rows, measured_sources = [], set()
    formats = TORCH_FORMATS + (tuple(LLAMA_CPP_FORMATS) if args.llama_cpp else ())
    print(f"{'model':40s} {'PPL':>9s} " + " ".join(f"{f:>22s}" for f in formats), flush=True)
    for name, source, shape in cases:
        ids = tokens_for(name, source)
        runs = [] if name in measured_sources else [(name + " (source)", source)]
        measured_sources.add(name)
        for layout in args.layouts.split(","):
            tag = ",".join(f"{k}={v}" for k, v in shape.items())
            label = f"{name} {tag} {layout}"
            runs.append((label, convert_layout(source, WORK / label.replace(" ", "_"), layout, **shape)))
        for label, folder in runs:
            row = measure(label.replace(" ", "_"), folder, ids, args.llama_cpp)
            row["model"] = label
            rows.append(row)
            cells = " ".join(f"{100 * row[f]['penalty']:+9.2f}% KL {row[f]['kl']:.1e}" for f in formats)
            print(f"{label:40s} {row['ppl']:9.3f} {cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
