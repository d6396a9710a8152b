"""The calibrated conversion's policy: which variant each layer keeps, the (r, R) split of a --kv-keep budget,
how much refinement runs, and which of the closed-form and refined models is written.

The calibration windows are split into fit, select and audit sets (``calibration.windows.split_windows``). The
factorizations and the refinement's gradient steps see fit windows only; every choice below is made on
select windows; every figure the report gives is measured on audit windows. The audit windows choose one
thing only, at the very end: which of two whole models, the closed form or the refined one, is written
(KL to the source, ``SourceStreamer.agreement``); the report gives both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from mlaconv.calibration.rotary_audit import RotaryAudit
from mlaconv.calibration.streamer import CalibrationOptions, MLARun, SourceStreamer
from mlaconv.calibration.windows import WindowSplit, load_calibration_tokens, split_windows
from mlaconv.conversion.pipeline import LayerStep, SourceLayer, source_layers
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipelines import Pipeline, PipelineSections, register
from mlaconv.conversion.plan import (FOLD_TURN, Plan, ShapeChoice, kv_budget, rope_strides, served_context,
                                    shape_candidates, with_rope_stride)
from mlaconv.errors import MlaconvError
from mlaconv.mla import rope
from mlaconv.mla.attention import assemble, factor_attention, latent_errors
from mlaconv.mla.layer import LayerOptions, LayerReport, MLAAttention
from mlaconv.mla.refine import CHECK_EVERY, QUERY_SHARE, REFINE_BATCH, REFINE_LR, refine, refinement_flops
from mlaconv.progress import Progress, no_progress
from mlaconv.report.conversion import (Agreement, Calibration, LayerFigures, LayerSelection, RefinementOutcome,
                                       ShapeSearch, SplitCandidate, WholeModel)
from mlaconv.report.record import WindowSets
from mlaconv.source.spec import SourceSpec

DEFAULT_REFINE_STEPS = 150  # of REFINE_BATCH windows at REFINE_LR (75 of 4, then 200 at 3e-3 before: docs/bench-history.md)
MIN_REDUCED_STEPS = 25  # below this a reduced refinement is not worth running (see bench/refine/README.md)
REDUCED_REFINE_LR = 3e-3  # the reduced plan's steps of one window, at the rate its figures were measured with
# What refinement assumes a CPU sustains when it estimates its own cost. Conservative: on the 2 cores this was
# developed on, steps on a Qwen2.5-0.5B-shaped layer (2048-token windows) ran 1.5–2.3× faster than estimated.
CPU_FLOPS = 5e10
SEARCH_FIT_WINDOWS = 8  # fit windows the --kv-keep split search factors on (it measures on the select windows)
SEARCH_REFINE_STEPS = 50  # reduced-plan steps each candidate split is refined for before the search compares them
CLOSED, REFINED = "closed form", "refined"  # the two whole models the audit compares


def calibration_tokens(plan: Plan) -> torch.Tensor | None:
    """The [B, S] calibration windows, when calibration was asked for."""
    if plan.calibration is None:
        return None
    return load_calibration_tokens(plan.folder, plan.spec, list(plan.calibration.files), plan.calibration.dataset,
                                   plan.options.calib_tokens, plan.options.calib_window)


def calibration_streamer(plan: Plan, tokens: torch.Tensor | None = None, split: WindowSplit | None = None,
                         sequential: str | None = None) -> SourceStreamer | None:
    """The layer-by-layer source forward over the calibration windows (loaded unless given), when calibration
    was asked for; ``split`` defaults to ``split_windows`` of all of them; ``sequential`` as ``CalibrationOptions``'."""
    tokens = tokens if tokens is not None else calibration_tokens(plan)
    if tokens is None:
        return None
    options = plan.options
    return SourceStreamer(plan.reader, plan.spec, CalibrationOptions(tokens, options.calibration_device,
                                                                     options.calib_batch_size, split=split,
                                                                     sequential=sequential))


