"""Serving targets: what a converted checkpoint holds so that the engines it is meant for compute the same function.

``--target portable`` (the default) is for every engine in ``mlaconv.target.engines``: no bias tensors (vLLM and
SGLang drop them, llama.cpp has no place for them) and a rope configuration vLLM, SGLang and transformers
compute alike. ``transformers`` keeps today's output (biases written, the source's rope_scaling as it is).
``vllm`` and ``sglang`` are bias-free like portable; ``llamacpp`` is bias-free and keeps linear scaling
(export gguf refuses other types).

Biases: the NoPE part of a key bias only adds q·b to every score of a query, which softmax drops exactly;
the shared rope key's bias and the value bias (W_o·b_v on the residual, a constant) are not expressible
without bias tensors. With calibration data they are read off the input instead (b ≈ b·wᵀx with
w = E[xxᵀ]⁻¹E[x] on the fit windows, exact when the input carries a constant direction: ``mla.attention``),
and the refinement re-fits each layer with the biases fixed at zero; without it they are dropped and the
cost is measured by the built-in check (per engine) and stated.

Shapes: vLLM runs MLA only at r + R ∈ ``VLLM_MLA_HEAD_SIZES``. ``portable`` takes the largest of them within the
--kv-keep budget whose latent fits the model (the whole budget where none does: vLLM then refuses the output, and
the report says so); ``vllm`` refuses a budget or --rank that fits none.

RoPE: a llama3-scaled source becomes DeepSeek-YaRN in vLLM and SGLang. The output then carries a yarn
``rope_scaling`` whose correction range is chosen to follow llama3's kept frequencies as closely as
YaRN's ramp (linear in the slot index) allows, with every attention-factor knob at 1, so transformers,
vLLM and SGLang compute the same frequencies; the gap to the source's llama3 frequencies is reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlaconv.errors import MlaconvError
from mlaconv.report.conversion import TargetReport
from mlaconv.target.engines import BIASES, VLLM_MLA_HEAD_SIZES, deepseek_yarn_frequencies, head_sizes_text


@dataclass(frozen=True)
class Target:
    name: str
    engines: tuple[str, ...]  # the engines the output is meant to compute the same function on
    biases: bool  # write bias tensors (only transformers honours them)
    yarn_for_llama3: bool  # rewrite llama3 scaling into the DeepSeek-YaRN the engines compute
    mla_head_sizes: tuple[int, ...] = ()  # the r + R its engines run (empty: any)
    head_size_required: bool = False  # refuse a budget or --rank none fits (else: the largest that fits, if any)


TARGETS = {t.name: t for t in (
    Target("portable", ("transformers", "vllm", "sglang", "llamacpp"), biases=False, yarn_for_llama3=True,
           mla_head_sizes=VLLM_MLA_HEAD_SIZES),
    Target("transformers", ("transformers",), biases=True, yarn_for_llama3=False),
    Target("vllm", ("vllm",), biases=False, yarn_for_llama3=True, mla_head_sizes=VLLM_MLA_HEAD_SIZES,
           head_size_required=True),
    Target("sglang", ("sglang",), biases=False, yarn_for_llama3=True),
    Target("llamacpp", ("llamacpp",), biases=False, yarn_for_llama3=False),
)}
DEFAULT_TARGET = "portable"


def target(name: str) -> Target:
    if name not in TARGETS:
        raise MlaconvError(f"--target {name!r}: choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


def served_budget(chosen: Target, budget: int, rope_for: Callable[[int], int], full_rank: Callable[[int], int],
                  kv_keep: float, source_elements: int) -> int:
    """The cache elements per token and layer a --kv-keep ``budget`` becomes for ``chosen``: the largest of its MLA
    head sizes s ≤ budget whose latent s − R fits ``full_rank(R)`` (R = ``rope_for(s)``), else the budget (or, where
    the target requires one, a one-line refusal)."""
    def fits(size: int) -> bool:
        rope_dim = rope_for(size)
        return size <= budget and 1 <= size - rope_dim <= full_rank(rope_dim)

    fitting = [size for size in chosen.mla_head_sizes if fits(size)]
    if fitting or not chosen.head_size_required:
        return max(fitting, default=budget)
    smallest = min(chosen.mla_head_sizes)
    if budget >= smallest:
        rope_dim = rope_for(smallest)
        hint = f"their latents exceed this model's full rank ({full_rank(rope_dim)} at R = {rope_dim})"
    elif smallest < source_elements:
        hint = f"use --kv-keep ≥ {math.ceil(smallest / source_elements * 1e4) / 1e4:.4f}"
    else:
        hint = "none of them compresses this model's cache"
    raise MlaconvError(f"--target {chosen.name}: {', '.join(chosen.engines)} runs MLA only with r + R in "
                       f"{head_sizes_text(chosen.mla_head_sizes)}, and --kv-keep {kv_keep} leaves {budget} of this "
                       f"model's {source_elements} elements per token and layer: {hint}; or use --target portable")


def check_head_size(chosen: Target, rank: int, rope_dim: int) -> None:
    """Refuse a --rank whose r + R the target's engines do not run, where the target requires one of its sizes."""
    if chosen.head_size_required and rank + rope_dim not in chosen.mla_head_sizes:
        raise MlaconvError(f"--target {chosen.name}: r + R = {rank} + {rope_dim} = {rank + rope_dim}, and "
                           f"{', '.join(chosen.engines)} runs MLA only with r + R in "
                           f"{head_sizes_text(chosen.mla_head_sizes)}")


