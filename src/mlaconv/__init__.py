"""mlaconv: convert MHA/GQA checkpoints into native DeepSeek-V3 Multi-head Latent Attention checkpoints.

The Python API (the README shows it at work)::

    from mlaconv import ConvertOptions, convert
    report = convert("examples/llama-docs", "out/mla", ConvertOptions(kv_keep=0.5))  # a ConversionReport

Names are imported on first use, so ``import mlaconv`` stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {  # public name → (module, attribute)
    "convert": ("mlaconv.conversion.run", "convert"),
    "ConvertOptions": ("mlaconv.conversion.options", "ConvertOptions"),
    "inspect_spectra": ("mlaconv.inspect.spectra", "spectra"),
    "SpectraOptions": ("mlaconv.inspect.spectra", "SpectraOptions"),
    "evaluate_perplexity": ("mlaconv.evaluate.perplexity", "evaluate_perplexity"),
    "evaluate_retrieval": ("mlaconv.evaluate.retrieval", "evaluate_retrieval"),
    "TokenSource": ("mlaconv.io.text", "TokenSource"),
    "export_gguf": ("mlaconv.target.gguf", "export_gguf"),
    "MlaconvError": ("mlaconv.errors", "MlaconvError"),
    "ConversionReport": ("mlaconv.report", "ConversionReport"),
    "SpectraReport": ("mlaconv.report", "SpectraReport"),
    "EvalReport": ("mlaconv.report", "EvalReport"),
    "RetrievalReport": ("mlaconv.report", "RetrievalReport"),
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'mlaconv' has no attribute {name!r}")
    module, attribute = _API[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
