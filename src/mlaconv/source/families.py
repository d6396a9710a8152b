"""The family table: one class per supported family, registered beside its hooks (``@register``, the shape of
llama.cpp's convert_hf_to_gguf.py), and why each family we refuse is refused (``REFUSED``); ``family_for`` looks a
``model_type`` up. Adding a family that shares Llama's layout is one registered class.

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
from typing import Callable, Literal, Protocol

import torch

from mlaconv.errors import MlaconvError
from mlaconv.source.names import (B, DOWN, EMBED, GATE, INPUT_NORM, K, K_NORM, LM_HEAD, O, POST_ATTENTION_NORM, Q,
                                  Q_NORM, UP, V, W, layer_name)

BiasRule = Literal["never", "always", "config"]


class SourceDims(Protocol):
    """What a family's hooks read of a source: ``source.spec.SourceSpec`` has these, built from this table."""

    config: dict
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    qkv_bias: bool
    o_bias: bool


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

    def layer_shapes(self, spec: SourceDims) -> dict[str, tuple[int, ...]]:
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

    def read(self, get: Reader, spec: SourceDims, i: int | None, key: str) -> torch.Tensor:
        """The canonical tensor ``key`` (of layer ``i``; top level when None) from the checkpoint."""
        return get(self.stored_name(spec, i, key))

    def stored_name(self, spec: SourceDims, i: int | None, key: str) -> str | None:
        """The checkpoint tensor that ``read`` returns whole for ``key`` (None: it is sliced out of another)."""
        return key if i is None else layer_name(i, key)

    def factor(self, spec: SourceDims, key: str) -> float:
        """What the family multiplies around canonical tensor ``key`` (nothing for Llama's layout)."""
        return 1.0

    def modify(self, spec: SourceDims, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Fold ``factor`` into the tensor (the tensor itself when it is 1)."""
        factor = self.factor(spec, key)
        if factor == 1.0:
            return tensor
        return tensor.to(torch.promote_types(tensor.dtype, torch.float32)) * factor


FAMILIES: list[Family] = []  # the family table, in registration order


def register(label: str, *model_types: str, **settings):
    """Register the decorated ``Family`` class for ``model_types`` (llama.cpp's ``@ModelBase.register``): its one
    instance, labelled ``label`` and set up with ``settings``, joins ``FAMILIES``. A family that shares Llama's layout
    is a class with a docstring; one that differs overrides the hooks above."""
    def add(cls: type[Family]) -> type[Family]:
        FAMILIES.append(cls(label, model_types, **settings))
        return cls

    return add


@register("Llama", "llama", qkv_bias="config", o_bias="config")
class Llama(Family):
    """Llama 1/2/3.x: the canonical layout itself."""


@register("Mistral", "mistral")
class Mistral(Family):
    """Mistral: Llama's layout without biases."""


@register("Ministral", "ministral")
class Ministral(Family):
    """Ministral: Llama's layout without biases."""


@register("Qwen2", "qwen2", qkv_bias="always", sliding_window_flag="use_sliding_window")
class Qwen2(Family):
    """Qwen2/2.5: q, k and v biases always; sliding windows only where ``use_sliding_window`` turns them on."""


_PHI3_FUSED = {Q + W: ("self_attn.qkv_proj.weight", 0), K + W: ("self_attn.qkv_proj.weight", 1),
               V + W: ("self_attn.qkv_proj.weight", 2), GATE: ("mlp.gate_up_proj.weight", 0),
               UP: ("mlp.gate_up_proj.weight", 1)}


@register("Phi-3", "phi3", partial_rotary=True,
          upstreamed_code=("configuration_phi3.Phi3Config", "modeling_phi3.Phi3ForCausalLM"))
@dataclass(frozen=True)
class Phi3(Family):
    """Phi-3/3.5/4-mini: q, k, v fused row-wise in ``qkv_proj`` and gate, up in ``gate_up_proj``."""

    def layer_shapes(self, spec: SourceDims) -> dict[str, tuple[int, ...]]:
        H, N, G, d, F = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
        shapes = {k: v for k, v in super().layer_shapes(spec).items() if k not in _PHI3_FUSED}
        return shapes | {"self_attn.qkv_proj.weight": ((N + 2 * G) * d, H), "mlp.gate_up_proj.weight": (2 * F, H)}

    def stored_name(self, spec: SourceDims, i: int | None, key: str) -> str | None:
        return None if i is not None and key in _PHI3_FUSED else super().stored_name(spec, i, key)

    def read(self, get: Reader, spec: SourceDims, i: int | None, key: str) -> torch.Tensor:
        if i is None or key not in _PHI3_FUSED:
            return super().read(get, spec, i, key)
        fused, part = _PHI3_FUSED[key]
        N, G, d, F = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
        rows = (N * d, G * d, G * d) if fused.startswith("self_attn.") else (F, F)
        start = sum(rows[:part])
        return get(layer_name(i, fused), keep=True)[start : start + rows[part]].clone()


@register("Granite", "granite", qkv_bias="config", o_bias="config")
@dataclass(frozen=True)
class Granite(Family):
    """Granite: μP multipliers, each folded into the tensor it scales — embedding ×m_emb, softmax scale
    m_attn instead of d^-½ (into the query, ×m_attn·√d), each residual branch ×m_res (o_proj, down_proj),
    logits ÷ logits_scaling (lm_head)."""

    MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")

    def check_config(self, config: dict) -> None:
        for key in self.MULTIPLIERS:
            _multiplier(config, key)

    def factor(self, spec: SourceDims, key: str) -> float:
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


@register("SmolLM3", "smollm3", qkv_bias="config", o_bias="config", sliding_window_flag="use_sliding_window")
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


@register("Qwen3", "qwen3", qkv_bias="config", o_bias="config", sliding_window_flag="use_sliding_window", qk_norm=True)
class Qwen3(Family):
    """Qwen3: Llama's layout with a per-head RMSNorm on the queries and keys (``qk_norm``); calibrated only."""


# What the DeepSeek-V3 block cannot hold, by feature; REFUSED names them per model_type.
QK_NORM = "RMSNorm on the queries and keys (q_norm, k_norm) before RoPE"
QK_NORM_ALONE = "its per-head q/k RMSNorm alone would convert with calibration, as Qwen3's does"
POST_NORMS = "norms on the attention and MLP outputs (post-norms), which the DeepSeek-V3 block has no place for"
LAYER_NORM = "LayerNorm (mean-subtracting) where DeepSeek-V3 has RMSNorm"
PARALLEL = "a parallel block (attention and MLP read the same input), where DeepSeek-V3 runs them in sequence"
GELU_MLP = "a non-gated GELU MLP, where DeepSeek-V3's is SwiGLU"
GEGLU = ("a GeGLU MLP (gelu_pytorch_tanh): vLLM's and SGLang's DeepSeek-V3 MLP is SiLU only (transformers' "
         "follows hidden_act), so no MLA engine would serve it")
SLIDING = "sliding-window layers"
SOFTCAP = "attention-logit and final-logit soft-capping (tanh)"
MOE = "mixture-of-experts layers (not handled)"
LEARNED_POSITIONS = "learned absolute position embeddings instead of RoPE"
ALIBI = "ALiBi position biases instead of RoPE"
RELU2 = "a non-gated ReLU² MLP, where DeepSeek-V3's is SwiGLU"

REFUSED: dict[str, str] = {
    "qwen3_moe": f"Qwen3-MoE has {MOE} ({QK_NORM_ALONE})",
    "olmo2": f"OLMo-2 has {POST_NORMS}, and {QK_NORM} over all heads at once (mlaconv fits per-head QK-norm only)",
    "olmo3": f"OLMo-3 has {POST_NORMS}, {SLIDING}, and {QK_NORM} over all heads at once",
    "exaone4": f"EXAONE-4 has {POST_NORMS} and {SLIDING} ({QK_NORM_ALONE})",
    "gemma": ("Gemma's √hidden embedding scale and (1 + w) RMSNorms would fold exactly into the weights, but it has "
              f"{GEGLU}"),
    "gemma2": f"Gemma-2 has {SOFTCAP}, {POST_NORMS}, {SLIDING} and {GEGLU}",
    "gemma3_text": f"Gemma-3 has {POST_NORMS}, {SLIDING} and {GEGLU} ({QK_NORM_ALONE})",
    "gemma3": f"Gemma-3 has {POST_NORMS}, {SLIDING} and {GEGLU} ({QK_NORM_ALONE})",
    "olmo": "OLMo-1 uses a non-parametric LayerNorm (mean-subtracting, no weight) where DeepSeek-V3 has RMSNorm",
    "cohere": f"Command-R (Cohere) uses {LAYER_NORM}, {PARALLEL}, and a logit scale",
    "cohere2": f"Command-R7B (Cohere2) uses {LAYER_NORM}, {PARALLEL}, and {SLIDING}",
    "stablelm": f"StableLM uses {LAYER_NORM} with biases (and optionally {PARALLEL} and per-head q/k LayerNorms)",
    "gpt_neox": f"GPT-NeoX uses {LAYER_NORM} with biases, {PARALLEL} and {GELU_MLP}",
    "falcon": f"Falcon uses {LAYER_NORM} with biases, {PARALLEL} and {GELU_MLP} (some checkpoints also ALiBi)",
    "phi": f"Phi-1/2 uses {LAYER_NORM} with biases, {PARALLEL} and {GELU_MLP}",
    "gptj": f"GPT-J uses {LAYER_NORM} with biases, {PARALLEL} and {GELU_MLP}",
    "starcoder2": f"StarCoder2 uses {LAYER_NORM} with biases, {GELU_MLP} and {SLIDING}",
    "nemotron": f"Nemotron uses LayerNorm1P (mean-subtracting, 1 + w) and {RELU2}",
    "arcee": f"Arcee (AFM) uses {RELU2}",
    "gpt2": f"GPT-2 uses {LEARNED_POSITIONS}, {LAYER_NORM} and {GELU_MLP}",
    "opt": f"OPT uses {LEARNED_POSITIONS}, {LAYER_NORM} and a ReLU MLP",
    "bloom": f"BLOOM uses {ALIBI}, {LAYER_NORM} and {GELU_MLP}",
    "mpt": f"MPT uses {ALIBI}, {LAYER_NORM} and {GELU_MLP}",
    "mixtral": f"Mixtral has {MOE}",
    "qwen2_moe": f"Qwen2-MoE has {MOE}",
    "olmoe": f"OLMoE has {MOE}",
    "phimoe": f"PhiMoE has {MOE}",
    "granitemoe": f"Granite-MoE has {MOE}",
    "llama4": f"Llama-4 has {MOE}, chunked attention and per-layer NoPE with QK norms",
    "deepseek_v2": "it already is an MLA model",
    "deepseek_v3": "it already is an MLA model",
}

SUPPORTED_TEXT = ("supported: Llama (1/2/3.x), Mistral, Ministral, Qwen2/2.5, Phi-3/3.5/4-mini, Granite (3.x), "
                  "SmolLM3 (MHA, GQA or MQA); Qwen3 with calibration")
QK_NORM_NEEDS_CALIBRATION = (
    "{label} RMS-normalises each query and key head (q_norm, k_norm) before RoPE, which no weights-only conversion "
    "can express: it needs calibration data (--calib FILE or --calib-dataset NAME) to fit and measure a linear "
    "stand-in")


def family_for(model_type: str) -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type in REFUSED:
        raise MlaconvError(f"cannot convert model_type {model_type!r}: {REFUSED[model_type]}; {SUPPORTED_TEXT}")
    raise MlaconvError(f"unsupported architecture {model_type!r}; {SUPPORTED_TEXT}")
