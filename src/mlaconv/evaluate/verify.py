"""The built-in check: load the converted folder through ``AutoModelForCausalLM`` and compare with the source.

Tokens come from a short bundled English text through the source tokenizer or, for a model without
one, from the source model's own samples (seeded). Both models run in float32 when memory allows.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from mlaconv.devices import available_memory_bytes
from mlaconv.io.models import load_causal_lm, load_tokenizer, parameter_bytes
from mlaconv.report.conversion import Verification
from mlaconv.source.spec import SourceSpec


def compare_logits(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """max |Δlogit|, mean KL(reference ‖ other) per token, top-1 agreement; logits [..., vocab]."""
    reference, other = reference.double().flatten(0, -2), other.double().flatten(0, -2)
    logp = torch.log_softmax(reference, -1)
    logq = torch.log_softmax(other, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    diff = (reference - other).abs()
    return {
        "max_abs_logit_diff": diff.max().item(),
        "max_rel_logit_diff": (diff.max() / reference.abs().max().clamp_min(1e-30)).item(),
        "kl": kl.mean().item(),
        "top1": (reference.argmax(-1) == other.argmax(-1)).double().mean().item(),
    }


def verification_tokens(source: Path, spec: SourceSpec, windows: int, window: int, model=None,
                        seed: int = 0) -> torch.Tensor:
    """[windows, window] token ids: the bundled text through the source tokenizer, else model samples."""
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        text = resources.files("mlaconv").joinpath("data/verify.txt").read_text()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        window = min(window, len(ids))
        windows = max(1, min(windows, len(ids) // window))
        return torch.tensor(ids[: windows * window]).reshape(windows, window)
    generator = torch.Generator().manual_seed(seed)
    bos = spec.config.get("bos_token_id")
    ids = torch.full((windows, 1), bos if isinstance(bos, int) else 0, dtype=torch.long)
    with torch.no_grad():
        for _ in range(window - 1):  # a full forward per step keeps this independent of any cache API
            probs = torch.softmax(model(ids).logits[:, -1].double(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids


def verify(source: Path, converted: Path, spec: SourceSpec, windows: int = 4, window: int = 128) -> Verification:
    """Compare the converted checkpoint with its source on a few windows; skip if both do not fit in RAM.

    The top-level figures are transformers'; ``engines`` gives each engine's (``engine_figures``)."""
    budget = available_memory_bytes() // 2
    for dtype in (torch.float32, torch.bfloat16):
        need = parameter_bytes(source, dtype) + parameter_bytes(converted, dtype)
        if need <= budget:
            break
    else:
        return Verification(skipped=f"both models need {need / 2**30:.1f} GiB even in bfloat16, over half the "
                                    f"{2 * budget / 2**30:.1f} GiB available; run `mlaconv eval perplexity` on a "
                                    "bigger machine")
    window = min(window, spec.max_position_embeddings)
    with torch.no_grad():
        reference_model = load_causal_lm(source, dtype)
        tokens = verification_tokens(source, spec, windows, window, model=reference_model)
        reference = reference_model(tokens).logits
        del reference_model
        model = load_causal_lm(converted, dtype)
        return Verification(**compare_logits(reference, model(tokens).logits), dtype=str(dtype).replace("torch.", ""),
                            windows=tokens.shape[0], tokens=tokens.numel(), loader=type(model).__name__,
                            engines=engine_figures(model, tokens, reference))


def engine_figures(model, tokens: torch.Tensor, reference: torch.Tensor) -> dict:
    """Per engine: ``refused`` (why it would not run the checkpoint as transformers does), or ``same_as``
    transformers with the ``reason``, or its own ``compare_logits`` figures as ``mlaconv.target.engines`` emulates it,
    with the ``differences`` that make them differ; ``shape_refused`` where the engine fails on the MLA shape."""
    from mlaconv.target import engines

    reference_view = engines.model_view("transformers", model)
    figures: dict[str, dict] = {"transformers": {"computes": "the figures above"}}
    for name in engines.ENGINES:
        if name == "transformers":
            continue
        engine_view = engines.model_view(name, model)
        differences = engines.differences(engine_view, reference_view) if not engine_view.refused else []
        if engine_view.refused:
            figures[name] = {"refused": engine_view.refused}
        elif not differences:
            figures[name] = {"same_as": "transformers", "reason": (
                "no non-zero bias tensors to drop; the same rope frequencies, cos/sin and softmax scales and "
                "kv_a_layernorm ε")}
        else:
            with engines.emulate(model, engine_view):
                figures[name] = {**compare_logits(reference, model(tokens).logits), "differences": differences}
        if engine_view.shape_refused:
            figures[name]["shape_refused"] = engine_view.shape_refused
        figures[name]["checked"] = engines.ENGINES[name].checked  # the version whose source the record mirrors
    return figures
