"""Running a GGUF in llama.cpp through llama-cpp-python: logits on token ids, perplexity, quantization.

llama.cpp is the engine under test here, so nothing below re-implements any of its math: the
logits come from its own forward pass (``logits_all``), the quantized files from its own
``llama_model_quantize``, the KV-cache size from its own log line. Needs the optional package
``llama-cpp-python`` (the ``dev`` extra installs it).
"""

from __future__ import annotations

import ctypes
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mlaconv.errors import MlaconvError

GGML_TYPE_F32 = 0
_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([0-9.]+) MiB")


def _llama_cpp():
    try:
        import llama_cpp
    except ModuleNotFoundError:
        raise MlaconvError("running llama.cpp needs llama-cpp-python: pip install llama-cpp-python==0.3.36") from None
    return llama_cpp


def kv_cache_mib(log: list[str]) -> float:
    """The KV-cache size llama.cpp logged while loading a context ("llama_kv_cache: size = … MiB", summed)."""
    sizes = [float(m.group(1)) for line in log if (m := _KV_LINE.search(line))]
    if not sizes:
        raise RuntimeError("llama.cpp did not log its KV-cache size")
    return sum(sizes)


@dataclass
class LoadedGGUF:
    """A loaded GGUF with one context; ``log`` holds llama.cpp's log lines from loading it."""

    llm: object
    log: list[str]

    @property
    def kv_cache_mib(self) -> float:
        """The KV-cache size llama.cpp reports for this context."""
        return kv_cache_mib(self.log)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits (len(tokens) × vocab, float64) of one sequence, from an empty cache."""
        self.llm.reset()
        self.llm.eval(list(tokens))
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float64)


@contextmanager
def open_engine(path: Path, n_ctx: int, *, n_batch: int = 512, f32_cache: bool = True, threads: int | None = None,
                logits_all: bool = True) -> Iterator[LoadedGGUF]:
    """Load ``path`` in llama.cpp (CPU) with one sequence and yield a ``LoadedGGUF``; closed on exit. (``Llama`` takes
    no ``n_seq_max``: for parallel sequences see ``bench/engines/llamacpp.py``, which builds the context itself.)"""
    llama_cpp = _llama_cpp()
    log: list[str] = []
    with capture_log(log), _without_amx_buffers(llama_cpp):
        llm = llama_cpp.Llama(
            str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, logits_all=logits_all, verbose=False,
            type_k=GGML_TYPE_F32 if f32_cache else None, type_v=GGML_TYPE_F32 if f32_cache else None,
            n_threads=threads, n_threads_batch=threads,
        )
    try:
        yield LoadedGGUF(llm, log)
    finally:
        llm.close()


@contextmanager
def _without_amx_buffers(llama_cpp) -> Iterator[None]:
    """Where llama.cpp's CPU backend was built with AMX, models load without its extra buffer types: its AMX matmul
    (``ggml_backend_amx_mul_mat``, chosen for q8_0 weights) crashes the process on machines whose kernel does not
    grant the AMX tile state (seen on this project's virtual machines). The other kernels compute the same
    products."""
    if b"AMX" not in llama_cpp.llama_print_system_info():
        yield
        return
    low = llama_cpp.llama_cpp  # the module whose defaults ``Llama`` reads
    default = low.llama_model_default_params

    def params():
        chosen = default()
        chosen.use_extra_bufts = False
        return chosen

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


@contextmanager
def capture_log(lines: list[str]) -> Iterator[None]:
    """Collect llama.cpp's log (which it would print to stderr) into ``lines`` while the block runs."""
    llama_cpp = _llama_cpp()
    pending: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):  # noqa: ARG001 - the C callback's signature
        pending.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield
    finally:
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama-cpp-python's own callback, printing errors only
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
        lines.extend("".join(pending).splitlines())


def perplexity(path: Path, windows: Sequence[Sequence[int]], *, f32_cache: bool = True) -> float:
    """exp(mean next-token NLL) over all windows, each evaluated from an empty cache."""
    total, count = 0.0, 0
    with open_engine(path, n_ctx=max(len(w) for w in windows), f32_cache=f32_cache) as engine:
        for window in windows:
            logits = engine.logits(window)
            total += nll_sum(logits, window)
            count += len(window) - 1
    return float(np.exp(total / count))


def nll_sum(logits: np.ndarray, tokens: Sequence[int]) -> float:
    """Sum of −log p(token[t+1] | ≤ t) for logits of shape (len(tokens), vocab)."""
    shifted = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1))
    picked = shifted[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
    return float((log_norm - picked).sum())


def quantize(src: Path, dst: Path, ftype: str = "Q4_K_M", keep: dict[str, str] | None = None, threads: int = 0) -> None:
    """Quantize ``src`` into ``dst`` with llama.cpp's own ``llama_model_quantize``.

    ``ftype`` is a llama.cpp file type name (Q4_K_M, Q8_0, …); ``keep`` maps tensor-name regexes
    to a GGML type name that overrides it for those tensors (e.g. ``{"attn_kv_a_mqa": "F32"}``).
    """
    llama_cpp = _llama_cpp()
    try:
        file_type = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    except AttributeError:
        raise MlaconvError(f"llama.cpp has no file type {ftype!r}") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type
    params.nthread = threads
    holders = []
    if keep:
        import gguf

        overrides = (llama_cpp.llama_model_tensor_override * (len(keep) + 1))()
        for slot, (pattern, type_name) in zip(overrides, keep.items()):
            holders.append(pattern.encode())
            slot.pattern = holders[-1]
            slot.type = int(gguf.GGMLQuantizationType[type_name.upper()])
        overrides[len(keep)].pattern = None
        params.tt_overrides = overrides
    log: list[str] = []
    with capture_log(log):
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        raise MlaconvError(f"llama.cpp could not quantize {src} to {ftype}: {log[-1] if log else status}")