def calibrated_layer_options(layer: LayerOptions) -> LayerOptions:
    """The calibrated variant: whitened metric, measured attention profile, query-weighted RoPE mixing."""
    return replace(layer, query_weighted_rope=True)


def calibrated_candidates(layer: LayerOptions, search: bool) -> list[tuple[str, LayerOptions, bool]]:
    """The per-layer variants calibration measures: (label, options, use the calibration statistics).

    With ``search`` the weights-only variant is among them, so a calibrated layer never measures worse on the
    select windows; without it only the calibrated variant runs (what ``inspect spectra --calib`` shows).
    """
    calibrated = calibrated_layer_options(layer)
    if not search:
        return [("calibrated", calibrated, True)]
    return [
        ("weights-only", layer, False),
        ("calibrated", calibrated, True),
        ("calibrated, attention-weighted latent", replace(calibrated, latent_weighting="attention"), True),
    ]


def layer_run(spec, layer: LayerOptions, length: int) -> MLARun:
    """How a converted layer with these options runs on windows of ``length`` tokens (its rope slots at their
    source frequencies; LongRoPE's as at that length)."""
    freqs = spec.rope_frequencies(length)
    slots = freqs[rope.kept_frequencies(layer.rope_dim, layer.rope_stride)]
    return MLARun(layer.rank, layer.rope_dim, slots, layer.residual_scale)


def search_shapes(plan: Plan, tokens: torch.Tensor, steps: int, progress: Progress = no_progress
                  ) -> tuple[Plan, ShapeSearch]:
    """Choose the (r, R) split of a --kv-keep budget by the attention error it measures on the select windows.

    One streamed pass over a few fit windows (which the factorizations and the refinement use) and the select
    windows (which measure) converts every layer at every candidate split (``shape_candidates``), refines each for
    ``steps`` of the reduced plan's steps (none: the closed forms are compared) and sums the relative
    attention-output errors; the split with the least total wins. The splits are compared refined because the
    refinement repairs the key side far more than the values: on SmolLM2-135M at 50% the closed forms rank R = 64
    first, refined R = 48 is better, and so is the whole model it makes (bench/real/README.md). Only splits that hold
    over the served context are compared (``served_candidates``); with one left it is kept unmeasured. Returns the
    plan with those shapes and the table behind the choice.
    """
    options, spec = plan.options, plan.spec
    context = served_context(spec, options)
    candidates = [c for c in shape_candidates(spec, options.kv_keep, plan.target, context)
                  if options.rope_stride is None or options.rope_stride in rope.strides(spec.rotary_dim, c.rope_dim)]
    if not candidates:
        raise MlaconvError(f"--rope-stride {options.rope_stride} fits none of the rope dims this budget allows")
    strides = ({c.rope_dim: plan.layer.rope_stride for c in candidates} if plan.layer.rope_stride is not None else
               rope_strides(plan, [c.rope_dim for c in candidates], progress))
    candidates, reach = served_candidates(spec, candidates, strides, context)
    layers = {c: replace(plan.layer, rank=c.rank, rope_dim=c.rope_dim, rope_stride=strides[c.rope_dim])
              for c in candidates}
    if len(candidates) == 1:
        only = candidates[0]
        chosen = ShapeChoice(rank=only.rank, rope_dim=only.rope_dim, reason=f"{only.rank} + {only.rope_dim}: {reach}")
        return replace(plan, shapes=chosen, layer=layers[only]), ShapeSearch([], chosen.reason, context=context)
    split = split_windows(tokens.shape[0])
    fit, select = list(split.fit[:SEARCH_FIT_WINDOWS]), list(split.select)
    streamer = calibration_streamer(plan, tokens[fit + select], WindowSplit(
        fit=tuple(range(len(fit))), select=tuple(range(len(fit), len(fit) + len(select))), audit=()))
    window = tokens.shape[1]
    errors = {c: 0.0 for c in candidates}
    for source in source_layers(plan.reader, spec, streamer, progress, "choosing r and R"):
        train, held = streamer.refinement_data(source.index, source.attention, len(fit)) if steps else (None, None)
        for c, layer in layers.items():
            errors[c] += split_errors(plan, streamer, source, calibrated_layer_options(layer), window, train, held,
                                      (steps,) if steps else ())[-1]
    best = min(candidates, key=lambda c: errors[c])
    table = [SplitCandidate(c.rank, c.rope_dim, errors[c] / spec.num_layers) for c in candidates]
    whole, budget = kv_budget(spec, options.kv_keep, None, plan.target)
    held_to = f" (held to {budget}: the largest r + R vLLM runs)" if budget != whole else ""
    compared = f"after {steps} refinement steps" if steps else "in closed form"
    reason = (f"{best.rank} + {best.rope_dim} of a budget of {whole} elements{held_to}: the least mean attention error "
              f"({errors[best] / spec.num_layers:.4f}) of {len(candidates)} splits {compared}, factored on {len(fit)} "
              f"fit windows and measured on {len(select)} select windows; {reach}")
    chosen = ShapeChoice(rank=best.rank, rope_dim=best.rope_dim, reason=reason)
    return (replace(plan, shapes=chosen, layer=layers[best]),
            ShapeSearch(table, reason, {"fit": fit, "select": select}, refine_steps=steps, context=context))


