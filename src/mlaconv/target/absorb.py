"""Absorbed MLA inference weights: attention that runs on the cached latent, written beside a checkpoint.

Notation (DeepSeek-V3 with ``q_lora_rank = null``): H hidden, N heads, r ``kv_lora_rank``,
R ``qk_rope_head_dim``, P ``qk_nope_head_dim``, V ``v_head_dim``; x [H] is a token after the
layer's input RMSNorm. The standard (expanded) attention of head n over cached tokens t is

    [q^C_n ; q^R_n] = W^Q_n x                         q_proj              [N·(P+R), H]
    [c_t ; k^R_t]   = W^DKV x_t                       kv_a_proj_with_mqa  [r+R, H]
    ĉ_t             = w ⊙ c_t / √(mean(c_t²) + ε)     kv_a_layernorm      [r], ε = 1e-6
    [k^C_{n,t} ; v_{n,t}] = [W^UK_n ; W^UV_n] ĉ_t     kv_b_proj           [N·(P+V), r]
    s_{n,t} = σ·(q^C_n·k^C_{n,t} + rope(q^R_n)·rope(k^R_t)),  σ = (P+R)^-½
    out     = Σ_n W^O_n Σ_t softmax_t(s_n) v_{n,t}    o_proj              [H, N·V]

In mlaconv checkpoints the latent is tiny (mean(c²) ≤ δ·ε for every possible token, see
``mlaconv.mla.latent_norm``), so the norm is the linear map ĉ = (w/√ε) ⊙ c up to a relative error of
1 − (1 + δ)^-½. Folding that diagonal into the down-projection makes the cache row
[ĉ_t ; rope(k^R_t)] (r + R values) a linear function of x_t, and both up-projections fold away:

    q_latent[n]  = W^UK_nᵀ W^Q_{C,n}                  [N, r, H]    so q^C_n·k^C_{n,t} = (q_latent[n] x)·ĉ_t
    q_rope       = W^Q_R                              [N·R, H]     the rope rows of q_proj, per head
    kv_down      = [diag(w/√ε) W^DKV_C ; W^DKV_R]     [r+R, H]     the cache row before RoPE
    o_latent     = [W^O_1 W^UV_1 | … | W^O_N W^UV_N]  [H, N·r]     applied to the per-head Σ_t p_{n,t} ĉ_t

The writer checks the tiny-latent assumption from the weights (a bound over all inputs, not a sample)
and refuses a checkpoint where the norm is not linear to ``max_norm_nonlinearity``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaconv import __version__
from mlaconv.errors import MlaconvError
from mlaconv.io import CheckpointReader, ShardedWriter, atomic_output_dir, read_config
from mlaconv.io.writer import DEFAULT_SHARD_BYTES
from mlaconv.mla import rope
from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.mla.layer import MLAAttention, MLAShape
from mlaconv.source import names
from mlaconv.source.spec import rope_settings
from mlaconv.target import deepseek
from mlaconv.target.deepseek import checkpoint_layers

ABSORBED_DIR = "absorbed"
MANIFEST = "absorbed.json"
FORMAT = "mlaconv-absorbed-mla"
FORMAT_VERSION = 1
ROPE_INV_FREQ = "rope.inv_freq"
DEFAULT_MAX_NORM_NONLINEARITY = 1e-5

LAYER_TENSORS = {
    "q_latent": ("[N, r, H]", "W^UK folded into the NoPE query: head n's query in latent space is q_latent[n] @ x"),
    "q_rope": ("[N·R, H]", "rope rows of q_proj; per head R rows in interleaved pairs (2i, 2i+1)"),
    "kv_down": ("[r+R, H]", "cache row before RoPE: r latent rows with kv_a_layernorm's w/√ε folded in, then R "
                            "rope-key rows (interleaved pairs)"),
    "kv_down_bias": ("[r+R]", "bias of kv_down (only with attention_bias), scaled like its rows"),
    "o_latent": ("[H, N·r]", "W^UV folded into o_proj: out = o_latent @ concat_n(o_lat[n])"),
    "o_bias": ("[H]", "bias of the output (only with attention_bias)"),
}


def layer_name(i: int, tensor: str) -> str:
    return f"layers.{i}.{tensor}"


@dataclass
class AbsorbedAttention:
    """One layer's absorbed inference weights (see the module docstring)."""

    q_latent: torch.Tensor  # [N, r, H]
    q_rope: torch.Tensor  # [N·R, H]
    kv_down: torch.Tensor  # [r+R, H]
    o_latent: torch.Tensor  # [H, N·r]
    kv_down_bias: torch.Tensor | None = None  # [r+R]
    o_bias: torch.Tensor | None = None  # [H]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in vars(self).items() if t is not None}

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> "AbsorbedAttention":
        return AbsorbedAttention(**{name: (t.to(device=device, dtype=dtype) if t is not None else None)
                                    for name, t in vars(self).items()})


