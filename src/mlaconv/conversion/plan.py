"""Planning a conversion before any heavy work: the options checked against the source, the (r, R) shapes, the
per-layer options and the model-wide rope stride. Cheap: headers, and for the stride one pass over the key weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mlaconv.calibration.streamer import SEQUENTIAL
from mlaconv.calibration.windows import CalibrationData
from mlaconv.conversion.options import ConvertOptions, Recipe
from mlaconv.conversion.pipeline import source_layers
from mlaconv.devices import DTYPES, check_device
from mlaconv.errors import MlaconvError
from mlaconv.heal.distill import DEFAULT_WINDOW, PRECISIONS, SCHEDULES
from mlaconv.io import CheckpointReader
from mlaconv.io.models import has_tokenizer
from mlaconv.io.text import TokenSource, token_counts
from mlaconv.mla import rope
from mlaconv.mla.attention import full_rank
from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.mla.layer import AttentionShape, LayerOptions, mla_cache_elements
from mlaconv.mla.shared_key import key_energies
from mlaconv.progress import Progress, no_progress
from mlaconv.source.families import QK_NORM_NEEDS_CALIBRATION
from mlaconv.source.spec import SourceSpec, load_source
from mlaconv.target import deepseek
from mlaconv.target.targets import Target, check_head_size, rope_scaling_for, served_budget, target

GENERAL_TEXT = Path(__file__).resolve().parents[1] / "data" / "general.txt"
GENERAL_TEXT_DESCRIPTION = ("mlaconv's bundled general text (data/general.txt: 530 KB of public-domain narrative, "
                            "dialogue and expository prose, Python code and documentation under the PSF licence; "
                            "data/general.md)")

DEFAULT_ROPE_DIM = 64
FOLD_TURN = 0.4  # radians: the --kv-keep split folds into the latent (at its calibrated mean rotation) only
# frequencies that turn by at most this over the served context. On SmolLM2-135M at 50%, 144 + 48 folds frequencies
# that turn ≤ 0.36 over the 2,048-token calibration windows and is better than 128 + 64 up to 2K tokens, worse past
# it where they turn up to 0.73 (development text by position, bench/real/README.md)


@dataclass(frozen=True)
class ShapeChoice:
    """The (r, R) a conversion plans, and why; the written checkpoint's whole attention shape is a
    ``mla.layer.MLAShape``."""

    rank: int  # r
    rope_dim: int  # R
    reason: str

    @property
    def cache_elements(self) -> int:
        return mla_cache_elements(self.rank, self.rope_dim)


def plan_shapes(spec: SourceSpec, rank: int | None, kv_keep: float | None, rope_dim: int | None,
                chosen: Target | None = None) -> ShapeChoice:
    """Validate --rank / --kv-keep / --rope-dim against the source and pick (r, R); for a serving target ``chosen``
    the --kv-keep budget becomes the largest MLA shape its engines run within it (``target.targets.served_budget``)."""
    d, rotary = spec.head_dim, spec.rotary_dim
    source_elements = spec.attention_shape.cache_elements
    if rope_dim is not None:
        if rope_dim < 2 or rope_dim % 2:
            raise MlaconvError(f"--rope-dim must be an even number ≥ 2, got {rope_dim}")
        if rope_dim > rotary:
            raise MlaconvError(f"--rope-dim {rope_dim} is larger than the source head_dim {d}" if rotary == d else
                               f"--rope-dim {rope_dim} is larger than the source's {rotary} rotary dims")
    if (rank is None) == (kv_keep is None):
        raise MlaconvError("give exactly one of --rank and --kv-keep (or a --recipe that sets one)")
    if kv_keep is not None:
        if not 0 < kv_keep <= 1:
            raise MlaconvError(f"--kv-keep must be in (0, 1], got {kv_keep}")
        whole, budget = kv_budget(spec, kv_keep, rope_dim, chosen)
        R = _rope_for(spec, rope_dim, budget)
        if R < 2 or budget - R < 1:
            raise MlaconvError(
                f"--kv-keep {kv_keep} leaves {budget} cache elements per token and layer, too few for "
                f"{'--rope-dim ' + str(R) + ' plus ' if rope_dim else ''}a latent (source: {source_elements})"
            )
        r = min(budget - R, model_full_rank(spec, R))
        reason = (f"budget {budget} of {source_elements} elements: {R} rope dims "
                  f"({'given' if rope_dim else 'default, at most half the budget'}), latent rank {r}")
        if r < budget - R:
            reason += f" (capped at the full rank {r}; the cache is smaller than the budget)"
        if budget != whole:
            reason += f" (held to {budget} of a budget of {whole}: the largest r + R vLLM runs)"
        return ShapeChoice(rank=r, rope_dim=R, reason=reason)
    R = rope_dim if rope_dim is not None else min(DEFAULT_ROPE_DIM, rotary)
    assert rank is not None
    if rank < 1:
        raise MlaconvError(f"--rank must be ≥ 1, got {rank}")
    if rank > model_full_rank(spec, R):
        rope_part = f" − {R} rope dims" if all(spec.rope_layers) else ", in its layers without RoPE"
        raise MlaconvError(
            f"--rank {rank} is larger than the matrix allows: at most {model_full_rank(spec, R)} for this model "
            f"(min of hidden {spec.hidden_size} and 2·{spec.num_kv_heads}·{d}{rope_part})"
        )
    if chosen is not None:
        check_head_size(chosen, rank, R)
    return ShapeChoice(rank=rank, rope_dim=R, reason="rank given")


def _rope_for(spec: SourceSpec, rope_dim: int | None, budget: int) -> int:
    """R for a --kv-keep budget: the given --rope-dim, else the default R up to the rotary dims and half the budget."""
    return rope_dim if rope_dim is not None else min(DEFAULT_ROPE_DIM, spec.rotary_dim, 2 * (budget // 4))


def kv_budget(spec: SourceSpec, kv_keep: float, rope_dim: int | None, chosen: Target | None) -> tuple[int, int]:
    """The --kv-keep budget in cache elements per token and layer, and what the serving target makes of it."""
    source_elements = spec.attention_shape.cache_elements
    whole = int(math.floor(kv_keep * source_elements + 1e-9))
    if chosen is None:
        return whole, whole
    return whole, served_budget(chosen, whole, lambda size: _rope_for(spec, rope_dim, size),
                                lambda R: model_full_rank(spec, R), kv_keep, source_elements)


def full_latent(spec: SourceSpec, rope_dim: int | None, chosen: Target | None = None) -> ShapeChoice:
    """(r, R) at the full rank of the given or default R: the whole latent, whose spectrum holds every rank."""
    R = rope_dim if rope_dim is not None else min(DEFAULT_ROPE_DIM, spec.rotary_dim)
    return replace(plan_shapes(spec, model_full_rank(spec, R), None, rope_dim, chosen), reason="the full rank")


def model_full_rank(spec: SourceSpec, rope_dim: int) -> int:
    """The largest useful latent rank over the layers: a layer without RoPE keeps its whole key in the latent,
    so its full rank does not lose the R rope dims (the rotated layers' latents are then zero-padded)."""
    return full_rank(spec.attention_shape, rope_dim if all(spec.rope_layers) else 0)


def served_context(spec: SourceSpec, options: ConvertOptions) -> int:
    """The longest context the converted model is meant to serve: --context, else the source's."""
    return options.context or spec.max_position_embeddings


def shape_candidates(spec: SourceSpec, kv_keep: float, chosen: Target | None = None,
                     context: int | None = None) -> list[ShapeChoice]:
    """The (r, R) splits of a --kv-keep budget that calibration compares.

    R ∈ {16, 32, 48, 64, 96, 128}, and with a served ``context`` the least R that folds no frequency turning by
    more than FOLD_TURN over it (rounded up to a multiple of 16, as r is), up to head_dim and half the budget; r fills the rest, rounded down to a
    multiple of 16 (tile-aligned for MLA kernels) once it is 64 or more, and capped at the full rank. Where the
    budget is one of the serving target's MLA shapes (``plan_shapes``), r fills it exactly instead, and splits
    whose r would exceed the full rank are left out.
    """
    _, budget = kv_budget(spec, kv_keep, None, chosen)
    exact = chosen is not None and budget in chosen.mla_head_sizes
    default = plan_shapes(spec, None, kv_keep, None, chosen)
    candidates = {default.rope_dim: default}
    served = [] if context is None else [-(-rope.least_rope_dim(spec.rope_frequencies(context), context, FOLD_TURN) // 16) * 16]
    for R in sorted({16, 32, 48, 64, 96, 128, *served}):
        if 0 < R <= min(spec.rotary_dim, budget // 2) and R not in candidates:
            r = budget - R
            if exact and r > model_full_rank(spec, R):
                continue
            r = min(r - r % 16 if r >= 64 and not exact else r, model_full_rank(spec, R))
            candidates[R] = ShapeChoice(rank=r, rope_dim=R, reason="")
    return [candidates[R] for R in sorted(candidates)]


def output_dtype(spec: SourceSpec, requested: str | None) -> torch.dtype:
    if requested is not None and requested not in DTYPES:
        raise MlaconvError(f"--dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    dtype = DTYPES[requested] if requested else spec.dtype
    if dtype == torch.float16:
        raise MlaconvError(
            "float16 output is refused: DeepSeek's kv_a_layernorm is made linear by keeping the latent tiny "
            "(mean square ≤ 1e-5·1e-6), which float16 activations cannot hold (the weights fit float16: llama.cpp's "
            "f16 GGUF, which computes in float32, is fine); use --dtype bfloat16 or float32"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        dtype = torch.float32
    return dtype


def factor_precision(dtype: torch.dtype | None) -> torch.dtype:
    """What a weights-only layer is factored in (by ``convert`` and ``inspect spectra`` alike): float32 where it is
    written in a 16-bit format, whose rounding (bfloat16: 2⁻⁹) is far above float32's; float64 otherwise. On a
    Llama-3.2-1B-shaped layer written in bfloat16 the float32 factorization's attention output differs from the
    float64 one's by 4e-6 (relative), the bfloat16 rounding by 2.8e-3, and it takes half the time
    (``tests/mla/test_precision.py``, ``bench/precision/factor.py``)."""
    return torch.float32 if dtype is not None and torch.finfo(dtype).bits <= 16 else torch.float64


def residual_scale(spec: SourceSpec) -> float:
    """α = √(1e-6/ε_src): rescales the residual stream so that rms_norm_eps can be DeepSeek's 1e-6 exactly."""
    return math.sqrt(LATENT_NORM_EPS / spec.rms_norm_eps)


def layer_options(spec: SourceSpec, shapes: ShapeChoice, options: ConvertOptions, chosen: Target) -> LayerOptions:
    """Each layer's conversion options for the serving target ``chosen``."""
    return LayerOptions(
        rank=shapes.rank, rope_dim=shapes.rope_dim, rope_theta=spec.rope_theta, rope_scaling=spec.rope_scaling,
        rope_stride=options.rope_stride, rotary_dim=spec.rotary_dim, context=min(spec.max_position_embeddings, 4096),
        residual_scale=residual_scale(spec), delta=options.delta,
        biases=chosen.biases,
    )


def calibration_data(folder: Path, options: ConvertOptions) -> CalibrationData | None:
    """The data given, else (unless --weights-only) the bundled general text where the source has a tokenizer to
    read it with; None: weights only."""
    if options.weights_only:
        return None
    if options.calibration_given:
        named = list(options.calib) + ([f"dataset {options.calib_dataset}"] if options.calib_dataset else [])
        return CalibrationData(tuple(options.calib), options.calib_dataset, ", ".join(named))
    if not has_tokenizer(folder):
        return None
    return CalibrationData((str(GENERAL_TEXT),), None, GENERAL_TEXT_DESCRIPTION)


def calibration_description(plan: Plan) -> str:
    """The report's line on the calibration data, weights-only included."""
    if plan.calibration is not None:
        return plan.calibration.description
    if plan.options.weights_only:
        return "none: --weights-only"
    return ("none: the source has no tokenizer to read the bundled calibration text with, so it was converted from "
            "its weights alone; give --calib FILE.jsonl (token ids) to calibrate")


@dataclass(frozen=True)
class Plan:
    """A validated conversion: its options, the opened source, the serving target, the chosen shapes, the per-layer
    options, the output dtype and the calibration data (None: weights only)."""

    options: ConvertOptions
    folder: Path
    spec: SourceSpec
    reader: CheckpointReader
    target: Target
    shapes: ShapeChoice
    layer: LayerOptions
    dtype: torch.dtype
    calibration: CalibrationData | None = None

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    @property
    def attention_bias(self) -> bool:
        """Whether the output has attention bias tensors: where the source has them and the target keeps them."""
        return bool(self.spec.qkv_bias or self.spec.o_bias) and self.layer.biases

    @property
    def shape(self) -> AttentionShape:
        return self.spec.attention_shape


def plan_conversion(source: str, options: ConvertOptions, every_rank: bool = False) -> Plan:
    """Open and validate the source, check the recipe, resolve the serving target, and choose (r, R); cheap (headers
    only). With ``every_rank`` and neither a rank nor a budget, the plan is at the full rank (``full_latent``: what
    ``inspect spectra`` analyses) instead of refused."""
    chosen = target(options.target)  # an unknown target fails before the source is opened
    folder, spec, reader = load_source(source, options.revision, options.allow_sliding_window)
    if options.recipe is not None:
        check_recipe(options.recipe, spec)
    calibration = calibration_data(folder, options)
    if spec.family.qk_norm and calibration is None:
        raise MlaconvError(QK_NORM_NEEDS_CALIBRATION.format(label=spec.family.label))
    if every_rank and options.rank is None and options.kv_keep is None:
        shapes = full_latent(spec, options.rope_dim, chosen)
    else:
        shapes = plan_shapes(spec, options.rank, options.kv_keep, options.rope_dim, chosen)
    searched = calibration is not None and options.kv_keep is not None and options.rope_dim is None  # see calibrated.search_shapes
    if (options.rope_stride is not None and not searched
            and options.rope_stride not in rope.strides(spec.rotary_dim, shapes.rope_dim)):
        raise MlaconvError(f"--rope-stride {options.rope_stride} does not fit {shapes.rope_dim} rope dims in "
                           f"{'head_dim' if spec.rotary_dim == spec.head_dim else 'the rotary dims'} {spec.rotary_dim}")
    check_device(options.device)
    if options.absorbed and spec.rope_scaling and spec.rope_scaling["rope_type"] == "longrope":
        from mlaconv.target.absorb import LONGROPE_REFUSAL

        raise MlaconvError(f"--absorbed is refused for this model: {LONGROPE_REFUSAL}")
    if options.calib_tokens < 1:
        raise MlaconvError(f"--calib-tokens must be positive, got {options.calib_tokens}")
    if options.context is not None and options.context < 1:
        raise MlaconvError(f"--context must be positive, got {options.context}")
    if options.heal_tokens and calibration is None:
        raise MlaconvError("--heal-tokens trains on calibration data: give --calib (or drop --weights-only)")
    if options.heal_tokens is not None and options.heal_tokens < 0:
        raise MlaconvError(f"--heal-tokens must be ≥ 0, got {options.heal_tokens}")
    if options.heal_written is not None and options.heal_written < 0:
        raise MlaconvError(f"--heal-written must be ≥ 0, got {options.heal_written}")
    if options.heal_precision is not None and options.heal_precision not in PRECISIONS:
        raise MlaconvError(f"--heal-precision must be one of {', '.join(PRECISIONS)}, got {options.heal_precision!r}")
    if options.heal_lr_schedule is not None and options.heal_lr_schedule not in SCHEDULES:
        raise MlaconvError(f"--heal-lr-schedule must be one of {', '.join(SCHEDULES)}, "
                           f"got {options.heal_lr_schedule!r}")
    if options.heal_window is not None and not 2 <= options.heal_window <= options.calib_window:
        raise MlaconvError(f"--heal-window must be between 2 and --calib-window ({options.calib_window}), "
                           f"got {options.heal_window}")
    heal_window = options.heal_window or DEFAULT_WINDOW
    if options.heal_position_span not in (None, 0) and options.heal_position_span < heal_window:
        raise MlaconvError(f"--heal-position-span must be 0 (none) or at least the healing window ({heal_window}), "
                           f"got {options.heal_position_span}")
    if options.calib_sequential is not None and options.calib_sequential not in SEQUENTIAL:
        raise MlaconvError(f"--calib-sequential must be one of {', '.join(SEQUENTIAL)}, "
                           f"got {options.calib_sequential!r}")
    if options.calib_sequential is not None and calibration is None:
        raise MlaconvError("--calib-sequential chooses and refines the layers on calibration data: give --calib "
                           "(or drop --weights-only)")
    if options.refine_steps is not None and options.refine_steps < 0:
        raise MlaconvError(f"--refine-steps must be ≥ 0, got {options.refine_steps}")
    if not (0 < options.refine_minutes < math.inf):
        raise MlaconvError(f"--refine-minutes must be a positive number of minutes, got {options.refine_minutes}")
    if options.refine_batch < 1 or options.refine_check_every < 1:
        raise MlaconvError("the refinement batch and check interval must be ≥ 1")
    if options.eval_retrieval:
        lengths = token_counts(options.eval_retrieval, "--eval-retrieval")
        if max(lengths) > spec.max_position_embeddings:
            raise MlaconvError(f"--eval-retrieval {max(lengths)} is longer than the model's context "
                               f"({spec.max_position_embeddings} tokens)")
    if options.evaluated:
        eval_source(options)  # a missing eval file or a malformed dataset name fails now, not after hours
    return Plan(options, folder, spec, reader, chosen, shapes, layer_options(spec, shapes, options, chosen),
                output_dtype(spec, options.dtype), calibration)


def describe_model(spec: SourceSpec) -> str:
    """A short name for a source model, from its shapes (config.json rarely names the model)."""
    return (f"this {spec.family.label} model ({spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"{spec.num_heads} heads, {spec.num_kv_heads} KV heads × {spec.head_dim})")


def check_recipe(recipe: Recipe, spec: SourceSpec) -> ShapeChoice:
    """Refuse a recipe whose shapes do not fit ``spec`` or whose ``kv_cache`` block is wrong; return the shapes.

    The shapes are planned by ``plan_shapes``, the code the conversion runs.
    """
    o = recipe.options
    prefix = f"recipe {recipe.path.name} does not fit {describe_model(spec)}"
    try:
        shapes = plan_shapes(spec, o.get("rank"), o.get("kv_keep"), o.get("rope_dim"))
        dtype = output_dtype(spec, o.get("dtype"))
    except MlaconvError as exc:
        raise MlaconvError(f"{prefix}: {exc}") from None
    stride = o.get("rope_stride")
    if stride is not None and stride not in rope.strides(spec.rotary_dim, shapes.rope_dim):
        raise MlaconvError(f"{prefix}: rope_stride {stride} does not fit {shapes.rope_dim} rope dims in "
                           f"{'head_dim' if spec.rotary_dim == spec.head_dim else 'the rotary dims'} {spec.rotary_dim}")
    if recipe.kv_cache:
        computed = kv_cache_figures(spec, shapes, dtype)
        for group, fields in recipe.kv_cache.items():
            for name, value in fields.items():
                if value != computed[group][name]:
                    raise MlaconvError(f"{prefix}: kv_cache.{group}.{name} says {value}, the shapes give "
                                       f"{computed[group][name]}")
    return shapes


def kv_cache_figures(spec: SourceSpec, shapes: ShapeChoice, dtype: torch.dtype) -> dict:
    """The ``kv_cache`` block a recipe should carry: per token per layer, and bytes per token over all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    source, converted = spec.attention_shape.cache_elements, shapes.cache_elements
    return {
        "elements_per_token_per_layer": {"source": source, "converted": converted},
        "bytes_per_token": {"source": source * spec.num_layers * element,
                            "converted": converted * spec.num_layers * element},
    }


def estimate_output_bytes(spec: SourceSpec, shapes: ShapeChoice, dtype: torch.dtype, absorbed: bool = False) -> int:
    H, N, d, R, r, L = (spec.hidden_size, spec.num_heads, spec.head_dim, shapes.rope_dim, shapes.rank,
                        spec.num_layers)
    attention = N * (d + R) * H + (r + R) * H + r + N * 2 * d * r + H * N * d
    if absorbed:  # OUT/absorbed: q_latent, q_rope, kv_down, o_latent per layer
        attention += N * r * H + N * R * H + (r + R) * H + H * N * r
    mlp = 3 * H * spec.intermediate_size + 2 * H
    total = L * (attention + mlp) + 2 * spec.vocab_size * H + H
    return total * torch.empty((), dtype=dtype).element_size()


def output_config(spec: SourceSpec, shapes: ShapeChoice, stride: int, chosen: Target, attention_bias: bool,
                  dtype: torch.dtype) -> tuple[dict, dict | None]:
    """The output's config.json for the serving target ``chosen``, and the rope rewrite it made, if any."""
    kept = rope.kept_frequencies(shapes.rope_dim, stride)
    theta = rope.target_rope_theta(spec.rope_theta, spec.rotary_dim, shapes.rope_dim, stride)
    rope_scaling, rope_rewrite = rope_scaling_for(chosen, rope.target_rope_scaling(spec.rope_scaling, kept), theta,
                                                  shapes.rope_dim, spec.rope_frequencies()[kept])
    config = deepseek.build_config(spec, rank=shapes.rank, rope_dim=shapes.rope_dim, rope_theta=theta,
                                   rope_scaling=rope_scaling, attention_bias=attention_bias,
                                   dtype_name=str(dtype).replace("torch.", ""))
    return config, rope_rewrite


def with_rope_stride(plan: Plan, progress: Progress = no_progress) -> Plan:
    """The plan with its model-wide rope stride chosen (a pass over the key weights), unless it is set."""
    if plan.layer.rope_stride is not None:
        return plan
    R = plan.layer.rope_dim
    stride = rope_strides(plan, [R], progress)[R]
    return replace(plan, layer=replace(plan.layer, rope_stride=stride))


def eval_source(options: ConvertOptions) -> TokenSource:
    token_source = TokenSource(text=Path(options.eval_text) if options.eval_text else None,
                               dataset=options.eval_dataset,
                               tokens=Path(options.eval_tokens) if options.eval_tokens else None)
    for path in (token_source.text, token_source.tokens):
        if path is not None and not path.is_file():
            raise MlaconvError(f"evaluation file not found: {path}")
    token_source.describe()  # parses a dataset name
    return token_source


def rope_strides(plan: Plan, rope_dims: list[int], progress: Progress = no_progress) -> dict[int, int]:
    """One frequency grid per candidate R for the whole model (the config has one rope_theta), from the weights.

    One pass reads each layer's key projection and input norm only; for each R the stride with the
    highest mean cost-weighted kept energy wins.
    """
    rotary = plan.spec.rotary_dim
    pending = [R for R in rope_dims if len(rope.strides(rotary, R)) > 1]
    chosen = {R: rope.strides(rotary, R)[0] for R in rope_dims if R not in pending}
    if pending:
        scores: dict[int, list[dict[int, float]]] = {R: [] for R in pending}
        for layer in source_layers(plan.reader, plan.spec, progress=progress, label="choosing rope frequencies"):
            if not plan.spec.rope_layers[layer.index]:
                continue  # a layer without RoPE has no rotated energy to keep
            energies = key_energies(*layer.key(), plan.shape, plan.layer)
            for R in pending:
                scores[R].append(rope.stride_scores(energies, R))
        chosen.update({R: rope.best_stride(scores[R]) for R in pending})
    return chosen