def served_candidates(spec: SourceSpec, candidates: list[ShapeChoice], strides: dict[int, int], context: int
                      ) -> tuple[list[ShapeChoice], str]:
    """The splits whose folded frequencies turn by at most FOLD_TURN over the served ``context`` (each keeps the
    rest of its rotation at the mean the calibration windows measured, which holds only while it turns little), or
    where none does the ones that fold the least-turning; and a line on what was left out."""
    freqs = spec.rope_frequencies(context)
    turns = {c: rope.folded_turn(freqs, c.rope_dim, strides[c.rope_dim], context) for c in candidates}
    kept = [c for c in candidates if turns[c] <= FOLD_TURN] or [c for c in candidates if turns[c] == min(turns.values())]
    left = [c for c in candidates if c not in kept]
    line = f"served context {context:,} tokens"
    if left:
        line += (f"; left out, as their folded frequencies turn by more than {FOLD_TURN} rad over it: "
                 f"{', '.join(f'R = {c.rope_dim} ({turns[c]:.2f} rad)' for c in left)} (--context to serve less)")
    if turns[kept[0]] > FOLD_TURN:
        line += (f"; no split of this budget keeps every frequency that turns more than {FOLD_TURN} rad over it: this "
                 f"one folds frequencies turning {turns[kept[0]]:.2f} rad, so attention far back is approximated")
    return kept, line


def split_errors(plan: Plan, streamer: SourceStreamer, source: SourceLayer, layer: LayerOptions, window: int,
                 train: tuple | None, held: tuple | None, checkpoints: tuple[int, ...]) -> list[float]:
    """One source layer converted at ``layer``'s (r, R) split: its relative attention error on the select windows
    in closed form, then after each of ``checkpoints`` (a rising count of the reduced plan's steps on ``train``)."""
    run = layer_run(plan.spec, layer, window)
    latent, _ = factor_attention(source.linear, plan.shape, layer, source.stats)
    mla, _ = assemble(latent, plan.shape, layer, source.attention.input_norm, source.stats.metric)
    errors = [streamer.attention_error(source.index, source.attention, mla, run.rank, run.rope_dim,
                                       run.slot_frequencies, run.residual_scale, windows="select")]
    done = 0
    for seed, steps in enumerate(checkpoints):
        result = refine(latent, plan.shape, run.rope_dim, run.slot_frequencies, train, held, steps=steps - done,
                        batch=1, check_every=steps - done, lr=REDUCED_REFINE_LR, queries=step_queries(window),
                        before=errors[-1], seed=seed)
        latent, done = result.latent, steps
        errors.append(result.after)
    return errors