def llama3_as_yarn(rope_scaling: dict, theta: float, rope_dim: int, kept: torch.Tensor) -> tuple[dict, dict]:
    """The yarn ``rope_scaling`` (with rope_theta ``theta``, R = ``rope_dim``) whose DeepSeek-YaRN frequencies are
    closest to ``kept`` (the source's llama3-scaled ω at the kept pairs [R/2]), and the gap.

    YaRN's ramp runs between slot indices low = ⌊c(β_fast)⌋ and high = ⌈c(β_slow)⌉; every (low, high) pair is
    tried and the one with the least max relative frequency gap wins; β are then set half a slot inside those
    integers, so floor/ceil land on them in every engine. mscale = mscale_all_dim = 0 and attention_factor 1
    keep cos/sin and the softmax scale unchanged in transformers, vLLM (deepseek_llama_scaling) and SGLang.
    """
    factor, original = float(rope_scaling["factor"]), int(rope_scaling["original_max_position_embeddings"])
    slots = rope_dim // 2
    base = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)

    def frequencies(low: int, high: int) -> torch.Tensor:
        ramp = ((torch.arange(slots, dtype=torch.float64) - low) / ((high + 0.001 if low == high else high) - low))
        extrapolated = 1 - ramp.clamp(0, 1)
        return base / factor * (1 - extrapolated) + base * extrapolated

    def gap(freqs: torch.Tensor) -> float:
        return (freqs / kept - 1).abs().max().item()

    low, high = min(((lo, hi) for lo in range(slots) for hi in range(lo, rope_dim)),
                    key=lambda pair: gap(frequencies(*pair)))

    def beta(index: float) -> float:  # the rotations whose correction dimension is ``index``
        return original / (2 * math.pi * theta ** (2 * index / rope_dim))

    config = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
              "beta_fast": beta(low + 0.5), "beta_slow": beta(high - 0.5), "mscale": 0, "mscale_all_dim": 0,
              "attention_factor": 1.0}
    served = deepseek_yarn_frequencies(theta, rope_dim, factor, original, config["beta_fast"], config["beta_slow"])
    relative = (served / kept - 1).abs()
    return config, {"from": "llama3", "to": "yarn", "max_relative_frequency_gap": relative.max().item(),
                    "slots_differing": int((relative > 1e-9).sum()), "slots": slots,
                    "note": "vLLM and SGLang compute every rope_scaling as DeepSeek-YaRN; this yarn follows the source's "
                            "llama3 frequencies except inside llama3's smoothing band, where YaRN's ramp is linear in the "
                            "slot index; the built-in check measures the effect"}


def rope_scaling_for(chosen: Target, rope_scaling: dict | None, theta: float, rope_dim: int,
                     kept: torch.Tensor) -> tuple[dict | None, dict | None]:
    """The output's ``rope_scaling`` for ``chosen`` (``rope_scaling`` is what transformers needs to reproduce the
    kept frequencies ``kept`` [R/2] exactly), and the rewrite made, if any."""
    if chosen.yarn_for_llama3 and rope_scaling and rope_scaling.get("rope_type") == "llama3":
        return llama3_as_yarn(rope_scaling, theta, rope_dim, kept)
    return rope_scaling, None


def target_report(chosen: Target, reports: list, rope_rewrite: dict | None, calibrated: bool) -> TargetReport:
    """The report's ``target`` section: the engines, what was left out of the output for them, and how."""
    dropped = sorted({b for r in reports for b in r.dropped_bias if b in BIASES})
    note = None
    if dropped:
        note = (f"{' and '.join(dropped)} left out for {', '.join(chosen.engines)}: "
                + ("the calibrated conversion folded them into the value rows and the rope key along the input's "
                   "constant direction (w = E[xxᵀ]⁻¹E[x]) and re-fitted each layer with them at zero (refinement, when "
                   "it runs)" if calibrated
                   else "without calibration data nothing re-fits them; the built-in check measures the cost; pass "
                        "--calib to re-fit, or --target transformers to keep them (transformers only)"))
    return TargetReport(chosen.name, list(chosen.engines), chosen.biases, dropped, rope_rewrite, note)
