"""Healing a converted folder: its windows, the source's targets, the training (``distill``), the tiny-latent bound
re-proved, and the output written atomically with its report, check, verdict and model card brought up to date.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mlaconv.calibration.windows import CalibrationData, cut_windows, drawn_windows, split_windows
from mlaconv.errors import MlaconvError
from mlaconv.devices import free_memory_bytes
from mlaconv.heal.distill import (BFLOAT16_STEP_SHARE, HELD_WINDOWS, RECOMPUTE_SHARE, STEP_COST, TRAINED,
                                  HealOptions, Observer, activation_bytes, check_options, default_position_span,
                                  default_precision, default_tokens, default_written, skipped_positions,
                                  teacher_targets, train)
from mlaconv.heal.generate import written_windows
from mlaconv.io import atomic_output_dir, check_output_target
from mlaconv.io.models import load_causal_lm
from mlaconv.io.text import TokenSource
from mlaconv.mla.latent_norm import DEFAULT_DELTA, latent_bound
from mlaconv.progress import Progress, no_progress
from mlaconv.report import ConversionReport
from mlaconv.report.conversion import HealFigures, HealReport
from mlaconv.source import names
from mlaconv.source.spec import load_source
from mlaconv.target import deepseek

BOUND_SLACK = 1e-3  # a bound over δ by less than this share is the conversion's own δ in rounding, left as it is


@dataclass(frozen=True)
class HealData:
    """The windows healing uses: ``windows`` [N, W] of the data and which of them train, select and are held out; each
    window is cut into chunks of the healing window for the steps and the measurements."""

    windows: torch.Tensor
    train: list[int]
    select: list[int]
    held_out: list[int]
    description: str  # what the data is, for the report


def split_data(source: Path, spec, data: CalibrationData, options: HealOptions) -> HealData:
    """``mlaconv heal``'s own split of the data's windows of ``options.window``: select and held-out windows
    (``HELD_WINDOWS`` each) at random (``options.seed``), the rest to train on."""
    windows = cut_windows(source, spec, list(data.files), data.dataset, options.window)
    if windows.shape[0] < 2 * HELD_WINDOWS + 1:
        raise MlaconvError(f"the calibration data holds {windows.shape[0]} windows of {windows.shape[1]} tokens; "
                           f"healing needs at least {2 * HELD_WINDOWS + 1} (give more text or a smaller --window)")
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(options.seed)).tolist()
    return HealData(windows, sorted(order[2 * HELD_WINDOWS:]), sorted(order[:HELD_WINDOWS]),
                    sorted(order[HELD_WINDOWS:2 * HELD_WINDOWS]), data.description)


def conversion_data(source: Path, spec, data: CalibrationData, calib_tokens: int, calib_window: int) -> HealData:
    """A conversion's own windows (``calibrated``: the same cut, draw and split): healing trains on its fit windows and
    on the windows of the data it did not draw, chooses on its select windows and is measured on its audit windows,
    which therefore still choose nothing."""
    windows = cut_windows(source, spec, list(data.files), data.dataset, calib_window)
    drawn = drawn_windows(windows.shape[0], calib_tokens // windows.shape[1]).tolist()
    split = split_windows(len(drawn))
    select, held = [drawn[k] for k in split.select], [drawn[k] for k in split.audit]
    chosen = set(select) | set(held)
    train = [k for k in range(windows.shape[0]) if k not in chosen]
    return HealData(windows, train, select[:HELD_WINDOWS], held[:HELD_WINDOWS], data.description)


def heal(folder: str | Path, source: str, out: str | Path, data: CalibrationData, options: HealOptions,
         force: bool = False, progress: Progress = no_progress, observe: Observer | None = None) -> HealReport:
    """Heal the converted checkpoint in ``folder`` towards ``source`` on ``data``, writing the result to ``out``
    (``folder`` itself with ``force``); return what was done, also written to ``out/mlaconv.json`` as ``heal``.
    ``observe``: ``distill.train``'s."""
    started = time.perf_counter()
    check_options(options)
    folder, out = Path(folder), Path(out)
    report = _converted_report(folder)
    source_folder, spec, reader = load_source(source)
    reader.close()
    if out.resolve() != folder.resolve():
        check_output_target(out, folder, force)
    elif not force:
        raise MlaconvError(f"healing {folder} in place replaces it: pass --force, or --out NEW for a new folder")
    _check_pair(folder, spec)
    options = replace(options, position_span=default_position_span(options.position_span, options.window,
                                                                    spec.max_position_embeddings))
    windows = split_data(source_folder, spec, data, options)
    with atomic_output_dir(out, force=force) as tmp:
        result = heal_folder(folder, tmp, source_folder, windows, options, report.kv_lora_rank,
                             report.latent_norm.delta or DEFAULT_DELTA, progress, observe)
        result.seconds = round(time.perf_counter() - started, 1)
        _update_report(tmp, out, source_folder, spec, report, result)
    return result


