"""What each serving stack keeps of a converted checkpoint, and which MLA kernels its shapes fit.

Facts (from the stacks' source, see docs/serving.md): transformers honours ``attention_bias`` on
``kv_a_proj_with_mqa`` and ``o_proj`` and any ``rope_scaling`` type it implements; vLLM and SGLang
build DeepSeek attention without biases (silently skipping ``*.bias``), rotate interleaved, and
rewrite every non-default ``rope_scaling`` to DeepSeek-YaRN.
"""

from __future__ import annotations

from mlaconv.report.conversion import Serving
from mlaconv.source.spec import SourceSpec
from mlaconv.target.engines import VLLM_MLA_HEAD_SIZES, head_sizes_text


def kernel_fit(config: dict) -> dict[str, bool]:
    """Which MLA decode kernels accept these shapes (generic Triton kernels accept any)."""
    r, R, P, V = (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"],
                  config["v_head_dim"])
    deepseek_shape = r == 512 and R == 64
    return {
        "flashmla": deepseek_shape,
        "cutlass_mla": deepseek_shape,
        "flashinfer_mla": deepseek_shape and P in (64, 128, 192),
        "deepseek_r1_prefill_fast_path": deepseek_shape and P == 128 and V == 128,
        "vllm_head_size_whitelist": r + R in VLLM_MLA_HEAD_SIZES,
        "triton_mla": True,
    }


def serving_notes(spec: SourceSpec, config: dict, dropped_bias: list[str]) -> Serving:
    """What transformers, vLLM and SGLang will and will not reproduce."""
    warnings: list[str] = []
    if config.get("attention_bias"):
        warnings.append(
            "vLLM and SGLang drop kv_a_proj_with_mqa.bias and o_proj.bias (the shared RoPE key's bias and "
            "W_o·b_v from the source's value bias); transformers keeps them. The effect of dropping them is "
            "measured in verify.engines (vllm, sglang)."
        )
    if dropped_bias:
        warnings.append(
            f"{', '.join(dropped_bias)} has no place in DeepSeek-V3 on any stack (q_proj has no bias); "
            "its effect is part of the verify figures."
        )
    if spec.family.qk_norm:
        warnings.append(
            "the source's RMSNorm on each query and key head (QK-norm) has no place in DeepSeek-V3 on any stack: "
            "every layer computes a calibration-fitted linear stand-in instead, refined against the true layer; "
            "what that costs is in attention_error (per layer) and the verify figures."
        )
    if config.get("rope_scaling") and config["rope_scaling"].get("rope_type") != "yarn":  # yarn: targets.llama3_as_yarn
        kind = config["rope_scaling"].get("rope_type", config["rope_scaling"].get("type"))
        warnings.append(
            f"the source uses rope_scaling {kind!r}: transformers reproduces it exactly, but vLLM and SGLang "
            "rewrite any rope_scaling to deepseek_yarn, so served outputs would differ."
        )
    if spec.rms_norm_eps != config["rms_norm_eps"]:
        warnings.append(
            f"rms_norm_eps {spec.rms_norm_eps:g} → {config['rms_norm_eps']:g} with the residual stream rescaled "
            "exactly, so every stack agrees on the latent norm."
        )
    rope_exact = not config.get("rope_scaling") or config["rope_scaling"].get("rope_type") == "yarn"
    fit = kernel_fit(config)
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    if not fit["vllm_head_size_whitelist"]:
        warnings.append(
            f"vLLM runs MLA only with kv_lora_rank + qk_rope_head_dim in {head_sizes_text(VLLM_MLA_HEAD_SIZES)}: "
            f"this output's {width} fails at its first forward there (transformers, llama.cpp and SGLang's triton "
            f"backend run it); --target vllm (or --kv-keep with a budget of at least {min(VLLM_MLA_HEAD_SIZES)}) "
            "picks one of them."
        )
    elif not fit["flashmla"]:
        warnings.append(
            f"kv_lora_rank {config['kv_lora_rank']} + qk_rope_head_dim {config['qk_rope_head_dim']} is not the "
            "512 + 64 shape of FlashMLA / CUTLASS-MLA; vLLM and SGLang use generic MLA kernels (vLLM's CPU build "
            "decodes 576 only)."
        )
    return Serving(
        transformers={"biases_kept": bool(config.get("attention_bias")), "rope_scaling_exact": True},
        vllm={"biases_kept": False, "rope_scaling_exact": rope_exact},
        sglang={"biases_kept": False, "rope_scaling_exact": rope_exact},
        kernels=fit,
        warnings=warnings,
    )
