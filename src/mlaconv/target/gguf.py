"""A converted checkpoint as one llama.cpp GGUF file (architecture ``deepseek2``), written tensor by tensor.

Checked against llama.cpp 0c1e57098, the tree vendored in llama-cpp-python 0.3.36 (its
``src/models/deepseek2.cpp``, ``llama-model.cpp``, ``llama-hparams.cpp``, ``llama-context.cpp``).
How the dense DeepSeek-V3 folder maps onto what that loader and graph expect:

- ``attention.q_lora_rank`` = 0: a full-rank ``attn_q``. The loader requires the key (except for
  26, 27 or 48 layers) and llama.cpp's own converter omits it when ``q_lora_rank`` is null.
- MLA: ``key_length`` = r + R and ``value_length`` = r (the cached latent and shared rope key, one
  "KV head"); ``key_length_mla`` = P + R and ``value_length_mla`` = V (the per-head sizes);
  ``kv_b_proj`` goes in as ``attn_k_b`` (W_UK per head, transposed: n_head × r × P) and ``attn_v_b``
  (n_head × V × r), the absorbed layout llama.cpp's MLA path (and cache) use.
- RoPE: deepseek2 rotates interleaved pairs, as the checkpoint stores them (``rope_interleave``).
  Whenever its frequency scale s ≠ 1, llama.cpp also multiplies deepseek2's attention scores by
  (1 + 0.1·ln s⁻¹)² (its YaRN mscale, applied for linear scaling too); transformers does not, so the
  export divides ``attn_q`` (which feeds only the scores) by that factor. ``llama3`` scaling needs
  per-frequency factors that deepseek2's rope is never given: refused.
- No attention biases exist in deepseek2: refused unless they are all zero.
- Every layer dense: ``leading_dense_block_count`` = n_layer; ``expert_feed_forward_length`` and
  ``expert_shared_count`` are required keys, set to the MLP width and 0.

Tensors are read one at a time and written in row blocks. The tensor-info section has the same
length whatever the tensor types, so it is written last, over a placeholder of that length.
Quantized or half-precision tensors are checked row by row after rounding: one whose rows lose more
than ``ROW_ERROR_LIMIT`` of their norm (values below the target type's range, as in the tiny
latent rows of ``kv_a_proj_with_mqa``) is written in float32 instead, and the report names it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType

from mlaconv.errors import MlaconvError
from mlaconv.io.reader import CheckpointReader, read_config
from mlaconv.io.writer import atomic_output_file, check_free_space
from mlaconv.mla.layer import MLAShape
from mlaconv.progress import Progress, no_progress
from mlaconv.source import names
from mlaconv.target import deepseek
from mlaconv.target.deepseek import checkpoint_layers
from mlaconv.target.gguf_vocab import Vocabulary, read_vocabulary

LLAMA_CPP_CHECKED = "llama.cpp 0c1e57098 (vendored in llama-cpp-python 0.3.36)"
OUTTYPES: dict[str, tuple[QType, LlamaFileType]] = {
    "f32": (QType.F32, LlamaFileType.ALL_F32),
    "bf16": (QType.BF16, LlamaFileType.MOSTLY_BF16),
    "f16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
ROW_ERROR_LIMIT = 0.05  # relative norm error of a row after rounding; q8_0 of an ordinary row is ~0.005
_CHUNK_BYTES = 64 * 2**20
_ALIGN = gguf.GGUF_DEFAULT_ALIGNMENT
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class DeepseekShape(MLAShape):
    """The dense DeepSeek-V3 config, as llama.cpp's deepseek2 needs it: the attention's shape and the rest."""

    layers: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    context: int
    linear_factor: float | None

    @property
    def score_scale(self) -> float:
        """What attn_q is multiplied by to cancel llama.cpp's (1 + 0.1·ln s⁻¹)² on the scores (1 without scaling)."""
        if not self.linear_factor or self.linear_factor <= 1.0:
            return 1.0
        return 1.0 / (1.0 + 0.1 * math.log(self.linear_factor)) ** 2


