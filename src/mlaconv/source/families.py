"""Source families whose tensors differ from Llama's, as small hooks (llama.cpp's convert_hf_to_gguf.py shape).

Everything downstream of ``SourceWeights`` sees one canonical layout, Llama's: ``q_proj``/``k_proj``/
``v_proj``/``o_proj``, a SwiGLU MLP and two RMSNorms per layer, rotate-half RoPE over the whole head,
softmax scale d^-½, no multipliers. A family only says how its checkpoint maps onto that layout:

- ``read``: where a canonical tensor comes from (Phi-3 slices it out of a fused tensor), and ``stored_name``, the
  checkpoint tensor it is when it is one whole;
- ``factor``: what to fold into it (Granite's multipliers), which ``modify`` applies; a tensor neither sliced nor
  folded is copied into the output unread;
- ``rope_layers``: which layers rotate at all (SmolLM3 leaves every fourth without RoPE).

A family with ``qk_norm`` (Qwen3) also RMS-normalises each query and key head before RoPE; its layers carry
the two norm weights, and only a calibrated conversion takes them (``mla.qk_norm``).

Partial rotary and LongRoPE's attention factor are config, not family, matters: ``SourceWeights`` puts
the non-rotated head dims into rotate-half pairs of frequency 0 and folds the factor into the query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import torch

from mlaconv.errors import MlaconvError
from mlaconv.mla import qk_norm
from mlaconv.mla.layer import SourceAttention
from mlaconv.mla.forward import MLPWeights

if TYPE_CHECKING:
    from mlaconv.source.spec import SourceSpec
    from mlaconv.io.reader import StoredTensor

BiasRule = Literal["never", "always", "config"]

# Canonical tensor names: Llama's, which are also DeepSeek-V3's for the embedding, head, norms and MLP.
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
Q, K, V, O = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
GATE, UP, DOWN = "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"
INPUT_NORM = "input_layernorm.weight"
Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
POST_ATTENTION_NORM = "post_attention_layernorm.weight"
W, B = ".weight", ".bias"


def layer_name(i: int, key: str) -> str:
    return f"model.layers.{i}.{key}"


Reader = Callable[..., torch.Tensor]  # get(name, keep=False): a checkpoint tensor; keep: a fused one, read once


@dataclass(frozen=True)
class Family:
    """One source family with Llama's layout: how to recognise it, where its biases are, what it may set."""

    label: str
    model_types: tuple[str, ...]
    qkv_bias: BiasRule = "never"
    o_bias: BiasRule = "never"
    sliding_window_flag: str | None = None  # config key that switches sliding windows on (None: window alone)
    partial_rotary: bool = False  # whether transformers' class honours partial_rotary_factor
    upstreamed_code: tuple[str, ...] = ()  # auto_map classes that transformers ships natively (never run)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (q_norm, k_norm [d])

    def check_config(self, config: dict) -> None:
        """Refuse, in one line, a malformed family-specific setting (nothing to check for Llama's layout)."""

    def rope_layers(self, config: dict, layers: int) -> tuple[bool, ...]:
        """Which layers apply RoPE (all of them, unless the family says otherwise)."""
        return (True,) * layers

    def layer_shapes(self, spec: "SourceSpec") -> dict[str, tuple[int, ...]]:
        """The checkpoint's per-layer tensors (names relative to the layer) and their shapes."""
        H, N, G, d, F = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
        shapes = {Q + W: (N * d, H), K + W: (G * d, H), V + W: (G * d, H), O + W: (H, N * d),
                  GATE: (F, H), UP: (F, H), DOWN: (H, F), INPUT_NORM: (H,), POST_ATTENTION_NORM: (H,)}
        if spec.qkv_bias:
            shapes.update({Q + B: (N * d,), K + B: (G * d,), V + B: (G * d,)})
        if spec.o_bias:
            shapes[O + B] = (H,)
        if self.qk_norm:
            shapes.update({Q_NORM: (d,), K_NORM: (d,)})
        return shapes

    def read(self, get: Reader, spec: "SourceSpec", i: int | None, key: str) -> torch.Tensor:
        """The canonical tensor ``key`` (of layer ``i``; top level when None) from the checkpoint."""
        return get(self.stored_name(spec, i, key))

    def stored_name(self, spec: "SourceSpec", i: int | None, key: str) -> str | None:
        """The checkpoint tensor that ``read`` returns whole for ``key`` (None: it is sliced out of another)."""
        return key if i is None else layer_name(i, key)

    def factor(self, spec: "SourceSpec", key: str) -> float:
        """What the family multiplies around canonical tensor ``key`` (nothing for Llama's layout)."""
        return 1.0

    def modify(self, spec: "SourceSpec", key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Fold ``factor`` into the tensor (the tensor itself when it is 1)."""
        factor = self.factor(spec, key)
        if factor == 1.0:
            return tensor
        return tensor.to(torch.promote_types(tensor.dtype, torch.float32)) * factor


_PHI3_FUSED = {Q + W: ("self_attn.qkv_proj.weight", 0), K + W: ("self_attn.qkv_proj.weight", 1),
               V + W: ("self_attn.qkv_proj.weight", 2), GATE: ("mlp.gate_up_proj.weight", 0),
               UP: ("mlp.gate_up_proj.weight", 1)}


@dataclass(frozen=True)
class Phi3(Family):
    """Phi-3/3.5/4-mini: q, k, v fused row-wise in ``qkv_proj`` and gate, up in ``gate_up_proj``."""

    def layer_shapes(self, spec: "SourceSpec") -> dict[str, tuple[int, ...]]:
        H, N, G, d, F = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
        shapes = {k: v for k, v in super().layer_shapes(spec).items() if k not in _PHI3_FUSED}
        return shapes | {"self_attn.qkv_proj.weight": ((N + 2 * G) * d, H), "mlp.gate_up_proj.weight": (2 * F, H)}

    def stored_name(self, spec: "SourceSpec", i: int | None, key: str) -> str | None:
        return None if i is not None and key in _PHI3_FUSED else super().stored_name(spec, i, key)

    def read(self, get: Reader, spec: "SourceSpec", i: int | None, key: str) -> torch.Tensor:
        if i is None or key not in _PHI3_FUSED:
            return super().read(get, spec, i, key)
        fused, part = _PHI3_FUSED[key]
        N, G, d, F = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
        rows = (N * d, G * d, G * d) if fused.startswith("self_attn.") else (F, F)
        start = sum(rows[:part])
        return get(layer_name(i, fused), keep=True)[start : start + rows[part]].clone()


@dataclass(frozen=True)
class Granite(Family):
    """Granite: μP multipliers, each folded into the tensor it scales — embedding ×m_emb, softmax scale
    m_attn instead of d^-½ (into the query, ×m_attn·√d), each residual branch ×m_res (o_proj, down_proj),
    logits ÷ logits_scaling (lm_head)."""

    MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")

    def check_config(self, config: dict) -> None:
        for key in self.MULTIPLIERS:
            _multiplier(config, key)

    def factor(self, spec: "SourceSpec", key: str) -> float:
        c = spec.config
        residual = _multiplier(c, "residual_multiplier")
        query = _multiplier(c, "attention_multiplier") * math.sqrt(spec.head_dim)  # transformers: 1.0 if unset
        return {EMBED: _multiplier(c, "embedding_multiplier"), LM_HEAD: 1 / _multiplier(c, "logits_scaling"),
                Q + W: query, Q + B: query, O + W: residual, O + B: residual, DOWN: residual}.get(key, 1.0)


def _multiplier(config: dict, key: str, default: float = 1.0) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise MlaconvError(f"config.json: {key} = {value!r} is not a positive number")
    return float(value)


@dataclass(frozen=True)
class SmolLM3(Family):
    """SmolLM3: Llama's layout, but some layers apply no RoPE (``no_rope_layers[i] == 0``; by default every
    ``no_rope_layer_interval``-th). Their shared key carries no rotation: all key energy goes to the latent."""

    def rope_layers(self, config: dict, layers: int) -> tuple[bool, ...]:
        flags = config.get("no_rope_layers")
        if flags is None:
            interval = config.get("no_rope_layer_interval", 4)
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise MlaconvError(f"config.json: no_rope_layer_interval = {interval!r} is not a positive int")
            flags = [int((i + 1) % interval != 0) for i in range(layers)]
        if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
            raise MlaconvError(f"config.json: no_rope_layers must list 0 or 1 for each of the {layers} layers")
        return tuple(bool(f) for f in flags)


class SourceWeights:
    """The canonical (Llama-layout) tensors of a source checkpoint, read one group at a time.

    The last fused tensor read is kept until the group is read (Phi-3's q, k and v come from one
    ``qkv_proj``); every other tensor is read when asked for and owned by the caller.
    """

    def __init__(self, reader, spec: "SourceSpec"):
        self.reader, self.spec, self.family = reader, spec, spec.family
        self._fused: tuple[str, torch.Tensor] | None = None

    def _get(self, name: str, keep: bool = False) -> torch.Tensor:
        if not keep:
            return self.reader.get(name)  # the reader refuses NaN and Inf
        if self._fused is None or self._fused[0] != name:
            self._fused = None
            self._fused = (name, self.reader.get(name))
        return self._fused[1]

    def tensor(self, i: int | None, key: str) -> torch.Tensor:
        """One canonical tensor: layer ``i``'s ``key`` (top level when None), read and folded."""
        return self.family.modify(self.spec, key, self.family.read(self._get, self.spec, i, self._source_key(i, key)))

    def stored(self, i: int | None, key: str, dtype: torch.dtype) -> "StoredTensor | None":
        """Where the canonical tensor lies as it is, in ``dtype``, in the checkpoint, checked
        (``CheckpointReader.stored``), for copying its bytes unread; None when the family slices or folds it, it is
        in another dtype, or the checkpoint is a pickle."""
        name = self.family.stored_name(self.spec, i, self._source_key(i, key))
        if name is None or self.family.factor(self.spec, key) != 1.0 or self.reader.dtype(name) != dtype:
            return None
        return self.reader.stored(name)

    def _source_key(self, i: int | None, key: str) -> str:
        """Tied weights: the head is the raw embedding."""
        return EMBED if i is None and key == LM_HEAD and LM_HEAD not in self.reader else key

    def release(self) -> None:
        self._fused = None

    def attention(self, i: int) -> SourceAttention:
        """Layer i's attention in the canonical layout (see ``canonical_rope``), its input norm γ included."""
        s = self.spec

        def bias(key: str, present: bool) -> torch.Tensor | None:
            return self.tensor(i, key) if present and layer_name(i, key) in self.reader else None

        norms = self.family.qk_norm  # the query's RoPE factor then goes after the norm, on its weight
        q, q_bias = canonical_rope(s, self.tensor(i, Q + W), bias(Q + B, s.qkv_bias), query=not norms)
        k, k_bias = canonical_rope(s, self.tensor(i, K + W), bias(K + B, s.qkv_bias), query=False)
        q_norm = k_norm = None
        if norms:  # one head's weight [d], reordered like the head's rows
            q_norm = canonical_rope(s, self.tensor(i, Q_NORM)[:, None], None, query=True)[0][:, 0]
            k_norm = canonical_rope(s, self.tensor(i, K_NORM)[:, None], None, query=False)[0][:, 0]
        attention = SourceAttention(
            q=q, k=k, v=self.tensor(i, V + W), o=self.tensor(i, O + W), input_norm=self.tensor(i, INPUT_NORM),
            q_bias=q_bias, k_bias=k_bias, v_bias=bias(V + B, s.qkv_bias), o_bias=bias(O + B, s.o_bias),
            rotated=s.rope_layers[i], q_norm=q_norm, k_norm=k_norm, qk_norm_eps=s.rms_norm_eps,
        )
        self.release()
        return attention

    def key(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's canonical key projection and input norm γ (what the rope stride is chosen from); with QK-norm,
        its weights-only linear stand-in."""
        k, _ = canonical_rope(self.spec, self.tensor(i, K + W), None, query=False)
        gamma = self.tensor(i, INPUT_NORM)
        if self.family.qk_norm:
            norm = canonical_rope(self.spec, self.tensor(i, K_NORM)[:, None], None, query=False)[0][:, 0]
            k = qk_norm.weights_only_keys(k, norm, gamma)
        self.release()
        return k, gamma

    def mlp(self, i: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MLPWeights:
        """Layer i's MLP and its pre-norm, each tensor moved to ``device``/``dtype`` as it is read."""
        def get(key: str) -> torch.Tensor:
            return self.tensor(i, key).to(device=device, dtype=dtype)

        weights = MLPWeights(gate=get(GATE), up=get(UP), down=get(DOWN), post_attention_norm=get(POST_ATTENTION_NORM))
        self.release()
        return weights


def canonical_rope(spec: "SourceSpec", w: torch.Tensor, bias: torch.Tensor | None,
                   query: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Query or key rows [heads·d, H] in rotate-half pairs over the whole head, with their bias.

    Partial rotary (the first d_rot dims rotate, pairs (j, j + d_rot/2); the rest pass) becomes pairs
    (j, j + d/2) over the whole head whose last (d − d_rot)/2 pairs have frequency 0: the rows are
    reordered per head, identically for q and k, so q·k is unchanged. The query's rotated rows carry the
    RoPE attention factor squared (LongRoPE scales cos and sin, hence both q and k, on rotated dims only).
    """
    d, rot = spec.head_dim, spec.rotary_dim
    factor = spec.rope_attention_factor**2 if query else 1.0
    if rot == d and factor == 1.0:
        return w, bias
    half, passing = rot // 2, (d - rot) // 2
    order = torch.cat([torch.arange(half), rot + torch.arange(passing), half + torch.arange(half),
                       rot + passing + torch.arange(passing)])
    scale = torch.ones(d)
    scale[:half] = scale[d // 2 : d // 2 + half] = factor  # the rotated pairs, after the reordering

    def reorder(t: torch.Tensor) -> torch.Tensor:
        heads = t.shape[0] // d
        t = t.reshape(heads, d, *t.shape[1:])[:, order]
        if factor != 1.0:
            t = t.to(torch.promote_types(t.dtype, torch.float32)) * scale.view(d, *[1] * (t.dim() - 2))
        return t.reshape(heads * d, *t.shape[2:])

    return reorder(w), None if bias is None else reorder(bias)
