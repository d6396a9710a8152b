"""Text the source writes itself, for healing: windows of the source's own distribution (data-free distillation, as
in LLM-QAT), so that healing is not confined to the domain of the calibration text.

Each window starts at the source's BOS token (when it has one) and one token drawn uniformly from the vocabulary,
then the source samples the rest (nucleus sampling, p = ``TOP_P``, no end of text before the window is full).
Seeded: the same source, count, length and seed give the same windows.
"""

from __future__ import annotations

import torch

from mlaconv.devices import computing
from mlaconv.progress import Progress, no_progress

TOP_P = 0.95
BATCH = 32  # windows sampled together (their KV cache: 32 × length × the source's cache per token); SmolLM2-135M on
# 2 cores wrote 73 tokens/s at 16, 109 at 32, 117 at 64 (windows of 256: bench/real/README.md)


def written_windows(model, count: int, length: int, seed: int, bos: int | None,
                    progress: Progress = no_progress, precision: str | None = None) -> torch.Tensor:
    """``count`` windows of ``length`` tokens sampled from ``model`` in ``precision`` (float32 unless told) →
    [count, length] int64 on the CPU."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    lead = [] if bos is None else [bos]
    eos = model.config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) or 0
    batches, windows = range(0, count, BATCH), []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in progress(batches, f"source writing {count} windows of {length} tokens", len(batches)):
            rows = min(BATCH, count - start)
            first = torch.randint(vocab, (rows, 1), generator=generator)
            prompt = torch.cat([torch.tensor(lead, dtype=torch.long).expand(rows, -1), first], 1).to(device)
            new = length - prompt.shape[1]
            config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=TOP_P, max_new_tokens=new,
                                      min_new_tokens=new, pad_token_id=pad)
            with torch.inference_mode(), computing(device, precision):
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
            windows.append(out[:, :length].cpu())
    return torch.cat(windows)
