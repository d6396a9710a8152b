"""Loading whole models and tokenizers through the public transformers API (never remote code), and what a
model's parameters take."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlaconv.errors import MlaconvError

def refuse_float16_mla(folder: str | Path, config: dict, dtype: torch.dtype) -> None:
    """Refuse to run an MLA checkpoint (one with ``kv_lora_rank``) in float16, in one line.

    mlaconv keeps the latent before kv_a_layernorm tiny so that the norm is a linear map; a float16
    activation holds it only as a subnormal, and even an exact conversion then moves its logits by
    percents, several times what float16 costs its source.
    """
    if dtype == torch.float16 and config.get("kv_lora_rank"):
        raise MlaconvError(
            f"--dtype float16 is refused for the MLA checkpoint {folder}: its latent before kv_a_layernorm is kept "
            "tiny (mean square ≤ 1e-11) so that the norm is linear, and float16 activations underflow it (logits off by "
            "percents even for an exact conversion); use --dtype bfloat16 (same memory) or float32"
        )


def load_causal_lm(folder: str | Path, dtype: torch.dtype = torch.float32, device_map: str | None = None,
                   device: str | None = None):
    """``AutoModelForCausalLM.from_pretrained`` in eval mode, without remote code, on any transformers ≥ 4.53.

    An MLA checkpoint is never loaded in float16 (see ``refuse_float16_mla``).
    """
    from transformers import AutoModelForCausalLM

    if dtype == torch.float16:
        refuse_float16_mla(folder, json.loads((Path(folder) / "config.json").read_text()), dtype)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {"trust_remote_code": False}
    if device_map:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=dtype, **kwargs)
    if device and not device_map:
        model = model.to(device)
    return model.eval()


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer, or None if it ships none."""
    folder = Path(folder)
    if not has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:  # tokenizers raise many types; the message is what the user needs
        raise MlaconvError(f"cannot load the tokenizer in {folder}: {exc}") from None


def parameter_bytes(folder: str | Path, dtype: torch.dtype) -> int:
    """Bytes the model's parameters take in ``dtype`` (from the safetensors headers)."""
    from mlaconv.io import CheckpointReader

    reader = CheckpointReader(Path(folder))
    elements = 0
    for name in reader.names:
        shape = reader.shape(name)
        count = 1
        for s in shape:
            count *= s
        elements += count
    return elements * torch.empty((), dtype=dtype).element_size()
