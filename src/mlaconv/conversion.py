"""``mlaconv convert``: stream a source checkpoint layer by layer into a DeepSeek-V3 MLA checkpoint.

Memory: one source tensor group (a layer's attention or MLP) is in memory at a time, plus the
calibration activations when calibrated; the writer puts each tensor in its shard file as it is added,
and the output folder appears only when complete.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import transformers

from mlaconv import __version__, deepseek
from mlaconv.arch import QK_NORM_NEEDS_CALIBRATION, SourceSpec
from mlaconv.errors import MlaconvError
from mlaconv.evaluate import TokenSource, evaluate_perplexity
from mlaconv.families import SourceWeights
from mlaconv.io import (CheckpointReader, ShardedWriter, atomic_output_dir, check_free_space, check_output_target,
                        read_config, resolve_source)
from mlaconv.io.pending import PendingTensors
from mlaconv.io.writer import DEFAULT_SHARD_BYTES
from mlaconv.model_card import write_model_card
from mlaconv.models import DTYPES, check_device, default_device
from mlaconv.progress import Progress, no_progress
from mlaconv.mla import rope
from mlaconv.mla.attention import (AttentionShape, LayerOptions, LayerReport, MLAAttention, SourceAttention,
                                   convert_attention, full_rank, key_energies)
from mlaconv.mla.latent_norm import DEFAULT_DELTA, LATENT_NORM_EPS
from mlaconv.mla.refine import CHECK_EVERY
from mlaconv.targets import DEFAULT_TARGET, rope_scaling_for, target, target_report

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
)
DEFAULT_ROPE_DIM = 64


@dataclass
class ConvertOptions:
    rank: int | None = None
    kv_keep: float | None = None
    rope_dim: int | None = None
    rope_stride: int | None = None
    dtype: str | None = None
    shard_size: int = DEFAULT_SHARD_BYTES
    force: bool = False
    verify: bool = True
    verify_windows: int = 4
    verify_window: int = 128
    allow_sliding_window: bool = False
    delta: float = DEFAULT_DELTA
    revision: str | None = None
    calib: list[str] = field(default_factory=list)
    calib_dataset: str | None = None
    calib_tokens: int = 65536
    calib_window: int = 2048
    calib_batch_size: int = 4
    device: str | None = None  # calibration, refinement (None: cuda when torch sees one) and the evaluation
    layer_search: bool = True  # calibrated: keep, per layer, the variant with the least measured error
    refine_steps: int | None = None  # calibrated: gradient steps per layer (None: 200 when it is affordable)
    refine_windows: int = 16  # fit windows those steps train on (at most)
    refine_batch: int = 4  # windows per step when refine_steps is given (the default plan chooses its own)
    refine_check_every: int = CHECK_EVERY  # steps between select-window measurements when refine_steps is given
    absorbed: bool = False  # also write the absorbed inference weights into OUT/absorbed
    recipe: str | None = None
    eval_text: str | None = None
    eval_dataset: str | None = None
    eval_tokens: str | None = None
    eval_window: int | None = None
    eval_max_windows: int | None = None
    eval_batch_size: int = 1
    target: str = DEFAULT_TARGET  # the serving engines the output is for (``mlaconv.targets``)
    extra_report: dict = field(default_factory=dict)

    @classmethod
    def from_recipe(cls, path: str | Path, **overrides) -> "ConvertOptions":
        """The options a ``recipes/*.yaml`` file sets, with ``overrides`` (not None) winning, as on the command line."""
        from mlaconv.recipes import load_recipe, merge_options

        return cls(**merge_options(load_recipe(path).options, overrides), recipe=str(path))

    @property
    def evaluated(self) -> bool:
        return any((self.eval_text, self.eval_dataset, self.eval_tokens))

    @property
    def calibration_device(self) -> str:
        """Where calibration and refinement run: the given device, else the GPU when torch sees one."""
        return self.device or default_device()

    @property
    def calibrated(self) -> bool:
        return bool(self.calib or self.calib_dataset)


@dataclass(frozen=True)
class Shapes:
    """The chosen MLA shapes and why."""

    rank: int
    rope_dim: int
    reason: str


def plan_shapes(spec: SourceSpec, rank: int | None, kv_keep: float | None, rope_dim: int | None) -> Shapes:
    """Validate --rank / --kv-keep / --rope-dim against the source and pick (r, R)."""
    d, rotary = spec.head_dim, spec.rotary_dim
    source_elements = spec.kv_elements_per_token_per_layer
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
        budget = int(math.floor(kv_keep * source_elements + 1e-9))
        R = rope_dim if rope_dim is not None else min(DEFAULT_ROPE_DIM, rotary, 2 * (budget // 4))
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
        return Shapes(rank=r, rope_dim=R, reason=reason)
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
    return Shapes(rank=rank, rope_dim=R, reason="rank given")


def model_full_rank(spec: SourceSpec, rope_dim: int) -> int:
    """The largest useful latent rank over the layers: a layer without RoPE keeps its whole key in the latent,
    so its full rank does not lose the R rope dims (the rotated layers' latents are then zero-padded)."""
    shape = AttentionShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    return full_rank(shape, rope_dim if all(spec.rope_layers) else 0)


def shape_candidates(spec: SourceSpec, kv_keep: float) -> list[Shapes]:
    """The (r, R) splits of a --kv-keep budget that calibration compares.

    R ∈ {8, 16, 32, 64, 128} up to head_dim and half the budget; r fills the rest, rounded down to a
    multiple of 16 (tile-aligned for MLA kernels) once it is 64 or more, and capped at the full rank.
    """
    budget = int(math.floor(kv_keep * spec.kv_elements_per_token_per_layer + 1e-9))
    default = plan_shapes(spec, None, kv_keep, None)
    candidates = {default.rope_dim: default}
    for R in (8, 16, 32, 64, 128):
        if R <= min(spec.rotary_dim, budget // 2) and R not in candidates:
            r = budget - R
            r = min(r - r % 16 if r >= 64 else r, model_full_rank(spec, R))
            candidates[R] = Shapes(rank=r, rope_dim=R, reason="")
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


def load_source(source: str, revision: str | None = None,
                allow_sliding_window: bool = False) -> tuple[Path, SourceSpec, CheckpointReader]:
    """Resolve, validate and open a source checkpoint (headers only)."""
    folder = resolve_source(source, revision)
    spec = SourceSpec.from_config(read_config(folder), allow_sliding_window=allow_sliding_window)
    reader = CheckpointReader(folder)
    spec.check_tensors(reader)
    return folder, spec, reader


def read_attention(reader: CheckpointReader, spec: SourceSpec, i: int) -> SourceAttention:
    """Layer i's attention in Llama's canonical layout, whatever the family (``SourceWeights``)."""
    return SourceWeights(reader, spec).attention(i)


def residual_scale(spec: SourceSpec) -> float:
    """α = √(1e-6/ε_src): rescales the residual stream so that rms_norm_eps can be DeepSeek's 1e-6 exactly."""
    return math.sqrt(LATENT_NORM_EPS / spec.rms_norm_eps)


def layer_options(spec: SourceSpec, shapes: Shapes, options: ConvertOptions) -> LayerOptions:
    return LayerOptions(
        rank=shapes.rank, rope_dim=shapes.rope_dim, rope_theta=spec.rope_theta, rope_scaling=spec.rope_scaling,
        rope_stride=options.rope_stride, rotary_dim=spec.rotary_dim, context=min(spec.max_position_embeddings, 4096),
        residual_scale=residual_scale(spec), delta=options.delta, biases=target(options.target).biases,
    )


@dataclass
class Plan:
    """A validated conversion: the opened source, the chosen shapes and the per-layer options."""

    folder: Path
    spec: SourceSpec
    reader: CheckpointReader
    shapes: Shapes
    layer: LayerOptions

    @property
    def shape(self) -> AttentionShape:
        s = self.spec
        return AttentionShape(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim)


def plan_conversion(source: str, options: ConvertOptions) -> Plan:
    """Open and validate the source, check the recipe, and choose (r, R); cheap (headers only)."""
    target(options.target)  # an unknown target fails before the source is opened
    folder, spec, reader = load_source(source, options.revision, options.allow_sliding_window)
    if options.recipe:
        from mlaconv.recipes import check_recipe, load_recipe

        check_recipe(load_recipe(options.recipe), spec)
    if spec.family.qk_norm and not options.calibrated:
        raise MlaconvError(QK_NORM_NEEDS_CALIBRATION.format(label=spec.family.label))
    shapes = plan_shapes(spec, options.rank, options.kv_keep, options.rope_dim)
    searched = options.calibrated and options.kv_keep is not None and options.rope_dim is None  # see calibrated.search_shapes
    if (options.rope_stride is not None and not searched
            and options.rope_stride not in rope.strides(spec.rotary_dim, shapes.rope_dim)):
        raise MlaconvError(f"--rope-stride {options.rope_stride} does not fit {shapes.rope_dim} rope dims in "
                           f"{'head_dim' if spec.rotary_dim == spec.head_dim else 'the rotary dims'} {spec.rotary_dim}")
    check_device(options.device)
    if options.absorbed and spec.rope_scaling and spec.rope_scaling["rope_type"] == "longrope":
        from mlaconv.absorb import LONGROPE_REFUSAL

        raise MlaconvError(f"--absorbed is refused for this model: {LONGROPE_REFUSAL}")
    if options.calib_tokens < 1:
        raise MlaconvError(f"--calib-tokens must be positive, got {options.calib_tokens}")
    if options.refine_steps is not None and options.refine_steps < 0:
        raise MlaconvError(f"--refine-steps must be ≥ 0, got {options.refine_steps}")
    if options.refine_batch < 1 or options.refine_check_every < 1:
        raise MlaconvError("the refinement batch and check interval must be ≥ 1")
    if options.evaluated:
        _eval_source(options)  # a missing eval file or a malformed dataset name fails now, not after hours
    return Plan(folder, spec, reader, shapes, layer_options(spec, shapes, options))


def with_rope_stride(plan: Plan, progress: Progress = no_progress) -> Plan:
    """The plan with its model-wide rope stride chosen (a pass over the key weights), unless it is set."""
    if plan.layer.rope_stride is not None:
        return plan
    R = plan.layer.rope_dim
    stride = rope_strides(plan.reader, plan.spec, plan.shape, plan.layer, [R], progress)[R]
    return replace(plan, layer=replace(plan.layer, rope_stride=stride))


def convert(source: str, out: str | Path, options: ConvertOptions, progress: Progress = no_progress) -> dict:
    """Convert ``source`` into an MLA checkpoint at ``out``; return the report (a JSON-able dict)."""
    started = time.perf_counter()
    out = Path(out)
    plan = plan_conversion(source, options)
    folder, spec, reader = plan.folder, plan.spec, plan.reader
    dtype = output_dtype(spec, options.dtype)
    check_output_target(out, folder, options.force)
    check_free_space(out.parent, _estimate_output_bytes(spec, plan.shapes, dtype, options.absorbed))
    streamer = shape_search = None
    if options.calibrated:
        from mlaconv import calibrated

        tokens = calibrated.calibration_tokens(plan, options)
        if options.kv_keep is not None and options.rope_dim is None:  # the split is measured
            plan, shape_search = calibrated.search_shapes(plan, options, tokens, progress)
        streamer = calibrated.calibration_streamer(plan, options, tokens)
        refinement = calibrated.refinement_plan(plan, options, streamer)
    plan = with_rope_stride(plan, progress)
    shapes, lopts, shape, alpha = plan.shapes, plan.layer, plan.shape, plan.layer.residual_scale
    reports: list[LayerReport] = []
    attention_bias = bool(spec.qkv_bias or spec.o_bias) and lopts.biases

    with atomic_output_dir(out, force=options.force) as tmp:
        writer = ShardedWriter(tmp, options.shard_size)  # writes each tensor as it is added
        write_outer_tensors(writer, reader, spec, alpha, dtype)
        if streamer:
            records, pending = [], PendingTensors(tmp / ".pending")
            run = calibrated.layer_run(spec, lopts, streamer.options.tokens.shape[1])
        for i in progress(range(spec.num_layers), "converting layers", spec.num_layers):
            src = read_attention(reader, spec, i)
            if streamer:
                layer = calibrated.calibrate_layer(i, src, plan, streamer, options.layer_search, refinement,
                                                   options.refine_windows)
                streamer.advance(i, src, calibrated.followed_models(layer, streamer.followed), run)
                records.append(layer.record)
                if layer.refined is None:
                    write_attention(writer, i, layer.closed, dtype, attention_bias)
                else:  # written once the whole-model check has chosen
                    pending.put(i, {calibrated.CLOSED: _attention_tensors(layer.closed, dtype, attention_bias),
                                    calibrated.REFINED: _attention_tensors(layer.refined, dtype, attention_bias)})
                del layer, src
                write_mlp_and_norm(writer, reader, spec, i, alpha, dtype)
            else:
                mla, report = convert_attention(src, shape, lopts)
                reports.append(report)
                del src
                write_layer(writer, reader, spec, i, mla, alpha, dtype, attention_bias)
                del mla
        if streamer:
            agreement = streamer.agreement(progress)
            written, reason = calibrated.written_model(agreement)
            for i in list(pending.keys):
                for name, tensor in pending.take(i, written).items():
                    writer.add(deepseek.layer_prefix(i) + name, tensor)
            reports = [r.refined if written == calibrated.REFINED and r.refined is not None else r.closed
                       for r in records]
        writer.finish()
        reader.close()

        kept = rope.kept_frequencies(shapes.rope_dim, lopts.rope_stride)
        theta = rope.target_rope_theta(spec.rope_theta, spec.rotary_dim, shapes.rope_dim, lopts.rope_stride)
        rope_scaling, rope_rewrite = rope_scaling_for(target(options.target), rope.target_rope_scaling(spec.rope_scaling, kept),
                                                      theta, shapes.rope_dim, spec.rope_frequencies()[kept])
        config = deepseek.build_config(spec, rank=shapes.rank, rope_dim=shapes.rope_dim, rope_theta=theta,
                                       rope_scaling=rope_scaling, attention_bias=attention_bias,
                                       dtype_name=str(dtype).replace("torch.", ""))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = _copy_tokenizer(folder, tmp)

        source_id = None if Path(source).expanduser().exists() else source  # a hub id, not a local path
        report = _report(spec, shapes, config, reports, out, source_id, folder, dtype, alpha, options, copied)
        report["target"] = target_report(options.target, reports, rope_rewrite, options.calibrated)
        if shape_search:
            report["shape_search"] = shape_search
        if streamer:
            report["mode"] = "calibrated"
            report["calibration"] = calibrated.calibration_report(streamer, refinement, records, agreement, written,
                                                                  reason)
        if options.verify:
            from mlaconv.verify import verify

            report["verify"] = _after_conversion(
                lambda: verify(folder, tmp, spec, windows=options.verify_windows, window=options.verify_window),
                "the built-in check")
        else:
            report["verify"] = None
        if options.evaluated:
            report["eval"] = _after_conversion(lambda: _evaluate(tmp, folder, out, options, progress),
                                               "the evaluation")
        if options.absorbed:
            from mlaconv.absorb import write_absorbed

            manifest = write_absorbed(tmp, shard_size=options.shard_size)
            report["absorbed"] = {"folder": str(out / "absorbed"), "tensors": len(manifest["tensors"]),
                                  "max_relative_nonlinearity": manifest["latent_norm"]["max_relative_nonlinearity"]}
        report.update(options.extra_report)
        (tmp / "mlaconv.json").write_text(json.dumps(report, indent=2) + "\n")
        write_model_card(tmp, report)
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def _eval_source(options: ConvertOptions) -> TokenSource:
    token_source = TokenSource(text=Path(options.eval_text) if options.eval_text else None,
                               dataset=options.eval_dataset,
                               tokens=Path(options.eval_tokens) if options.eval_tokens else None)
    for path in (token_source.text, token_source.tokens):
        if path is not None and not path.is_file():
            raise MlaconvError(f"evaluation file not found: {path}")
    token_source.describe()  # parses a dataset name
    return token_source


def _after_conversion(check: Callable[[], dict], what: str) -> dict:
    """Run a check of the finished checkpoint; its failure is reported, never allowed to discard OUT."""
    try:
        return check()
    except MlaconvError as exc:
        return {"error": f"{what} failed: {exc}"}
    except Exception as exc:  # a bug in a check must not cost the user the conversion
        return {"error": f"{what} failed unexpectedly: {type(exc).__name__}: {exc}"}


def _evaluate(converted: Path, source: Path, out: Path, options: ConvertOptions, progress: Progress) -> dict:
    """``mlaconv eval perplexity`` of the fresh conversion against its source (same code path)."""
    result = evaluate_perplexity(converted, source, source=_eval_source(options), window=options.eval_window,
                                 max_windows=options.eval_max_windows, batch_size=options.eval_batch_size,
                                 device=options.device if options.device != "cpu" else None, progress=progress)
    result["model"] = str(out)
    return result


def rope_strides(reader: CheckpointReader, spec: SourceSpec, shape: AttentionShape, layer: LayerOptions,
                 rope_dims: list[int], progress: Progress = no_progress) -> dict[int, int]:
    """One frequency grid per candidate R for the whole model (the config has one rope_theta), from the weights.

    One pass reads each layer's key projection and input norm only; for each R the stride with the
    highest mean cost-weighted kept energy wins.
    """
    pending = [R for R in rope_dims if len(rope.strides(spec.rotary_dim, R)) > 1]
    chosen = {R: rope.strides(spec.rotary_dim, R)[0] for R in rope_dims if R not in pending}
    if pending:
        weights = SourceWeights(reader, spec)
        scores: dict[int, list[dict[int, float]]] = {R: [] for R in pending}
        for i in progress(range(spec.num_layers), "choosing rope frequencies", spec.num_layers):
            if not spec.rope_layers[i]:
                continue  # a layer without RoPE has no rotated energy to keep
            energies = key_energies(*weights.key(i), shape, layer)
            for R in pending:
                scores[R].append(rope.stride_scores(energies, R))
        chosen.update({R: rope.best_stride(scores[R]) for R in pending})
    return chosen


def write_outer_tensors(writer: ShardedWriter, reader: CheckpointReader, spec: SourceSpec, alpha: float,
                        dtype: torch.dtype) -> None:
    """The head, the embedding (scaled by the residual rescale α) and the final norm, one at a time, each
    with what its family folds into it (``SourceWeights``)."""
    weights = SourceWeights(reader, spec)
    writer.add(deepseek.LM_HEAD, weights.tensor(None, deepseek.LM_HEAD).to(dtype))
    writer.add(deepseek.EMBED, _scaled(weights.tensor(None, deepseek.EMBED), alpha, dtype))
    writer.add(deepseek.FINAL_NORM, weights.tensor(None, deepseek.FINAL_NORM).to(dtype))


def _attention_tensors(mla: MLAAttention, dtype: torch.dtype, biases: bool) -> dict[str, torch.Tensor]:
    """Layer i's converted attention and its input norm as output tensors (names without the layer prefix), in
    ``dtype``. With ``biases`` (the config's attention_bias) both bias tensors go in, zeros where the layer has none."""
    tensors = {deepseek.INPUT_NORM: mla.input_norm, deepseek.Q_PROJ: mla.q_proj, deepseek.KV_A_PROJ: mla.kv_a_proj,
               deepseek.KV_A_NORM: mla.kv_a_norm, deepseek.KV_B_PROJ: mla.kv_b_proj, deepseek.O_PROJ: mla.o_proj}
    if biases:
        tensors[deepseek.KV_A_BIAS] = mla.kv_a_bias if mla.kv_a_bias is not None else torch.zeros(mla.kv_a_proj.shape[0])
        tensors[deepseek.O_BIAS] = mla.o_bias if mla.o_bias is not None else torch.zeros(mla.o_proj.shape[0])
    return {name: tensor.to(dtype) for name, tensor in tensors.items()}


def write_attention(writer: ShardedWriter, i: int, mla: MLAAttention, dtype: torch.dtype, biases: bool) -> None:
    """Layer i's converted attention ``mla`` (α is already in its o_proj)."""
    for name, tensor in _attention_tensors(mla, dtype, biases).items():
        writer.add(deepseek.layer_prefix(i) + name, tensor)


def write_layer(writer: ShardedWriter, reader: CheckpointReader, spec: SourceSpec, i: int, mla: MLAAttention,
                alpha: float, dtype: torch.dtype, biases: bool) -> None:
    """Layer i of the output: the converted attention ``mla`` with its input norm, then the source MLP and
    post-attention norm."""
    write_attention(writer, i, mla, dtype, biases)
    write_mlp_and_norm(writer, reader, spec, i, alpha, dtype)


def write_mlp_and_norm(writer: ShardedWriter, reader: CheckpointReader, spec: SourceSpec, i: int, alpha: float,
                       dtype: torch.dtype) -> None:
    """Layer i's source MLP (down_proj scaled by α) and post-attention norm, read and written one tensor at a time,
    with what the family folds into them (``SourceWeights``)."""
    weights, p = SourceWeights(reader, spec), deepseek.layer_prefix(i)
    for name in (deepseek.GATE_PROJ, deepseek.UP_PROJ):
        writer.add(p + name, weights.tensor(i, name).to(dtype))
    weights.release()
    writer.add(p + deepseek.DOWN_PROJ, _scaled(weights.tensor(i, deepseek.DOWN_PROJ), alpha, dtype))
    writer.add(p + deepseek.POST_ATTENTION_NORM, weights.tensor(i, deepseek.POST_ATTENTION_NORM).to(dtype))


def _scaled(matrix: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """matrix·α in ``dtype``, scaled in place in the wider of the two dtypes: no float64 copy of a large matrix
    (the multiply runs in float32 at least, within one unit in the last place of the exact product)."""
    return matrix.to(torch.promote_types(matrix.dtype, dtype)).mul_(alpha).to(dtype)


def _copy_tokenizer(source: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            copied.append(name)
    return copied


def _estimate_output_bytes(spec: SourceSpec, shapes: Shapes, dtype: torch.dtype, absorbed: bool = False) -> int:
    H, N, d, R, r, L = (spec.hidden_size, spec.num_heads, spec.head_dim, shapes.rope_dim, shapes.rank,
                        spec.num_layers)
    attention = N * (d + R) * H + (r + R) * H + r + N * 2 * d * r + H * N * d
    if absorbed:  # OUT/absorbed: q_latent, q_rope, kv_down, o_latent per layer
        attention += N * r * H + N * R * H + (r + R) * H + H * N * r
    mlp = 3 * H * spec.intermediate_size + 2 * H
    total = L * (attention + mlp) + 2 * spec.vocab_size * H + H
    return total * torch.empty((), dtype=dtype).element_size()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _report(spec: SourceSpec, shapes: Shapes, config: dict, reports: list[LayerReport], out: Path, source_id: str | None,
            source: Path, dtype: torch.dtype, residual_scale: float, options: ConvertOptions, copied: list[str]) -> dict:
    from mlaconv.serving import serving_notes

    source_elements = spec.kv_elements_per_token_per_layer
    converted_elements = shapes.rank + shapes.rope_dim
    element_bytes = torch.empty((), dtype=dtype).element_size()
    energy = [r.energy_retained for r in reports]
    rope_kept = [r.rope_energy_kept for r in reports]
    from mlaconv.engines import BIASES

    dropped = sorted({b for r in reports for b in r.dropped_bias} - set(BIASES))  # no stack holds these; the
    # biases a target leaves out are in report["target"]
    return {
        "mlaconv_version": __version__,
        "transformers_version": transformers.__version__,
        "output": str(out),
        "source": str(source),
        "source_id": source_id,
        "source_revision": source.name if source.parent.name == "snapshots" else None,
        "settings": {k: v for k, v in asdict(options).items() if k not in ("extra_report", "force")},
        "architecture": spec.family.label,
        "source_shape": {"layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
                         "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "rotary_dim": spec.rotary_dim,
                         "layers_without_rope": [i for i, rotated in enumerate(spec.rope_layers) if not rotated]},
        "recipe": options.recipe,
        "mode": "weights-only",
        "dtype": str(dtype).replace("torch.", ""),
        "kv_lora_rank": shapes.rank,
        "qk_rope_head_dim": shapes.rope_dim,
        "qk_nope_head_dim": spec.head_dim,
        "v_head_dim": spec.head_dim,
        "shape_choice": shapes.reason,
        "rope_theta": config["rope_theta"],
        "rope_stride": reports[0].rope_stride,
        "kv_elements_per_token_per_layer": {"source": source_elements, "converted": converted_elements},
        "kv_bytes_per_token": {
            "source": source_elements * spec.num_layers * element_bytes,
            "converted": converted_elements * spec.num_layers * element_bytes,
        },
        "kv_keep": converted_elements / source_elements,
        "energy_retained": {"per_layer": energy, "mean": _mean(energy)},
        "rope_energy_kept": rope_kept,
        "rope_energy_kept_mean": _mean(rope_kept),
        "rope_energy_kept_per_frequency": [r.rope_energy_kept_per_frequency for r in reports],
        "rope_loss_weighted_kept": [r.rope_loss_weighted_kept for r in reports],
        "key_error": [r.key_error for r in reports],
        "attention_error": [r.attention_error for r in reports],
        "layer_variant": [r.variant for r in reports],
        "value_error": [r.value_error for r in reports],
        "objective_retained": [r.objective_retained for r in reports],
        "latent_norm": {"eps": LATENT_NORM_EPS, "delta": options.delta,
                        "max_bound": max(r.latent_bound for r in reports)},
        "residual_scale": residual_scale,
        "source_rms_norm_eps": spec.rms_norm_eps,
        "dropped_bias": dropped,
        "tokenizer_files": copied,
        "serving": serving_notes(spec, config, dropped),
    }