def chunks(windows: torch.Tensor, length: int) -> torch.Tensor:
    """[N, W] windows cut into [N·(W // length), length] (what is left of each window dropped)."""
    per = windows.shape[1] // length
    return windows[:, : per * length].reshape(-1, length)


def trained_windows(data: int, written: int, needed: int, seed: int) -> tuple[list[int], int]:
    """Which of ``data`` windows of the calibration data train, and how many of ``written`` windows the source writes,
    when the steps use ``needed`` windows: all of both when they hold no more; else the same shares of ``needed``,
    the data's windows drawn at random (``seed``), so a small budget still trains on both kinds and writes no more
    than it trains on."""
    if data + written <= needed:
        return list(range(data)), written
    written = round(needed * written / (data + written))
    drawn = torch.randperm(data, generator=torch.Generator().manual_seed(seed))[: needed - written]
    return sorted(drawn.tolist()), written


def training_work(steps: int, window: int, select_tokens: int, held_tokens: int, options: HealOptions,
                  recompute: bool) -> float:
    """What is left once the source's targets are computed, in source forward tokens: the steps (STEP_COST each
    training token; a fraction of it in bfloat16, and one forward token more where layers are recomputed), a
    measurement of the select windows at the start and at every check, and the held-out figures after (the model and
    the source)."""
    step_cost = STEP_COST * (BFLOAT16_STEP_SHARE if options.precision == "bfloat16" else 1.0) + recompute
    checks = 1 + -(-steps // options.check_every)
    return steps * options.batch * window * step_cost + checks * select_tokens + 2 * held_tokens


def heal_folder(folder: Path, into: Path, source: Path, data: HealData, options: HealOptions, rank: int,
                delta: float, progress: Progress = no_progress, observe: Observer | None = None) -> HealReport:
    """Heal the converted checkpoint in ``folder`` (latent rank ``rank``, tiny-latent bound ``delta``) towards
    ``source`` into the folder ``into`` (``folder`` itself: its shards rewritten in place), on ``data``'s windows cut
    into ``options.window``-token chunks (shorter when its windows are), spread over ``options.position_span``
    positions as the caller resolved it (``default_position_span``; None or 0: none)."""
    started = time.perf_counter()
    options = replace(options, precision=default_precision(options))
    window = min(options.window, data.windows.shape[1])
    train_pool, select, held = (chunks(data.windows[ids], window) for ids in (data.train, data.select, data.held_out))
    teacher = load_causal_lm(source, torch.float32, device=options.device)
    parameters = sum(p.numel() for p in teacher.parameters())
    # the written windows join what the steps draw from, not the budget: its passes count the data's windows alone
    tokens = options.tokens or default_tokens(options, parameters, window, train_pool.shape[0])
    steps = max(1, tokens // (options.batch * window))
    kept, written = trained_windows(train_pool.shape[0], -(-default_written(options, train_pool.numel()) // window),
                                    steps * options.batch, options.seed)
    train_pool = train_pool[kept]
    if written:
        train_pool = torch.cat([train_pool, written_windows(teacher, written, window, options.seed,
                                                            teacher.config.bos_token_id, progress, options.precision)])
    train_ids = list(range(train_pool.shape[0]))  # drawn epoch after epoch when the steps need more
    timed = time.perf_counter()
    # in float32 whatever healing computes in: the select windows choose the step, and a model that is already exact
    # must not be moved towards the rounding of bfloat16 targets
    select_targets = teacher_targets(teacher, select, options.top_k, progress, "source on the select windows")
    seconds_per_token = (time.perf_counter() - timed) / select.numel()
    positions = None if not options.position_span else skipped_positions(
        len(train_ids), window, options.position_span, options.seed)
    train_targets = teacher_targets(teacher, train_pool[train_ids], options.top_k, progress,
                                    "source on the training windows", positions, options.precision)
    del teacher

    before = _held_out_figures(folder, source, held, progress)
    model = load_causal_lm(folder, torch.float32, device=options.device)
    activations = activation_bytes(model.config, window)
    recompute = activations > RECOMPUTE_SHARE * free_memory_bytes(options.device)
    spent = time.perf_counter() - started
    left = seconds_per_token * training_work(steps, window, select.numel(), held.numel(), options, recompute)
    estimate = spent + left
    memory = f"; layers recomputed, a window's activations ~{activations / 2**30:.0f} GiB" if recompute else ""
    label = (f"healing: {steps} steps of {options.batch} × {window} tokens "
             f"(~{left / 60:.0f} min more, ~{estimate / 60:.0f} in all, by this machine's speed{memory})")
    state, training = train(model, train_pool[train_ids], train_targets, select, select_targets, steps, options,
                            progress, label, observe, recompute)
    del model
    if training.best_step == 0:
        state = {}  # no step did better on the select windows: the model is written as it was
    state, bound, rescaled = _tiny_latent(folder, rank, delta, state)
    _rewrite(folder, into, state)
    after = _held_out_figures(into, source, held, progress)
    return HealReport(
        source=str(source), calibration_data=data.description, window=window, batch=options.batch, lr=options.lr,
        lr_schedule=options.schedule, position_span=options.position_span or None, precision=options.precision,
        top_k=options.top_k, device=options.device, trained=[f"self_attn.{name}" for name in TRAINED],
        tokens=steps * options.batch * window, steps=steps, best_step=training.best_step,
        data_window=data.windows.shape[1], train_windows=data.train, select_windows=data.select,
        held_out_windows=data.held_out, written_windows=written, recompute=recompute,
        select_kl_before=training.select_before,
        select_kl_after=training.select_after, curve=[list(point) for point in training.curve],
        held_out_before=before, held_out_after=after, latent_bound=bound, rescaled_layers=rescaled,
        estimated_seconds=round(estimate, 1), seconds=round(time.perf_counter() - started, 1))


def _converted_report(folder: Path) -> ConversionReport:
    path = folder / "mlaconv.json"
    if not (folder / "config.json").is_file() or not path.is_file():
        raise MlaconvError(f"{folder} is not a folder `mlaconv convert` wrote (no config.json and mlaconv.json)")
    return ConversionReport.from_json(json.loads(path.read_text()))


def _check_pair(folder: Path, spec) -> None:
    """Refuse a source that is not the converted model's: its vocabulary, layers and hidden size must match."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "deepseek_v3":
        raise MlaconvError(f"{folder} holds a {config.get('model_type')} model, not a converted DeepSeek-V3 one")
    ours = (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"])
    theirs = (spec.vocab_size, spec.num_layers, spec.hidden_size)
    if ours != theirs:
        raise MlaconvError(f"the source (vocabulary, layers, hidden) {theirs} is not the one {folder} was converted "
                           f"from {ours}")


def _held_out_figures(model: Path, source: Path, windows: torch.Tensor, progress: Progress) -> HealFigures:
    """Drift, KL and top-1 of ``model`` against ``source`` on the held-out windows (``eval perplexity``'s code)."""
    from mlaconv.evaluate.perplexity import evaluate_perplexity

    with tempfile.TemporaryDirectory() as scratch:
        ids = Path(scratch) / "held_out.jsonl"
        ids.write_text("".join(json.dumps({"input_ids": w.tolist()}) + "\n" for w in windows))
        result = evaluate_perplexity(model, source, source=TokenSource(tokens=ids), window=windows.shape[1],
                                     progress=progress)
    return HealFigures(result.drift, result.kl_per_token, result.top1_agreement, result.tokens)


def _tiny_latent(folder: Path, rank: int, delta: float, state: dict[str, torch.Tensor]):
    """Each layer's kv_a latent rows re-proved tiny (``latent_bound`` ≤ δ, as stored); where training grew them past
    it, the rows are scaled to 99% of it and kv_a_layernorm's weight up by the same factor (the same function while
    the norm is linear). Returns the state as stored, the largest bound and the layers rescaled."""
    from mlaconv.io import CheckpointReader
    from mlaconv.target.deepseek import checkpoint_layers

    reader, bounds, rescaled = CheckpointReader(folder), [], []
    for layer in checkpoint_layers(reader, json.loads((folder / "config.json").read_text())["num_hidden_layers"]):
        i, prefix = layer.index, layer.prefix
        kv_a_name, norm_name = prefix + deepseek.KV_A_PROJ, prefix + deepseek.KV_A_NORM
        gamma = reader.get(prefix + names.INPUT_NORM)
        stored = reader.dtype(kv_a_name)
        kv_a = state[kv_a_name].to(stored) if kv_a_name in state else reader.get(kv_a_name)
        bound = latent_bound(kv_a[:rank], gamma)
        if bound > delta * (1 + BOUND_SLACK):
            shrink = (0.99 * delta / bound) ** 0.5
            kv_a = state[kv_a_name].double()
            kv_a[:rank] *= shrink
            kv_a = kv_a.to(stored)
            norm = reader.get(norm_name)
            state[norm_name] = (norm.double() / shrink).to(norm.dtype)
            bound, rescaled = latent_bound(kv_a[:rank], gamma), rescaled + [i]
        if kv_a_name in state or i in rescaled:
            state[kv_a_name] = kv_a
        bounds.append(bound)
    reader.close()
    return state, max(bounds), rescaled


def _rewrite(folder: Path, into: Path, state: dict[str, torch.Tensor]) -> None:
    """``folder``'s files in ``into`` with the shards that hold a tensor of ``state`` written anew (each tensor in
    its stored dtype; every other tensor's bytes as they were). ``into`` may be ``folder`` itself: the new shards are
    then all written beside the old ones first and put in their place after (``os.replace``), so a failure while
    writing leaves the folder as it was."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    in_place = into.resolve() == folder.resolve()
    written: list[Path] = []
    try:
        for path in sorted(folder.iterdir()):
            if path.is_dir() or (in_place and path.suffix != ".safetensors"):
                continue
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as shard:
                    names, metadata = list(shard.keys()), shard.metadata()
                    changed = set(names) & set(state)
                    tensors = {name: shard.get_tensor(name) for name in names} if changed else None
                if tensors is not None:
                    for name in changed:
                        tensors[name] = state[name].to(tensors[name].dtype).contiguous()
                    written.append(into / (path.name + ".part"))
                    save_file(tensors, str(written[-1]), metadata=metadata)
                    continue
            if not in_place:
                shutil.copy2(path, into / path.name)
    except BaseException:
        for part in written:
            part.unlink(missing_ok=True)
        raise
    for part in written:
        os.replace(part, part.with_suffix(""))


def _update_report(tmp: Path, out: Path, source: Path, spec, report: ConversionReport, result: HealReport) -> None:
    """The healed folder's mlaconv.json and model card: the heal section, the built-in check rerun, the verdict
    redone; an evaluation of the model before healing is dropped (its figures are in the heal section's notes)."""
    from mlaconv.target.model_card import write_model_card
    from mlaconv.evaluate.verdict import conversion_verdict
    from mlaconv.evaluate.verify import verify

    if report.eval is not None:
        result.notes.append("the conversion's evaluation (`eval`) measured the model before healing and was "
                            "dropped from mlaconv.json: run `mlaconv eval perplexity` on the healed model")
    check = verify(source, tmp, spec) if report.verify is not None else None
    updated = replace(report, output=str(out), heal=result, verify=check, eval=None,
                      verdict=conversion_verdict(check, None))
    (tmp / "mlaconv.json").write_text(json.dumps(updated.to_json(), indent=2) + "\n")
    write_model_card(tmp, updated)
    result.verdict = updated.verdict
