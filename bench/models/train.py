"""Train the bench's small real models, and sample stories260K calibration ids.

    python -m bench.models.train llama              # → bench/_work/models/llama-docs
    python -m bench.models.train qwen2              # → bench/_work/models/qwen2-docs
    python -m bench.models.train qwen3              # → bench/_work/models/qwen3-docs
    python -m bench.models.train qwen2-mha          # → bench/_work/models/qwen2-mha-docs
    python -m bench.models.train llama-mha          # → bench/_work/models/llama-mha-docs
    python -m bench.models.train stories-calib      # → bench/_work/stories260K_calib.jsonl
    python -m bench.models.train heldout --out bench/_work/models/llama-docs   # rewrite calib.txt (below)

The corpus (``bench/models/docs_corpus.py``): docstrings of the standard library, numpy and pandas, and the pydoc
topics, split by unit into train, calibration and evaluation parts; nothing is downloaded.

A byte-level BPE tokenizer (``tokenizers``, ``VOCAB`` ids, Qwen2's pre-tokenizer, trained on the train
part only) is saved with each model as a ``PreTrainedTokenizerFast``; the models see the documents as
one id stream, each document followed by EOS. Each model folder also holds ``calib.txt`` and
``eval.txt`` (the held-out parts, documents separated by blank lines; ``calib.txt`` without the
documents that share a 13-word shingle with ``eval.txt``, see ``bench/models/overlap.py``: units differ,
but the stdlib, numpy and pandas copy docstrings between files) and ``train.json``: the corpus
manifest (versions, sizes, checksums, the units of each held-out part), what the deduplication
dropped, and the training figures. ``heldout`` rewrites those two files for a folder trained before
the deduplication, after checking that the rebuilt corpus is the one it was trained on. Training (AdamW,
warm-up + cosine, random windows of the train stream) is seeded and deterministic for a given machine and
thread count (2 threads).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.lib import REPO as ROOT
from bench.lib import WORK
from bench.models.docs_corpus import build_corpus, write_held_out
from bench.models.overlap import SHINGLE

STORIES = ROOT / "examples" / "stories260K"

VOCAB = 4096
CONTEXT = 256
EOS = "<|endoftext|>"
SEED = 0


# -------------------------------------------------------------------------------------------- held out


def rewrite_held_out(out: Path) -> None:
    """Deduplicate calib.txt of an already trained folder, if the rebuilt corpus is the one it was trained on."""
    report = json.loads((out / "train.json").read_text())
    parts, manifest = build_corpus()
    trained_on = report["corpus"]["parts"]
    for name, part in manifest["parts"].items():
        if part["sha256"] != trained_on[name]["sha256"]:
            sys.exit(f"error: the {name} part rebuilt here differs from the one {out} was trained on (python "
                     f"{report['corpus']['python']}, {report['corpus']['packages']} there; python "
                     f"{manifest['python']}, {manifest['packages']} here): retrain instead")
    report["held_out_files"] = record = write_held_out(out, parts)
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{out}: calib.txt without {record['calib_documents_dropped']} documents "
          f"({record['calib_chars_dropped']} chars) that shared a {SHINGLE}-word shingle with eval.txt")


# ------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str]):
    """Byte-level BPE over the training documents, wrapped as a ``PreTrainedTokenizerFast``.

    Normalizer, pre-tokenizer and decoder are exactly those transformers' ``Qwen2Tokenizer`` builds:
    ``AutoTokenizer`` swaps that class in for any ``qwen2`` folder, and it then yields the same ids.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None,
                                   pad_token=EOS)


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one id stream [T], each document followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Recipe:
    """One bench model and how it is trained (batch × CONTEXT tokens per step)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_norm_eps: float
    steps: int = 400
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 20
    weight_decay: float = 0.1


RECIPES = {
    # GQA Llama, group 4: 32-dim heads (16 RoPE frequencies), Llama-2's ε 1e-5.
    "llama": Recipe("llama", hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=640,
                    rms_norm_eps=1e-5),
    # GQA Qwen2 with q/k/v biases, group 2: 64-dim heads (32 RoPE frequencies), Qwen's ε 1e-6.
    "qwen2": Recipe("qwen2", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=640,
                    rms_norm_eps=1e-6),
    # GQA Qwen3: qwen2-docs' shape without biases, with per-head q/k RMSNorm before RoPE (QK-norm).
    "qwen3": Recipe("qwen3", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=640,
                    rms_norm_eps=1e-6),
    # MHA Qwen2 with q/k/v biases (n_kv = n_heads, like Llama-2, Phi-3-mini, SmolLM2-1.7B): the layout where
    # DeepSeek-V3's one shared rotary key stands in for every head's rotary part (issue 18).
    "qwen2-mha": Recipe("qwen2", hidden=256, layers=4, heads=4, kv_heads=4, head_dim=64, intermediate=640,
                        rms_norm_eps=1e-6),
    # MHA Llama without biases (Llama-2-7B's layout: n_kv = n_heads, 64-dim heads, ε 1e-5): qwen2-mha's shape
    # in the llama family (issue 18).
    "llama-mha": Recipe("llama", hidden=256, layers=4, heads=4, kv_heads=4, head_dim=64, intermediate=640,
                        rms_norm_eps=1e-5),
}


def build_model(recipe: Recipe, vocab: int, eos: int):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    common = dict(vocab_size=vocab, hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
                  num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
                  num_key_value_heads=recipe.kv_heads, head_dim=recipe.head_dim, rms_norm_eps=recipe.rms_norm_eps,
                  rope_theta=10000.0, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                  bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if recipe.family == "llama":
        return LlamaForCausalLM(LlamaConfig(attention_bias=False, **common))
    if recipe.family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(attention_bias=False, use_sliding_window=False, **common))
    return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))


def lr_at(step: int, recipe: Recipe) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(stream: torch.Tensor, length: int = CONTEXT) -> torch.Tensor:
    """Non-overlapping windows [n, length] of an id stream (remainder dropped)."""
    n = len(stream) // length
    return stream[: n * length].reshape(n, length)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch: int = 16) -> float:
    """exp(mean next-token NLL) over windows ids [n, w]."""
    total, count = 0.0, 0
    for chunk in ids.split(batch):
        logits = model(chunk).logits[:, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total, count = total + nll.item(), count + chunk[:, 1:].numel()
    return math.exp(total / count)


def train(recipe: Recipe, train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab: int, eos: int):
    """AdamW with warm-up + cosine; each step draws ``batch`` random windows of the training stream."""
    torch.manual_seed(SEED)
    model = build_model(recipe, vocab, eos)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(CONTEXT + 1)
    losses: list[float] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    model.train()
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        starts = torch.randint(0, len(train_ids) - CONTEXT - 1, (recipe.batch, 1), generator=generator)
        chunk = train_ids[starts + offsets]  # [batch, CONTEXT + 1]
        logits = model(chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == recipe.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {lr_at(step, recipe):.2e}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    model.eval()
    figures = {
        "train_seconds": round(seconds, 1),
        "train_cpu_seconds": round(cpu_seconds, 1),  # both threads; ≈ 2 × wall time on an idle 2-core machine
        "train_tokens": recipe.steps * recipe.batch * CONTEXT,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),  # mean over the last 20 steps
        "heldout_ppl": perplexity(model, eval_ids),
        "heldout_windows": len(eval_ids),
        "uniform_ppl": vocab,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return model, figures


def train_model(name: str, out: Path, steps: int | None) -> dict:
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    recipe = RECIPES[name] if steps is None else replace(RECIPES[name], steps=steps)
    parts, manifest = build_corpus()
    tokenizer = train_tokenizer(parts["train"])
    eos = tokenizer.eos_token_id
    streams = {split: token_stream(tokenizer, docs) for split, docs in parts.items()}
    for split, ids in streams.items():
        manifest["parts"][split]["tokens"] = len(ids)
    print("corpus: " + ", ".join(f"{split} {part['chars'] / 1e6:.2f} MB = {part['tokens']} tokens"
                                 for split, part in manifest["parts"].items()), flush=True)
    model, figures = train(recipe, streams["train"], windows(streams["eval"]), len(tokenizer), eos)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    held_out = write_held_out(out, parts)
    report = {"model": name, "recipe": asdict(recipe), "context": CONTEXT, "vocab": len(tokenizer),
              "seed": SEED, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "command": " ".join(["python -m bench.models.train", *sys.argv[1:]]), **figures, "corpus": manifest, "held_out_files": held_out}
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{name}: {figures['parameters'] / 1e6:.2f}M parameters, {figures['train_tokens']} tokens in "
          f"{figures['train_seconds']:.0f}s ({figures['train_cpu_seconds']:.0f} CPU s); final train loss "
          f"{figures['final_train_loss']:.3f}; held-out PPL {figures['heldout_ppl']:.2f} on "
          f"{figures['heldout_windows']} windows (uniform: {len(tokenizer)})")
    return report


# ------------------------------------------------------------------------------------ stories260K calib


@torch.no_grad()
def sample_stories(out: Path, count: int = 64, length: int = 256, seed: int = 4321) -> None:
    """``count`` sequences of ``length`` ids sampled from stories260K at T = 1 (BOS first), as JSON lines.

    The bundled samples.jsonl (seed 1234) stays the evaluation set; this seed differs.
    """
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    model = LlamaForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((count, 1), model.config.bos_token_id, dtype=torch.long)
    output = model(ids, use_cache=True)
    for _ in range(length - 1):
        probs = torch.softmax(output.logits[:, -1].double(), -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
        output = model(ids[:, -1:], cache=output.cache, use_cache=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    print(f"wrote {count}×{length} ids sampled from stories260K (seed {seed}) to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=[*RECIPES, "stories-calib", "heldout"])
    parser.add_argument("--out", type=Path, help="output folder (a .jsonl file for stories-calib; the trained "
                                                 "folder for heldout)")
    parser.add_argument("--steps", type=int, help="training steps (default: the recipe's)")
    args = parser.parse_args()
    if args.what == "stories-calib":
        sample_stories(args.out or WORK / "stories260K_calib.jsonl")
    elif args.what == "heldout":
        if args.out is None:
            parser.error("heldout needs --out FOLDER (a folder this script trained)")
        rewrite_held_out(args.out)
    else:
        train_model(args.what, args.out or WORK / "models" / f"{args.what}-docs", args.steps)


if __name__ == "__main__":
    main()