def absorb_attention(std: MLAAttention, shape: MLAShape, eps: float = LATENT_NORM_EPS) -> AbsorbedAttention:
    """Fold W^UK into the query, W^UV into the output and the linearised latent norm into kv_a (float64)."""
    H, N, r, R, P, V = shape.hidden, shape.heads, shape.rank, shape.rope_dim, shape.nope_dim, shape.v_dim
    q_proj = std.q_proj.to(torch.float64).reshape(N, P + R, H)
    q_nope, q_rope = q_proj[:, :P], q_proj[:, P:]  # [N, P, H], [N, R, H]
    kv_b = std.kv_b_proj.to(torch.float64).reshape(N, P + V, r)
    up_key, up_value = kv_b[:, :P], kv_b[:, P:]  # W^UK [N, P, r], W^UV [N, V, r]
    o_proj = std.o_proj.to(torch.float64).reshape(H, N, V)

    norm_scale = std.kv_a_norm.to(torch.float64) / math.sqrt(eps)  # [r]: the linearised kv_a_layernorm
    row_scale = torch.cat([norm_scale, torch.ones(R, dtype=torch.float64)])  # [r+R]
    kv_down = std.kv_a_proj.to(torch.float64) * row_scale[:, None]
    return AbsorbedAttention(
        q_latent=torch.einsum("npr,nph->nrh", up_key, q_nope),
        q_rope=q_rope.reshape(N * R, H).clone(),
        kv_down=kv_down,
        o_latent=torch.einsum("hnv,nvr->hnr", o_proj, up_value).reshape(H, N * r),
        kv_down_bias=std.kv_a_bias.to(torch.float64) * row_scale if std.kv_a_bias is not None else None,
        o_bias=std.o_bias.to(torch.float64) if std.o_bias is not None else None,
    )


def latent_norm_bound(std: MLAAttention, shape: MLAShape, eps: float = LATENT_NORM_EPS) -> float:
    """max over every possible token of mean(c²)/ε, where c is the latent before kv_a_layernorm.

    The attention input is x = γ ⊙ ĥ with ‖ĥ‖² < H (ĥ is RMS-normalised), so
    ‖c‖ ≤ σ_max(W^DKV_C·diag γ)·√H + ‖b_C‖ and mean(c²) = ‖c‖²/r.
    """
    latent_rows = std.kv_a_proj[: shape.rank].to(torch.float64)
    gamma = std.input_norm.to(torch.float64)
    sigma_max = torch.linalg.matrix_norm(latent_rows * gamma[None, :], ord=2).item()
    bias_norm = std.kv_a_bias[: shape.rank].to(torch.float64).norm().item() if std.kv_a_bias is not None else 0.0
    largest_norm = sigma_max * math.sqrt(shape.hidden) + bias_norm
    return largest_norm**2 / shape.rank / eps


def norm_nonlinearity(bound: float) -> float:
    """Largest relative gap between RMSNorm and its linearisation w⊙c/√ε when mean(c²)/ε ≤ ``bound``."""
    return 1.0 - (1.0 + bound) ** -0.5


LONGROPE_REFUSAL = ("the absorbed form describes one set of RoPE frequencies, and longrope switches to another "
                    "past original_max_position_embeddings")


