"""``mlaconv heal``: a bounded end-to-end distillation of a converted model towards its source.

The conversion fits each layer on its own; what it loses compounds through the layers. Healing trains the tensors
the conversion wrote anew, every layer's ``q_proj``, ``kv_a_proj_with_mqa`` and ``kv_b_proj``, end to end so that
the converted model's next-token distributions match the source's, KL(source ‖ model) per token; every other tensor
is frozen and written back byte for byte (the norms the conversion wrote, ``kv_a_layernorm``'s constant and the
input norm's power-of-two scale, only rescale what these tensors already do).

The source's distributions are computed once per window before training (``teacher_targets``: its top-k
log-probabilities and the rest of its mass as one bucket), so the source is never in memory with the model being
trained. Each trained tensor is a fixed per-row scale times its converted rows plus a trained change
(``RowScale``), so Adam's steps are relative to each row's size: the tiny latent's rows and the query's rows, 10⁶
apart, move alike.

The windows of the calibration data are split three ways: *train* (the gradient steps), *select* (the best step,
measured every ``check_every`` steps, is the one kept) and *held out* (measured before and after healing through
``mlaconv eval perplexity``'s own code; nothing is chosen on them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.utils.parametrize as parametrize

from mlaconv.devices import computes_bfloat16, computing
from mlaconv.errors import MlaconvError
from mlaconv.progress import Progress, no_progress

TRAINED = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # per layer, under self_attn
DEFAULT_LR = 1e-3  # Adam's step, relative to each row's RMS
PRECISIONS = ("float32", "bfloat16")  # what healing's forward passes multiply in; the trained tensors stay float32
SCHEDULES = ("constant", "linear")  # Adam's step through training: the same throughout, or falling linearly to 0
DEFAULT_SCHEDULE = "linear"  # chosen on SmolLM2-135M's development texts (bench/real)
DEFAULT_WINDOW = 512
DEFAULT_BATCH = 4  # windows per step
STEP_TOKENS = DEFAULT_WINDOW * DEFAULT_BATCH  # a conversion's healing step, whatever its window
DEFAULT_TOP_K = 64
HELD_WINDOWS = 4  # select windows, and held-out windows, each
MIN_GAIN = 1e-6  # a check is kept only where it beats the best so far by this much KL per token: below it the
# difference is rounding (an exact conversion measures ~1e-8, and bfloat16 steps would move it off exact)
CHECK_EVERY = 25  # steps between two measurements on the select windows
CPU_SECONDS = 1800  # a CPU's default budget: as many tokens as fit in this at CPU_FLOPS …
CPU_TOKENS = 2**18  # … and no more than this
CPU_FLOPS = 1.5e11  # what healing sustains on the 2 cores of this project's machine (SmolLM2-135M: 7.7 ms a token
# for the source's forward and a step's forward, backward and update, 4.5 forward passes' work)
CUDA_TOKENS = 2**21  # a GPU's default budget
MAX_EPOCHS = 4  # the default budget's passes over the training windows, at most
WRITTEN_TOKENS = 2**16  # the default text the source writes itself, at most as many tokens as the calibration text
# healing trains on (development texts, bench/real/README.md: mean KL 0.186 → 0.182 on SmolLM2-135M at 50%)
STEP_COST = 3.5  # one training token costs about this many source forward tokens (forward, backward, the update)
BFLOAT16_STEP_SHARE = 0.75  # … times this in bfloat16 autocast, against the float32 forward the estimate is timed on
# (SmolLM2-135M on this project's 2 cores: a step of 4 × 512 took 11.5 s against 15.5 s in float32)
POSITION_SPAN = 4096  # healing's windows spread over this many positions by default, or the model's context where
# shorter (bench/real: SmolLM2-135M at 50% keeps its passkeys at 4K, which healing on 512 positions loses)
RECOMPUTE_SHARE = 0.5  # layers are recomputed in the backward pass when one window's activations would take more
# than this share of the free memory (SmolLM2-135M: about 2 GiB at 512 tokens, about 46 GiB at 4,096)


Observer = Callable[[int, torch.nn.Module], None]  # (step, model being trained): a bench's measurements at checks


@dataclass(frozen=True)
class HealOptions:
    tokens: int | None = None  # training tokens (None: ``default_tokens``)
    max_tokens: int | None = None  # the default budget's cap (None: CPU_TOKENS on a CPU, CUDA_TOKENS on a GPU)
    window: int = DEFAULT_WINDOW
    batch: int = DEFAULT_BATCH
    lr: float = DEFAULT_LR
    schedule: str = DEFAULT_SCHEDULE  # one of SCHEDULES
    top_k: int = DEFAULT_TOP_K
    check_every: int = CHECK_EVERY
    device: str = "cpu"
    seed: int = 0
    written_tokens: int | None = None  # tokens of text the source writes itself (``generate``), added to the training
    # windows (None: ``default_written``; 0: none)
    position_span: int | None = None  # training windows placed at positions spread over this many
    # (``skipped_positions``; None: ``default_position_span``; 0: none, each window at 0 … S − 1)
    precision: str | None = None  # one of PRECISIONS (None: ``default_precision``)


@dataclass
class Targets:
    """The source's next-token distributions on some windows: top-k log-probabilities and their token ids."""

    logp: torch.Tensor  # [W, S, k] float32
    ids: torch.Tensor  # [W, S, k] int64
    positions: torch.Tensor | None = None  # [W, S] the windows' position ids (None: 0 … S − 1)

    def placement(self, k: int, device) -> dict:
        """The keyword arguments that run window ``k`` at its positions (none at 0 … S − 1)."""
        return {} if self.positions is None else placed(self.positions[k], device)