def read_shape(config: dict) -> DeepseekShape:
    """Validate a DeepSeek-V3 ``config.json`` for the deepseek2 export; one-line errors for what it cannot hold."""
    if config.get("model_type") != "deepseek_v3":
        raise MlaconvError(f"model_type {config.get('model_type')!r} is not deepseek_v3: export gguf takes the output "
                           "folder of mlaconv convert")
    layers = _int(config, "num_hidden_layers")
    if config.get("q_lora_rank") is not None:
        raise MlaconvError("q_lora_rank is set (a low-rank query): export gguf writes mlaconv's full-rank q_proj only")
    if int(config.get("first_k_dense_replace") or 0) < layers:
        raise MlaconvError("the config has mixture-of-experts layers (first_k_dense_replace < num_hidden_layers); "
                           "export gguf writes dense models only — use llama.cpp's convert_hf_to_gguf.py")
    if config.get("num_nextn_predict_layers"):
        raise MlaconvError("the config has multi-token-prediction layers, which export gguf does not write")
    if config.get("rope_interleave", True) is not True:
        raise MlaconvError("rope_interleave is false; llama.cpp's deepseek2 rotates interleaved pairs only")
    if config.get("hidden_act", "silu") != "silu":
        raise MlaconvError(f"hidden_act {config['hidden_act']!r}: llama.cpp's deepseek2 MLP is SwiGLU (silu)")
    return DeepseekShape(
        hidden=_int(config, "hidden_size"), layers=layers, heads=_int(config, "num_attention_heads"),
        rank=_int(config, "kv_lora_rank"), rope_dim=_int(config, "qk_rope_head_dim"),
        nope_dim=_int(config, "qk_nope_head_dim"), v_dim=_int(config, "v_head_dim"),
        ffn=_int(config, "intermediate_size"), vocab=_int(config, "vocab_size"),
        eps=float(config.get("rms_norm_eps") or 1e-6), rope_theta=float(config.get("rope_theta") or 10000.0),
        context=_int(config, "max_position_embeddings"), linear_factor=_linear_factor(config.get("rope_scaling")),
    )