@dataclass(frozen=True)
class RopeSpec:
    """The interleaved RoPE of the rope dims: pair i = dims (2i, 2i+1) turns by pos·inv_freq[i]."""

    theta: float
    scaling: dict | None
    inv_freq: torch.Tensor  # [R/2] float64

    @classmethod
    def from_config(cls, config: dict) -> "RopeSpec":
        theta, scaling = rope_settings(config)
        if scaling and scaling["rope_type"] == "longrope":
            raise MlaconvError(LONGROPE_REFUSAL)
        if not config.get("rope_interleave", True):
            raise MlaconvError("rope_interleave is false; the absorbed form describes interleaved RoPE only")
        inv_freq = rope.scaled_frequencies(theta, int(config["qk_rope_head_dim"]), scaling)
        return cls(theta=theta, scaling=scaling, inv_freq=inv_freq)


def check_config(config: dict) -> None:
    """Refuse configs whose attention the absorbed form does not describe."""
    if config.get("model_type") not in ("deepseek_v3", "deepseek_v2"):
        raise MlaconvError(f"not a DeepSeek-V2/V3 checkpoint (model_type {config.get('model_type')!r})")
    if config.get("q_lora_rank") is not None:
        raise MlaconvError("q_lora_rank is set: the absorbed form here needs a full-rank q_proj (q_lora_rank null)")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if kv_heads != heads:
        raise MlaconvError(f"num_key_value_heads {kv_heads} != num_attention_heads {heads}")


def checked_absorb(std: MLAAttention, shape: MLAShape, layer: int,
                   max_norm_nonlinearity: float = DEFAULT_MAX_NORM_NONLINEARITY) -> tuple[AbsorbedAttention, float]:
    """Absorb one layer after proving its kv_a_layernorm is linear; return the weights and the latent bound."""
    bound = latent_norm_bound(std, shape)
    if norm_nonlinearity(bound) > max_norm_nonlinearity:
        raise MlaconvError(
            f"layer {layer}: kv_a_layernorm is not a linear map here (some input can reach mean(c²) = "
            f"{bound:.3g}·ε, a relative nonlinearity up to {norm_nonlinearity(bound):.3g} > "
            f"{max_norm_nonlinearity:g}); the absorbed form is exact only for mlaconv's tiny-latent checkpoints"
        )
    return absorb_attention(std, shape), bound