def placed(positions: torch.Tensor, device) -> dict:
    """``position_ids`` [1, S] with an all-ones attention mask: without a mask transformers reads a jump in the
    positions as the start of another packed sequence and would hide the first chunk from the second."""
    return {"position_ids": positions[None].to(device), "attention_mask": torch.ones_like(positions[None], device=device)}


def skipped_positions(windows: int, length: int, span: int, seed: int) -> torch.Tensor:
    """Position ids [windows, length] that spread each window over ``span`` positions (PoSE, Zhu et al. 2023): the
    window in two chunks at a seeded split, the second shifted by a seeded skip in [0, span − length], so that a short
    window trains query–key distances up to ``span`` without the memory of a window that long."""
    generator = torch.Generator().manual_seed(seed)
    split = torch.randint(1, length, (windows, 1), generator=generator)
    skip = torch.randint(0, span - length + 1, (windows, 1), generator=generator)
    steps = torch.arange(length)[None]
    return steps + torch.where(steps >= split, skip, 0)


def default_precision(options: HealOptions) -> str:
    """``options.precision``, or bfloat16 where the device multiplies in it natively (``computes_bfloat16``), else
    float32."""
    return options.precision or ("bfloat16" if computes_bfloat16(options.device) else "float32")


def teacher_targets(model, windows: torch.Tensor, top_k: int, progress: Progress = no_progress,
                    label: str = "source distributions", positions: torch.Tensor | None = None,
                    precision: str | None = None) -> Targets:
    """The top-k log-probabilities of ``model`` at every position of ``windows`` [W, S], one window at a time, at
    ``positions`` [W, S] when given, in ``precision`` (float32 unless told)."""
    logp, ids = [], []
    device = next(model.parameters()).device
    with torch.inference_mode(), computing(device, precision):
        for k, window in enumerate(progress(windows, label, len(windows))):
            place = {} if positions is None else placed(positions[k], device)
            scores = model(window[None].to(device), **place, use_cache=False).logits[0].float().log_softmax(-1)
            values, indices = scores.topk(top_k, dim=-1)
            logp.append(values.cpu())
            ids.append(indices.cpu())
    return Targets(torch.stack(logp), torch.stack(ids), positions)


