"""Prefill, then token-by-token decode on the latent cache: greedy or sampled (temperature, top-k, seed)."""

from __future__ import annotations

import torch

from mlaconv.errors import MlaconvError
from mlaconv.runtime.model import LatentDecoder


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of logits [B, vocab]: argmax when temperature is 0, else a top-k sample."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def generate(model: LatentDecoder, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int | None = None, eos_token_id: int | None = None) -> torch.Tensor:
    """prompt [S] token ids → [S + n] with n ≤ max_new_tokens new tokens (stops after ``eos_token_id``)."""
    if temperature < 0:
        raise MlaconvError(f"temperature must be ≥ 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise MlaconvError(f"top_k must be ≥ 1, got {top_k}")
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise MlaconvError("the prompt must be a non-empty 1-D tensor of token ids")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens = prompt.to(model.device)
    cache = model.new_cache(batch=1, max_tokens=tokens.numel() + max_new_tokens)
    logits = model.forward(tokens[None], cache)[:, -1]  # prefill: [1, vocab]
    generated = []
    for step in range(max_new_tokens):
        token = next_token(logits, temperature, top_k, generator)  # [1]
        generated.append(token)
        if eos_token_id is not None and token.item() == eos_token_id:
            break
        if step + 1 < max_new_tokens:
            logits = model.forward(token[:, None], cache)[:, -1]  # decode one token
    return torch.cat([tokens, *generated])