def _int(config: dict, key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MlaconvError(f"config.json: {key} = {value!r} is not a positive integer")
    return value


def _linear_factor(scaling: dict | None) -> float | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return float(scaling["factor"])
    if kind == "llama3":
        raise MlaconvError(
            "rope_scaling llama3 cannot be reproduced by llama.cpp's deepseek2 (its rope takes no per-frequency "
            "factors); the GGUF would compute a different model at every position, so it is not written"
        )
    raise MlaconvError(f"rope_scaling {kind!r}: export gguf handles none and linear")


@dataclass(frozen=True)
class Entry:
    """One GGUF tensor: its name, its shape (row-major, last axis = GGUF rows) and how to read it."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]  # in the checkpoint's dtype
    scale: float = 1.0  # applied in float32, one row block at a time


def plan_entries(shape: DeepseekShape, reader: CheckpointReader) -> list[Entry]:
    """The GGUF tensors in file order, with the source tensors' shapes checked against the config."""
    s = shape
    N, H, P, R, V, r, F = s.heads, s.hidden, s.nope_dim, s.rope_dim, s.v_dim, s.rank, s.ffn

    def source(name: str, expected: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        if name not in reader:
            raise MlaconvError(f"the checkpoint has no tensor {name}")
        if tuple(reader.shape(name)) != expected:
            raise MlaconvError(f"{name} has shape {list(reader.shape(name))}, the config implies {list(expected)}")
        return lambda: reader.get(name)

    def kv_b_part(name: str, part: str) -> Callable[[], torch.Tensor]:
        load = source(name, (N * (P + V), r))

        def split() -> torch.Tensor:
            per_head = load().view(N, P + V, r)
            return per_head[:, :P, :].transpose(1, 2).contiguous() if part == "k" else per_head[:, P:, :].contiguous()

        return split

    entries = [Entry("token_embd.weight", (s.vocab, H), source(names.EMBED, (s.vocab, H)))]
    for layer in checkpoint_layers(reader, s.layers):
        p, b = layer.prefix, f"blk.{layer.index}."
        entries += [
            Entry(b + "attn_norm.weight", (H,), source(p + "input_layernorm.weight", (H,))),
            Entry(b + "attn_q.weight", (N * (P + R), H), source(p + deepseek.Q_PROJ, (N * (P + R), H)),
                  s.score_scale),
            Entry(b + "attn_kv_a_mqa.weight", (r + R, H), source(p + deepseek.KV_A_PROJ, (r + R, H))),
            Entry(b + "attn_kv_a_norm.weight", (r,), source(p + deepseek.KV_A_NORM, (r,))),
            Entry(b + "attn_k_b.weight", (N, r, P), kv_b_part(p + deepseek.KV_B_PROJ, "k")),
            Entry(b + "attn_v_b.weight", (N, V, r), kv_b_part(p + deepseek.KV_B_PROJ, "v")),
            Entry(b + "attn_output.weight", (H, N * V), source(p + deepseek.O_PROJ, (H, N * V))),
            Entry(b + "ffn_norm.weight", (H,), source(p + "post_attention_layernorm.weight", (H,))),
            Entry(b + "ffn_gate.weight", (F, H), source(p + _MLP[0], (F, H))),
            Entry(b + "ffn_up.weight", (F, H), source(p + _MLP[1], (F, H))),
            Entry(b + "ffn_down.weight", (H, F), source(p + _MLP[2], (H, F))),
        ]
    entries.append(Entry("output_norm.weight", (H,), source(names.FINAL_NORM, (H,))))
    if names.LM_HEAD in reader:  # else llama.cpp uses token_embd (tied embeddings)
        entries.append(Entry("output.weight", (s.vocab, H), source(names.LM_HEAD, (s.vocab, H))))
    return entries


def check_biases(reader: CheckpointReader) -> None:
    """deepseek2 has no attention biases: refuse any that is not zero, naming them."""
    names = [n for n in reader.names if n.endswith(".bias")]
    nonzero = [n for n in names if bool(reader.get(n).ne(0).any())]
    if nonzero:
        kinds = sorted({n.split("self_attn.", 1)[-1] for n in nonzero})
        raise MlaconvError(
            f"{len(nonzero)} attention bias tensors are not zero ({', '.join(kinds)}, e.g. {nonzero[0]}); llama.cpp's "
            "deepseek2 has no attention biases, so the GGUF would compute a different model (Qwen2 sources carry them)"
        )


def export_gguf(folder: Path, path: Path, outtype: str = "f32", force: bool = False, use_tokenizer: bool = True,
                progress: Progress = no_progress, row_error_limit: float = ROW_ERROR_LIMIT) -> dict:
    """Write the converted checkpoint in ``folder`` to the GGUF file ``path``; return the report."""
    if outtype not in OUTTYPES:
        raise MlaconvError(f"--outtype {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    started = time.perf_counter()
    folder, path = Path(folder), Path(path)
    shape = read_shape(read_config(folder))
    reader = CheckpointReader(folder)
    entries = plan_entries(shape, reader)
    check_biases(reader)
    vocabulary = read_vocabulary(folder, shape.vocab, use_tokenizer)
    target, file_type = OUTTYPES[outtype]
    planned = {e.name: _planned_type(e.shape, target) for e in entries}
    check_free_space(path.parent if path.parent.exists() else Path.cwd(),
                     sum(_nbytes(e.shape, planned[e.name]) for e in entries))

    def header(types: dict[str, QType], where: Path) -> bytes:
        return _header_bytes(where, shape, vocabulary, file_type, folder.name, entries, types)

    actual: dict[str, QType] = {}
    worst: dict[str, float] = {}
    with atomic_output_file(path, force) as tmp:
        scratch = tmp.with_name(tmp.name + ".header")
        reserved = len(header(planned, scratch))
        data_start = _pad(reserved)
        with open(tmp, "wb") as out:
            out.seek(data_start)
            for entry in progress(entries, f"writing {path.name}", len(entries)):
                actual[entry.name], worst[entry.name] = _write_tensor(out, entry, planned[entry.name], row_error_limit)
                out.write(b"\0" * (_pad(out.tell() - data_start) - (out.tell() - data_start)))
            final = header(actual, scratch)
            if len(final) != reserved:
                raise AssertionError("the GGUF header changed length between the plan and the write")
            out.seek(0)
            out.write(final + b"\0" * (data_start - reserved))
        scratch.unlink(missing_ok=True)
    kept = sorted(n for n in actual if actual[n] != planned[n])
    types: dict[str, int] = {}
    for qtype in actual.values():
        types[qtype.name] = types.get(qtype.name, 0) + 1
    return {
        "output": str(path), "source": str(folder), "architecture": "deepseek2", "outtype": outtype,
        "bytes": path.stat().st_size, "tensors": len(entries), "tensor_types": types,
        "kept_float32": kept, "worst_row_error": max(worst.values(), default=0.0),
        "row_error_limit": row_error_limit, "vocab": vocabulary.summary(),
        "kv_lora_rank": shape.rank, "qk_rope_head_dim": shape.rope_dim,
        "kv_cache_elements_per_token_per_layer": shape.cache_elements,
        "rope_scaling": {"type": "linear", "factor": shape.linear_factor} if shape.score_scale != 1.0 else None,
        "q_scale_folded": shape.score_scale, "llama_cpp_checked": LLAMA_CPP_CHECKED,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _planned_type(shape: tuple[int, ...], target: QType) -> QType:
    """1-D tensors stay float32 (as llama.cpp keeps norms); rows that are no whole number of blocks go f16."""
    if len(shape) == 1:
        return QType.F32
    block, _ = gguf.GGML_QUANT_SIZES[target]
    return target if shape[-1] % block == 0 else QType.F16


def _nbytes(shape: tuple[int, ...], qtype: QType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _write_tensor(out: BinaryIO, entry: Entry, qtype: QType, limit: float) -> tuple[QType, float]:
    """Write one tensor at the current position in ``qtype``, or in float32 if rounding loses a row."""
    tensor = entry.load()
    if tuple(tensor.shape) != entry.shape:
        raise AssertionError(f"{entry.name}: planned {entry.shape}, read {tuple(tensor.shape)}")
    rows = tensor.reshape(-1, entry.shape[-1])
    step = max(1, _CHUNK_BYTES // (4 * rows.shape[1]))
    start, worst = out.tell(), 0.0
    for first in range(0, rows.shape[0], step):
        block = rows[first:first + step].float()
        if entry.scale != 1.0:
            block = block * entry.scale
        data, error = _encode(block.contiguous().numpy(), qtype)
        if error > limit:
            out.seek(start)
            out.truncate()
            return _write_tensor(out, entry, QType.F32, limit)
        worst = max(worst, error)
        out.write(data.tobytes())
    return qtype, worst


def _encode(rows: np.ndarray, qtype: QType) -> tuple[np.ndarray, float]:
    """(GGUF bytes of float32 ``rows`` in ``qtype``, the largest relative norm error of a row after rounding)."""
    if qtype == QType.F32:
        return rows, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        data = gguf.quants.quantize(rows, qtype)
        back = gguf.quants.dequantize(data, qtype).reshape(rows.shape)
    norms = np.linalg.norm(rows, axis=1)
    errors = np.linalg.norm(back - rows, axis=1)
    if not np.all(np.isfinite(errors)):
        return data, math.inf
    relative = np.divide(errors, norms, out=np.where(errors > 0, np.inf, 0.0), where=norms > 0)
    return data, float(relative.max(initial=0.0))


def _header_bytes(scratch: Path, shape: DeepseekShape, vocabulary: Vocabulary, file_type: LlamaFileType, name: str,
                  entries: list[Entry], types: dict[str, QType]) -> bytes:
    """Header, metadata and tensor infos of the file, built by gguf-py's writer (in a scratch file)."""
    s = shape
    writer = gguf.GGUFWriter(scratch, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(1)  # the MLA cache is one shared "head" of r + R
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_rope_dimension_count(s.rope_dim)
    if s.score_scale != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(s.linear_factor))
    else:
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_vocab_size(s.vocab)
    writer.add_leading_dense_block_count(s.layers)
    writer.add_q_lora_rank(0)
    writer.add_kv_lora_rank(s.rank)
    writer.add_key_length(s.cache_elements)
    writer.add_value_length(s.rank)
    writer.add_key_length_mla(s.nope_dim + s.rope_dim)
    writer.add_value_length_mla(s.v_dim)
    writer.add_expert_feed_forward_length(s.ffn)
    writer.add_expert_shared_count(0)
    vocabulary.write(writer)
    for entry in entries:
        qtype = types[entry.name]
        writer.add_tensor_info(entry.name, entry.shape, np.dtype(np.float32), _nbytes(entry.shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    try:
        return scratch.read_bytes()
    finally:
        scratch.unlink(missing_ok=True)