def sparse_kl(logits: torch.Tensor, logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Σ over positions of KL between the source and the model, both coarsened to the source's top-k tokens and one
    bucket for the rest (a lower bound on the full KL, equal to it when the top-k hold all the mass).

    logits [S, V] of the model; logp, ids [S, k] of the source."""
    model_logp = logits.float().log_softmax(-1).gather(-1, ids)  # [S, k]
    p = logp.exp()
    rest_p = (1 - p.sum(-1)).clamp_min(1e-12)
    rest_q = (1 - model_logp.exp().sum(-1)).clamp_min(1e-12)
    return ((p * (logp - model_logp)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())).sum()


class RowScale(torch.nn.Module):
    """W = scale ⊙ (W₀ / scale + D), D trained from 0, with a fixed per-row scale: the parametrization that makes
    Adam's steps relative per row and the change D from the converted weights W₀ its own tensor."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        scale = weight.pow(2).mean(1, keepdim=True).sqrt()
        self.register_buffer("scale", torch.where(scale > 0, scale, torch.ones_like(scale)))
        self.register_buffer("start", weight / self.scale)

    def forward(self, change: torch.Tensor) -> torch.Tensor:
        return (self.start + change) * self.scale

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.scale - self.start


def trained_modules(model) -> dict[str, torch.nn.Linear]:
    """The converted model's trained linear layers, by the name of their weight in the checkpoint."""
    modules = {}
    for i, layer in enumerate(model.model.layers):
        for name in TRAINED:
            modules[f"model.layers.{i}.self_attn.{name}.weight"] = getattr(layer.self_attn, name)
    return modules


def make_trainable(model) -> list[torch.nn.Parameter]:
    """Freeze ``model`` but for the trained tensors, each reparametrized by ``RowScale``; return their parameters."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    trained = []
    for module in trained_modules(model).values():
        parametrize.register_parametrization(module, "weight", RowScale(module.weight.detach()))
        original = module.parametrizations.weight.original
        original.requires_grad_(True)
        trained.append(original)
    return trained


def trained_weights(model) -> dict[str, torch.Tensor]:
    """The trained tensors as the checkpoint stores them (scale ⊙ P), detached on the CPU."""
    with torch.no_grad():
        return {name: module.weight.detach().cpu().clone() for name, module in trained_modules(model).items()}


def activation_bytes(config, window: int) -> int:
    """About what one training window's backward keeps in float32 when no layer is recomputed: per layer and token
    the attention's scores and probabilities (heads × window) and the layer's other saved tensors (about 16 hidden
    widths, 4 intermediate widths and 4 widths of the heads' queries, keys and values), and the logits 3 times."""
    heads = config.num_attention_heads
    head_dims = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    per_token = (2 * heads * window + 16 * config.hidden_size + 4 * config.intermediate_size + 4 * heads * head_dims)
    return 4 * window * (config.num_hidden_layers * per_token + 3 * config.vocab_size)


def recompute_layers(model) -> None:
    """Recompute each decoder layer in the backward pass (transformers' activation checkpointing, named gradient
    checkpointing before 5.x), which runs only in training mode: the decoder layers alone are put in it, so nothing
    below them (dropout) changes."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        layer.training = True


def mean_kl(model, windows: torch.Tensor, targets: Targets) -> float:
    """The sparse KL per token of ``model`` on ``windows`` against ``targets``."""
    device = next(model.parameters()).device
    total = 0.0
    with torch.no_grad():
        for k, window in enumerate(windows):
            logits = model(window[None].to(device), use_cache=False).logits[0]
            total += sparse_kl(logits, targets.logp[k].to(device), targets.ids[k].to(device)).item()
    return total / windows.numel()


@dataclass
class Training:
    steps: int
    best_step: int
    select_before: float
    select_after: float
    seconds: float
    curve: list[tuple[int, float]]  # (step, select KL) at every check


def train(model, train_windows: torch.Tensor, train_targets: Targets, select_windows: torch.Tensor,
          select_targets: Targets, steps: int, options: HealOptions, progress: Progress = no_progress,
          label: str = "healing", observe: Observer | None = None,
          recompute: bool = False) -> tuple[dict[str, torch.Tensor], Training]:
    """Adam on the trained tensors of ``model`` over ``steps`` steps of ``options.batch`` training windows (drawn
    in a seeded order, epoch after epoch), its step scheduled by ``options.schedule``, its forward passes in
    ``options.precision``; the best state on the select windows (the start included) is returned.
    ``observe(step, model)``, when given, runs at the start and at every check (a bench's own measurements; it must
    not change the model). ``recompute``: each decoder layer is run again
    in the backward pass instead of keeping its activations (``recompute_layers``)."""
    started = time.perf_counter()
    parameters = make_trainable(model)
    optimizer = torch.optim.Adam(parameters, lr=options.lr)
    falling = options.schedule == "linear"  # step s (from 1) runs at lr·(1 − (s − 1)/steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 - done / steps if falling else 1.0)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(options.seed)
    order: list[int] = []
    model.eval()  # no dropout; gradients flow regardless
    if recompute:
        recompute_layers(model)
    before = best = mean_kl(model, select_windows, select_targets)
    best_state, best_step, curve = trained_weights(model), 0, [(0, before)]
    if observe:
        observe(0, model)
    for step in progress(range(1, steps + 1), label, steps):
        optimizer.zero_grad(set_to_none=True)
        tokens = 0
        for _ in range(options.batch):
            if not order:
                order = torch.randperm(len(train_windows), generator=generator).tolist()
            k = order.pop()
            with computing(device, options.precision):
                logits = model(train_windows[k][None].to(device), **train_targets.placement(k, device),
                               use_cache=False).logits[0]
            loss = sparse_kl(logits, train_targets.logp[k].to(device), train_targets.ids[k].to(device))
            (loss / (options.batch * train_windows.shape[1])).backward()
            tokens += train_windows.shape[1]
        optimizer.step()
        schedule.step()
        if step % options.check_every == 0 or step == steps:
            measured = mean_kl(model, select_windows, select_targets)
            curve.append((step, measured))
            if observe:
                observe(step, model)
            if measured < best - MIN_GAIN:
                best, best_step, best_state = measured, step, trained_weights(model)
    training = Training(steps, best_step, before, best, time.perf_counter() - started, curve)
    return best_state, training


def default_tokens(options: HealOptions, parameters: int, window: int, windows: int) -> int:
    """The default budget: on a GPU CUDA_TOKENS; on a CPU CPU_TOKENS, or fewer where a model of ``parameters``
    weights would take over CPU_SECONDS at CPU_FLOPS; ``options.max_tokens`` in place of either cap when given; at
    most MAX_EPOCHS passes over the ``windows`` training windows, at least one step. A function of the shapes alone,
    so that the same inputs give the same output on any machine."""
    step_tokens = window * options.batch
    gpu = options.device.startswith("cuda")
    cap = options.max_tokens or (CUDA_TOKENS if gpu else CPU_TOKENS)
    fits = cap if gpu else int(CPU_SECONDS * CPU_FLOPS / (2 * parameters * (1 + STEP_COST)))
    return max(step_tokens, min(fits, cap, MAX_EPOCHS * windows * window) // step_tokens * step_tokens)


def default_written(options: HealOptions, calibration_tokens: int) -> int:
    """Tokens of written text to train on: ``options.written_tokens``, or WRITTEN_TOKENS but no more than the
    ``calibration_tokens`` of the training windows (so at most half of what healing trains on is written)."""
    if options.written_tokens is not None:
        return options.written_tokens
    return min(WRITTEN_TOKENS, calibration_tokens)


def default_position_span(span: int | None, window: int, context: int) -> int:
    """The span healing's ``window``-token windows are spread over: ``span`` (``--position-span``), or POSITION_SPAN but
    no more than the ``context`` served; 0 (none) where that is no longer than the window."""
    span = span if span is not None else min(POSITION_SPAN, context)
    return span if span > window else 0


def check_options(options: HealOptions) -> None:
    if options.tokens is not None and options.tokens < options.window * options.batch:
        raise MlaconvError(f"--tokens {options.tokens} is less than one step ({options.batch} windows of "
                           f"{options.window})")
    if options.written_tokens is not None and options.written_tokens < 0:
        raise MlaconvError(f"--written must be ≥ 0, got {options.written_tokens}")
    if options.window < 2 or options.batch < 1 or options.top_k < 1 or options.check_every < 1:
        raise MlaconvError("--window must be ≥ 2 and --batch, --top-k and --check-every ≥ 1")
    if not (0 < options.lr < 1) or not math.isfinite(options.lr):
        raise MlaconvError(f"--lr must be in (0, 1), got {options.lr}")
    if options.position_span not in (None, 0) and options.position_span < options.window:
        raise MlaconvError(f"--position-span must be 0 (none) or at least --window ({options.window}), "
                           f"got {options.position_span}")
    if options.precision is not None and options.precision not in PRECISIONS:
        raise MlaconvError(f"--precision must be one of {', '.join(PRECISIONS)}, got {options.precision!r}")
    if options.schedule not in SCHEDULES:
        raise MlaconvError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {options.schedule!r}")