def write_absorbed(checkpoint_folder: Path, out_subfolder: Path | None = None, *, dtype: torch.dtype | None = None,
                   force: bool = False, max_norm_nonlinearity: float = DEFAULT_MAX_NORM_NONLINEARITY,
                   shard_size: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write the absorbed inference weights of a converted checkpoint; return the manifest.

    Reads ``checkpoint_folder`` one layer at a time and writes ``out_subfolder`` (default
    ``checkpoint_folder/absorbed``) atomically: sharded safetensors with ``model.safetensors.index.json``
    and ``absorbed.json`` (names, shapes, dtypes, the attention formula, RoPE and the norm check).
    ``dtype`` defaults to the checkpoint's q_proj dtype; the folding itself runs in float64.
    """
    folder = Path(checkpoint_folder)
    out = Path(out_subfolder) if out_subfolder is not None else folder / ABSORBED_DIR
    config = read_config(folder)
    check_config(config)
    shape = MLAShape.from_config(config)
    rope_spec = RopeSpec.from_config(config)
    reader = CheckpointReader(folder)
    out_dtype = dtype if dtype is not None else reader.dtype(names.layer_prefix(0) + deepseek.Q_PROJ)

    bounds: list[float] = []
    with atomic_output_dir(out, force=force) as tmp:
        writer = ShardedWriter(tmp, shard_size)
        writer.add(ROPE_INV_FREQ, rope_spec.inv_freq.to(torch.float32))
        for layer in checkpoint_layers(reader, int(config["num_hidden_layers"])):
            absorbed, bound = checked_absorb(layer.read_attention(), shape, layer.index, max_norm_nonlinearity)
            bounds.append(bound)
            for tensor, value in absorbed.tensors().items():
                writer.add(layer_name(layer.index, tensor), value.to(out_dtype))
            del absorbed
        index = writer.finish()
        reader.close()
        checkpoint = Path(os.path.relpath(folder.resolve(), out.resolve()))
        manifest = _manifest(checkpoint, shape, rope_spec, out_dtype, bounds, tmp, index["weight_map"])
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    manifest["folder"] = str(out)
    return manifest


def _manifest(checkpoint: Path, shape: MLAShape, rope_spec: RopeSpec, dtype: torch.dtype, bounds: list[float],
              written: Path, weight_map: dict[str, str]) -> dict:
    """absorbed.json: what is in the folder (shapes read back from the written shards) and how to use it."""
    reader = CheckpointReader(written)
    tensors = {name: {"shape": list(reader.shape(name)), "dtype": str(reader.dtype(name)).replace("torch.", ""),
                      "file": weight_map[name]}
               for name in reader.names}
    reader.close()
    H, N, r, R = shape.hidden, shape.heads, shape.rank, shape.rope_dim
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mlaconv_version": __version__,
        "checkpoint": str(checkpoint),  # relative to this folder: the standard weights the runtime also reads
        "dtype": str(dtype).replace("torch.", ""),
        "num_layers": len(bounds),
        "shapes": {"hidden_size": H, "num_heads": N, "kv_lora_rank": r, "qk_rope_head_dim": R,
                   "qk_nope_head_dim": shape.nope_dim, "v_head_dim": shape.v_dim},
        "cache": {"elements_per_token_per_layer": shape.cache_elements,
                  "row": f"[latent (first {r}) | rotated rope key (last {R})]"},
        "softmax_scale": shape.softmax_scale,
        "softmax_scale_formula": "(qk_nope_head_dim + qk_rope_head_dim) ** -0.5",
        "rope": {
            "layout": "interleaved: pair i is dims (2i, 2i+1) of each head's R rope dims and of the cached rope key",
            "rotation": "(a, b) -> (a·cos(pos·f_i) − b·sin(pos·f_i), a·sin(pos·f_i) + b·cos(pos·f_i)), f_i = inv_freq[i]",
            "theta": rope_spec.theta,
            "scaling": rope_spec.scaling,
            "inv_freq": rope_spec.inv_freq.tolist(),
            "inv_freq_tensor": ROPE_INV_FREQ,
            "positions": "0-based token positions",
        },
        "formula": [
            "per layer, x = input_layernorm(h) [H]; positions pos",
            "row = kv_down @ x (+ kv_down_bias); rotate row[r:] at pos; append row to the layer's cache [T, r+R]",
            "q_lat[n] = q_latent[n] @ x  [r];  q_rot[n] = rotate((q_rope @ x)[n·R:(n+1)·R]) at pos  [R]",
            "score[n, t] = softmax_scale · ([q_lat[n] | q_rot[n]] · cache[t])  (causal: t ≤ pos)",
            "o_lat[n] = Σ_t softmax_t(score[n]) · cache[t, :r]  [r]",
            "out = o_latent @ concat_n(o_lat[n]) (+ o_bias)  [H]; then h = h + out as in DeepSeek-V3",
        ],
        "latent_norm": {
            "eps": LATENT_NORM_EPS,
            "assumption": "kv_a_layernorm acts as the linear map w⊙c/√ε because mean(c²) ≪ ε for every input "
                          "(mlaconv's tiny latent); that diagonal is folded into kv_down",
            "max_mean_square_over_eps_per_layer": bounds,
            "max_relative_nonlinearity": norm_nonlinearity(max(bounds)) if bounds else 0.0,
        },
        "tensors": tensors,
        "tensor_meaning": {name: {"shape": shape_text, "meaning": meaning}
                           for name, (shape_text, meaning) in LAYER_TENSORS.items()},
    }


def read_absorbed_manifest(folder: Path) -> dict:
    """The parsed absorbed.json of an absorbed-weights folder."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise MlaconvError(f"{folder} has no {MANIFEST}; write it with mlaconv.target.absorb.write_absorbed")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise MlaconvError(f"{path} is not an {FORMAT} manifest")
    return manifest


def read_absorbed_layer(reader: CheckpointReader, i: int) -> AbsorbedAttention:
    """Layer ``i``'s absorbed weights from a folder written by ``write_absorbed``."""
    def optional(tensor: str) -> torch.Tensor | None:
        return reader.get(layer_name(i, tensor)) if layer_name(i, tensor) in reader else None

    return AbsorbedAttention(
        q_latent=reader.get(layer_name(i, "q_latent")), q_rope=reader.get(layer_name(i, "q_rope")),
        kv_down=reader.get(layer_name(i, "kv_down")), o_latent=reader.get(layer_name(i, "o_latent")),
        kv_down_bias=optional("kv_down_bias"), o_bias=optional("o_bias"),
    )