def search_steps(refinement: RefinementPlan) -> int:
    """Refinement steps each candidate split gets in the search: SEARCH_REFINE_STEPS, at most what the conversion's
    own refinement runs (none where it runs none)."""
    return min(SEARCH_REFINE_STEPS, refinement.steps * refinement.batch)


@dataclass(frozen=True)
class RefinementPlan:
    steps: int  # gradient steps per layer (0: none)
    batch: int  # calibration windows per step
    note: str  # why, for the report
    check_every: int = CHECK_EVERY  # steps between two measurements on the select windows
    lr: float = REFINE_LR  # relative learning rate (``refine``)
    queries: int | None = None  # positions of each window a step's error is taken at (None: all)
    train_windows: int = 0  # fit windows the steps draw from (``training_windows``)


def training_windows(fit: int, window: int, refine_tokens: int) -> int:
    """How many of the ``fit`` windows the refinement trains on: as many whole ``window``-token windows as
    ``refine_tokens`` holds (at least one)."""
    return max(1, min(fit, refine_tokens // window))


def step_queries(window: int) -> int:
    """Positions of a ``window``-token window that one refinement step takes its error at."""
    return max(1, window // QUERY_SHARE)


def refinement_plan(plan: Plan, streamer: SourceStreamer | None) -> RefinementPlan:
    """How much refinement to run per layer, and why.

    The default is 150 steps of 8 fit windows at a relative learning rate of 3e-2, each step's error taken at an
    eighth of every window's positions, measured on the select windows every 10 steps. On a CPU, where that is
    estimated above ``--refine-minutes`` (30), it is reduced to steps of one window (an eighth of its positions) at
    3e-3, measured once at the end, as many as fit in that time (at least 25), else skipped; the note says which.
    At an equal number of windows such steps fit a layer as well as the full plan's, in less time on a CPU
    (bench/refine/README.md). Healing (on by default) runs after it either way: on SmolLM2-135M at 50% the two
    together beat either alone on the development texts (bench/real/README.md).
    """
    options = plan.options
    if streamer is None:
        return RefinementPlan(0, REFINE_BATCH, "no calibration data")
    if options.refine_steps == 0:
        return RefinementPlan(0, REFINE_BATCH, "off (--refine-steps 0)")
    window = streamer.options.tokens.shape[1]
    queries = step_queries(window)
    train_windows = training_windows(len(streamer.split.fit), window, options.refine_tokens)  # a step draws from these
    if options.refine_steps is not None:
        return RefinementPlan(options.refine_steps, min(options.refine_batch, train_windows), "set by --refine-steps",
                              check_every=options.refine_check_every, queries=queries, train_windows=train_windows)
    cpu = cpu_refinement(plan.spec, plan.shapes, window, len(streamer.split.select), 60 * options.refine_minutes)
    if options.calibration_device.startswith("cuda") or cpu.reduced_steps is None:
        return RefinementPlan(DEFAULT_REFINE_STEPS, min(REFINE_BATCH, train_windows), "default", queries=queries,
                              train_windows=train_windows)
    minutes = f"{options.refine_minutes:g} min"
    advice = "give --refine-minutes more time for more steps, or calibrate with --device cuda"
    if cpu.reduced_steps:
        return RefinementPlan(cpu.reduced_steps, 1, (
            f"reduced: {cpu.reduced_steps} steps of one window, about {minutes} on this CPU by estimate (the full "
            f"{DEFAULT_REFINE_STEPS} steps of {REFINE_BATCH} would take about {cpu.full_seconds / 3600:.1f} h); "
            f"{advice}"), check_every=cpu.reduced_steps, lr=REDUCED_REFINE_LR, queries=queries,
            train_windows=train_windows)
    return RefinementPlan(0, REFINE_BATCH, (
        f"skipped: even {MIN_REDUCED_STEPS} steps of one window would take about {cpu.least_seconds / 3600:.1f} h on "
        f"this CPU by estimate (the full refinement {cpu.full_seconds / 3600:.1f} h); {advice}"))


@dataclass(frozen=True)
class CPURefinement:
    """What a CPU can afford of the refinement, by estimate (``refinement_seconds``)."""

    full_seconds: float  # the default plan
    reduced_steps: int | None  # steps of one window that fit in the budget (None: the full plan fits; 0: not
    # even MIN_REDUCED_STEPS do)
    least_seconds: float  # MIN_REDUCED_STEPS steps of one window


def cpu_refinement(spec: SourceSpec, shapes: ShapeChoice, window: int, selected: int,
                   budget: float = 60 * ConvertOptions.refine_minutes) -> CPURefinement:
    """What a CPU can afford of the default plan for this model, shapes and calibration in ``budget`` seconds
    (``affordable``)."""
    return affordable(partial(refinement_seconds, spec, shapes, window, selected), DEFAULT_REFINE_STEPS, REFINE_BATCH,
                      CHECK_EVERY, budget)


def affordable(seconds: Callable[[int, int, int], float], steps: int, batch: int, check_every: int,
               budget: float) -> CPURefinement:
    """The full plan (``steps`` of ``batch`` windows) where ``seconds(steps, batch, check_every)`` is within
    ``budget``, else as many steps of one window as fit (up to as many windows as the full plan's steps see, at least
    MIN_REDUCED_STEPS, one check at the end), else none."""
    full = seconds(steps, batch, check_every)
    least = seconds(MIN_REDUCED_STEPS, 1, MIN_REDUCED_STEPS)
    if full <= budget:
        return CPURefinement(full, None, least)
    fits = [n for n in range(MIN_REDUCED_STEPS, steps * batch + 1) if seconds(n, 1, n) <= budget]
    return CPURefinement(full, fits[-1] if fits else 0, least)


def refinement_seconds(spec: SourceSpec, shapes: ShapeChoice, window: int, selected: int, steps: int, batch: int,
                       check_every: int) -> float:
    """Estimated CPU time of a whole refinement at ``CPU_FLOPS``: the steps (their error at ``step_queries``
    positions of each window), and the measurements on ``selected`` select windows (forward only at every
    position, ⅓ of such a step's work) every ``check_every`` steps and after the last (the closed form's is the
    variant choice's own)."""
    def flops(windows: int, queries: int | None) -> float:
        return refinement_flops(spec.attention_shape, shapes.rope_dim, shapes.rank, windows, window, queries)

    checks = -(-steps // check_every)
    work = steps * flops(batch, step_queries(window)) + checks * flops(selected, None) / 3
    return spec.num_layers * work / CPU_FLOPS


@dataclass
class LayerRecord:
    """What the report keeps of one calibrated layer: figures measured on the audit windows, and the choices."""

    closed: LayerReport  # the closed form kept on the select windows
    refined: LayerReport | None  # the refined layer, when refinement ran and beat the closed form there
    selection: LayerSelection  # what the select windows measured


@dataclass
class CalibratedLayer:
    closed: MLAAttention
    refined: MLAAttention | None
    record: LayerRecord


def calibrate_layer(source: SourceLayer, plan: Plan, search: bool = True, refinement: RefinementPlan | None = None,
                    rotary: RotaryAudit | None = None) -> CalibratedLayer:
    """Convert layer i each way ``calibrated_candidates`` lists and keep the one with the least attention-output
    error on the select windows; with ``refinement`` steps, refine it on fit windows (best step chosen on the
    select windows) and keep that too if it beats the closed form there. Every reported figure is then
    re-measured on the audit windows, for the closed form and the refined layer alike (the rotary ones from the
    layer's own q_rope and k_rope, ``rotary``: measured here unless given)."""
    i, src, streamer, stats = source.index, source.attention, source.streamer, source.stats
    audit_metric, linear = source.audit_metric(), source.linear  # linear: src unless QK-norm
    layer, run = plan.layer, layer_run(plan.spec, plan.layer, streamer.options.tokens.shape[1])
    rotary = rotary or source.rotary_audit(plan.shape, layer)

    def error(mla: MLAAttention, windows: str) -> float:
        return streamer.attention_error(i, src, mla, run.rank, run.rope_dim, run.slot_frequencies,
                                        run.residual_scale, windows=windows)

    def audited(latent, mla: MLAAttention, report: LayerReport) -> LayerReport:
        key_error, value_error, energy = latent_errors(latent.k_nope_target, src.v, latent.up_k, latent.up_v,
                                                       latent.down, audit_metric)
        kept = rotary.of_latent(latent, run.rope_dim, report.rope_stride)
        return replace(report, key_error=key_error, value_error=value_error, energy_retained=energy,
                       attention_error=error(mla, "audit"), rope_energy_kept=kept.energy_kept,
                       rope_energy_kept_per_frequency=kept.energy_kept_per_frequency,
                       rope_loss_weighted_kept=kept.loss_weighted_kept, rope_score=kept.score)

    measured: dict[str, float] = {}
    best = None
    for label, options, use_stats in calibrated_candidates(layer, search):
        latent, report = factor_attention(linear, plan.shape, options, stats if use_stats else None)
        mla, report.latent_bound = assemble(latent, plan.shape, layer, src.input_norm, stats.metric)
        measured[label] = error(mla, "select")
        if best is None or measured[label] < measured[best[0]]:
            best = (label, latent, mla, replace(report, variant=label))
    label, latent, closed, report = best
    selection = LayerSelection(measured, label)
    layer_result = CalibratedLayer(closed, None, LayerRecord(audited(latent, closed, report), None, selection))
    if refinement is not None and refinement.steps:
        train, select = streamer.refinement_data(i, src, refinement.train_windows)
        result = refine(latent, plan.shape, run.rope_dim, run.slot_frequencies, train, select, steps=refinement.steps,
                        batch=refinement.batch, check_every=refinement.check_every, lr=refinement.lr,
                        queries=refinement.queries, before=measured[label])
        kept = result.after < result.before
        selection.refinement = RefinementOutcome(result.before, result.after, kept)
        if kept:
            refined, bound = assemble(result.latent, plan.shape, layer, src.input_norm, stats.metric)
            layer_result.refined = refined
            layer_result.record.refined = audited(result.latent, refined, replace(
                report, variant=f"{label}, refined", latent_bound=bound, objective_retained=None))
    return layer_result


def followed_models(layer: CalibratedLayer, followed: dict) -> dict[str, MLAAttention]:
    """This layer of each whole model the audit follows: the closed form always; the refined model from its
    first refined layer on (before that it is the closed form), with the closed form where a layer was not refined."""
    models = {CLOSED: layer.closed}
    if layer.refined is not None or REFINED in followed:
        models[REFINED] = layer.refined if layer.refined is not None else layer.closed
    return models


@register("calibrated")
class CalibratedPipeline(Pipeline):
    """The calibrated conversion: its preparation (the windows, the (r, R) split measured for --kv-keep without
    --rope-dim, the streamer, the refinement plan and the rope stride), then ``CalibratedSteps`` on each layer; its
    sections of the report are the split search and the calibration."""

    def __init__(self, plan: Plan, progress: Progress = no_progress):
        tokens, self.shape_search = calibration_tokens(plan), None
        self.streamer = calibration_streamer(plan, tokens, sequential=plan.options.calib_sequential)
        if plan.options.kv_keep is not None and plan.options.rope_dim is None:
            steps = search_steps(refinement_plan(plan, self.streamer))  # as refined at the default split
            plan, self.shape_search = search_shapes(plan, tokens, steps, progress)
        self.refinement = refinement_plan(plan, self.streamer)
        super().__init__(with_rope_stride(plan, progress))
        self.step = CalibratedSteps(self.plan, self.streamer, self.refinement)

    def sections(self) -> PipelineSections:
        return PipelineSections(self.shape_search, self.step.report())


class CalibratedSteps(LayerStep):
    """The calibrated conversion as a layer step: ``calibrate_layer`` on each layer, both whole models followed on the
    audit windows, and at the end the one with the lower KL written (``written_model``)."""

    def __init__(self, plan: Plan, streamer: SourceStreamer, refinement: RefinementPlan):
        self.plan, self.streamer, self.refinement = plan, streamer, refinement
        self.run = layer_run(plan.spec, plan.layer, streamer.options.tokens.shape[1])
        self.records: list[LayerRecord] = []
        self.agreement: dict = {}
        self.written, self.reason = CLOSED, ""

    def __call__(self, source: SourceLayer) -> dict[str, MLAAttention]:
        layer = calibrate_layer(source, self.plan, self.plan.options.layer_search, self.refinement)
        source.follow, source.run = followed_models(layer, self.streamer.followed), self.run
        if self.streamer.student is not None:
            source.kept = layer.refined if layer.refined is not None else layer.closed
        self.records.append(layer.record)
        return {CLOSED: layer.closed} if layer.refined is None else {CLOSED: layer.closed, REFINED: layer.refined}

    def finish(self, progress: Progress) -> str | None:
        self.agreement = self.streamer.agreement(progress)
        self.written, self.reason = written_model(self.agreement)
        return self.written

    @property
    def reports(self) -> list[LayerReport]:
        return [r.refined if self.written == REFINED and r.refined is not None else r.closed for r in self.records]

    def report(self) -> Calibration:
        return calibration_report(self.streamer, self.refinement, self.records, self.agreement, self.written,
                                  self.reason)


def written_model(agreement: dict[str, dict[str, float]]) -> tuple[str, str]:
    """Which whole model to write, and why: the refined one only if its KL to the source on the audit windows is
    lower than the closed form's."""
    if REFINED not in agreement:
        return CLOSED, "no layer was refined"
    closed, refined = agreement[CLOSED]["kl"], agreement[REFINED]["kl"]
    if refined < closed:
        return REFINED, f"the refined model's KL on the audit windows is lower ({refined:.4g} < {closed:.4g})"
    return CLOSED, (f"the refined model was rejected: its KL on the audit windows is not lower ({refined:.4g} ≥ "
                    f"{closed:.4g}), so every layer is written in closed form")


def layer_figures(reports: list[LayerReport | None]) -> LayerFigures:
    """Per-layer audit figures of one whole model (None where it has no layer of its own)."""
    def column(name: str) -> list:
        return [getattr(r, name) if r is not None else None for r in reports]

    return LayerFigures(column("attention_error"), column("energy_retained"), column("key_error"),
                        column("value_error"), column("variant"), column("objective_retained"),
                        column("rope_energy_kept"), column("rope_loss_weighted_kept"),
                        [r.rope_score.compensated if r is not None else None for r in reports])


def calibration_report(streamer: SourceStreamer, refinement: RefinementPlan, layers: list[LayerRecord],
                       agreement: dict, written: str, reason: str) -> Calibration:
    """The report's ``calibration`` section: the window sets, what was chosen on the select windows, and the audit
    figures of both whole models."""
    split = streamer.split
    windows, window = streamer.options.tokens.shape
    refined = agreement.get(REFINED)
    return Calibration(
        windows=windows, window=window, tokens=streamer.token_count, window_sets=window_sets(split),
        refine_steps=refinement.steps, refine_batch=refinement.batch, refine_queries=refinement.queries,
        refine_windows=refinement.train_windows if refinement.steps else None,
        refinement=refinement.note, sequential=streamer.options.sequential,
        selection=[layer.selection for layer in layers],
        closed_form=layer_figures([layer.closed for layer in layers]),
        refined=layer_figures([layer.refined for layer in layers]),
        whole_model=WholeModel(len(split.audit), len(split.audit) * window, Agreement(**agreement[CLOSED]),
                               Agreement(**refined) if refined else None, written, reason),
    )


def window_sets(split: WindowSplit) -> WindowSets:
    """The window indices of ``split``, for a report."""
    return WindowSets(list(split.fit), list(split.select), list(split.audit), split.note)
