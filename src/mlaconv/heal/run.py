"""Healing a converted folder: its windows, the source's targets, the training (``distill``), the tiny-latent bound
re-proved, and the output written atomically with its report, check, verdict and model card brought up to date.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from mlaconv import deepseek
from mlaconv.calibration_windows import load_calibration_tokens
from mlaconv.errors import MlaconvError
from mlaconv.heal.distill import (HELD_WINDOWS, STEP_COST, TRAINED, HealOptions, check_options, default_tokens,
                                  teacher_targets, train)
from mlaconv.io import atomic_output_dir, check_output_target
from mlaconv.io.text import TokenSource
from mlaconv.mla.latent_norm import DEFAULT_DELTA, latent_bound
from mlaconv.models import load_causal_lm
from mlaconv.plan import CalibrationData, load_source
from mlaconv.progress import Progress, no_progress
from mlaconv.report import ConversionReport
from mlaconv.report.conversion import HealFigures, HealReport

ALL_WINDOWS = 2**40  # ask ``load_calibration_tokens`` for every window the data holds
BOUND_SLACK = 1e-3  # a bound over δ by less than this share is the conversion's own δ in rounding, left as it is


def heal(folder: str | Path, source: str, out: str | Path, data: CalibrationData, options: HealOptions,
         force: bool = False, progress: Progress = no_progress) -> HealReport:
    """Heal the converted checkpoint in ``folder`` towards ``source`` on ``data``, writing the result to ``out``
    (``folder`` itself with ``force``); return what was done, also written to ``out/mlaconv.json`` as ``heal``."""
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
    with atomic_output_dir(out, force=force) as tmp:
        result = heal_folder(folder, tmp, source_folder, spec, data, options, report.kv_lora_rank,
                             report.latent_norm.delta or DEFAULT_DELTA, progress)
        result.seconds = round(time.perf_counter() - started, 1)
        _update_report(tmp, out, source_folder, spec, report, result)
    return result


def heal_folder(folder: Path, into: Path, source: Path, spec, data: CalibrationData, options: HealOptions, rank: int,
                delta: float, progress: Progress = no_progress, window_cap: int | None = None) -> HealReport:
    """Heal the converted checkpoint in ``folder`` (latent rank ``rank``, tiny-latent bound ``delta``) towards
    ``source`` into the folder ``into`` (``folder`` itself: its shards rewritten in place), on windows of
    ``options.window`` tokens or ``window_cap`` if shorter (a conversion's calibration window)."""
    started = time.perf_counter()
    window = min(options.window, window_cap or options.window)
    windows = load_calibration_tokens(source, spec, list(data.files), data.dataset, ALL_WINDOWS, window, options.seed)
    if windows.shape[0] < 2 * HELD_WINDOWS + 1:
        raise MlaconvError(f"the calibration data holds {windows.shape[0]} windows of {windows.shape[1]} tokens; "
                           f"healing needs at least {2 * HELD_WINDOWS + 1} (give more text or a smaller --window)")
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(options.seed)).tolist()
    select, held, pool = order[:HELD_WINDOWS], order[HELD_WINDOWS:2 * HELD_WINDOWS], order[2 * HELD_WINDOWS:]
    window = windows.shape[1]

    teacher = load_causal_lm(source, torch.float32, device=options.device)
    timed = time.perf_counter()
    select_targets = teacher_targets(teacher, windows[select], options.top_k, progress, "source on the select windows")
    seconds_per_token = (time.perf_counter() - timed) / (len(select) * window)
    tokens = options.tokens or default_tokens(options, seconds_per_token, window, len(pool))
    steps = max(1, tokens // (options.batch * window))
    train_ids = pool[: steps * options.batch]  # fewer than the steps draw: they are drawn epoch after epoch
    estimate = seconds_per_token * window * (len(train_ids) + steps * options.batch * STEP_COST)
    train_targets = teacher_targets(teacher, windows[train_ids], options.top_k, progress,
                                    "source on the training windows")
    del teacher

    before = _held_out_figures(folder, source, windows[held], progress)
    model = load_causal_lm(folder, torch.float32, device=options.device)
    label = f"healing: {steps} steps of {options.batch} × {window} tokens (~{estimate / 60:.0f} min by this machine's speed)"
    state, training = train(model, windows[train_ids], train_targets, windows[select], select_targets, steps,
                            options, progress, label)
    del model
    if training.best_step == 0:
        state = {}  # no step did better on the select windows: the model is written as it was
    state, bound, rescaled = _tiny_latent(folder, rank, delta, state)
    _rewrite(folder, into, state)
    after = _held_out_figures(into, source, windows[held], progress)
    return HealReport(
        source=str(source), calibration_data=data.description, window=window, batch=options.batch, lr=options.lr,
        top_k=options.top_k, device=options.device, trained=[f"self_attn.{name}" for name in TRAINED],
        tokens=steps * options.batch * window, steps=steps, best_step=training.best_step,
        train_windows=len(train_ids), select_windows=select, held_out_windows=held,
        select_kl_before=training.select_before, select_kl_after=training.select_after,
        curve=[list(point) for point in training.curve], held_out_before=before, held_out_after=after,
        latent_bound=bound, rescaled_layers=rescaled, estimated_seconds=round(estimate, 1),
        seconds=round(time.perf_counter() - started, 1))


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
    from mlaconv.evaluate import evaluate_perplexity

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
    from mlaconv.pipeline import checkpoint_layers

    reader, bounds, rescaled = CheckpointReader(folder), [], []
    for layer in checkpoint_layers(reader, json.loads((folder / "config.json").read_text())["num_hidden_layers"]):
        i, prefix = layer.index, layer.prefix
        kv_a_name, norm_name = prefix + deepseek.KV_A_PROJ, prefix + deepseek.KV_A_NORM
        gamma = reader.get(prefix + deepseek.INPUT_NORM)
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
    from mlaconv.model_card import write_model_card
    from mlaconv.verdict import conversion_verdict
    from mlaconv.verify import verify

    if report.eval is not None:
        result.notes.append("the conversion's evaluation (`eval`) measured the model before healing and was "
                            "dropped from mlaconv.json: run `mlaconv eval perplexity` on the healed model")
    check = verify(source, tmp, spec) if report.verify is not None else None
    updated = replace(report, output=str(out), heal=result, verify=check, eval=None,
                      verdict=conversion_verdict(check, None))
    (tmp / "mlaconv.json").write_text(json.dumps(updated.to_json(), indent=2) + "\n")
    write_model_card(tmp, updated)
    result.verdict = updated.verdict
