"""Perplexity the way the KV-compression papers measure it, side by side with the source model.

Protocol (the GPTQ lineage: Palu, ASVD, SVD-LLM, ReCalKV): tokenize the whole text once, cut the id
stream into non-overlapping windows of ``window`` tokens, drop the remainder, score each window's
``window − 1`` next-token predictions (no BOS is added per window), and report
PPL = exp(mean loss over all scored predictions).

Pre-tokenized JSON lines (``{"input_ids": [...]}``) are separate sequences: windows never cross a
line. A line at least ``window`` long is cut like a text stream (remainder dropped); a shorter line
is one window of its own length, so sequences sampled at a fixed length are scored whole.

With a baseline, both models see the very same ids (tokenized with the baseline's tokenizer when it
has one: a converted folder may resolve to another tokenizer class) and the report adds the relative
drift, KL(baseline ‖ model) and top-1 agreement per scored token, and standard errors over windows.

Position buckets split the figures by where in its window a prediction is made: the one at position t
(of token t + 1, from tokens 0..t) falls in the bucket start ≤ t < end.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from mlaconv.devices import DTYPES, check_device, free_memory_bytes
from mlaconv.errors import MlaconvError
from mlaconv.io import read_config, resolve_source
from mlaconv.io.models import load_causal_lm, parameter_bytes, refuse_float16_mla
from mlaconv.io.text import TokenSource, cut_windows, load_eval_tokens
from mlaconv.mla.layer import kv_cache_elements
from mlaconv.progress import Progress, no_progress
from mlaconv.report import EvalReport
from mlaconv.report.evaluation import PositionBucket

DEFAULT_WINDOW = 2048
# Rows × vocab of logits turned into float32 log-probabilities at once (64 MiB per model).
LOGIT_CHUNK_ELEMENTS = 2**24
# Share of the free memory both models and their logits may take before they run one after the other.
MEMORY_HEADROOM = 0.9


@dataclass
class WindowScores:
    """Per-window sums over each window's scored next-token predictions; every tensor is [windows] float64."""

    predictions: torch.Tensor
    nll: torch.Tensor
    baseline_nll: torch.Tensor | None = None
    kl: torch.Tensor | None = None  # KL(baseline ‖ model)
    top1_agreements: torch.Tensor | None = None
    by_position: dict[str, torch.Tensor] | None = None  # the same sums per position bucket, each [windows, buckets]


@dataclass
class ModelPair:
    """The folders evaluated and their parsed configs, by role ("model", "baseline")."""

    model: Path
    baseline: Path | None
    configs: dict[str, dict]

    def folders(self) -> dict[str, Path]:
        return {"model": self.model} | ({"baseline": self.baseline} if self.baseline else {})


def score_windows(model, windows: Sequence[torch.Tensor], batch_size: int = 1, baseline=None,
                  progress: Progress = no_progress, description: str = "scoring windows",
                  position_buckets: Sequence[int] | None = None) -> WindowScores:
    """Run ``model`` (and ``baseline`` on the same batch) over ``windows``; keep only per-window sums.

    Consecutive windows of equal length are batched up to ``batch_size``; only the current batch's
    logits ([batch, length, vocab] per model) are held. Log-probabilities are taken in float32 over
    row chunks and summed in float64. ``position_buckets`` (the inner boundaries, rising) adds the
    sums per bucket of positions.
    """
    n = len(windows)
    scores = WindowScores(predictions=torch.zeros(n, dtype=torch.float64), nll=torch.zeros(n, dtype=torch.float64))
    if baseline is not None:
        scores.baseline_nll, scores.kl, scores.top1_agreements = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    edges = None if position_buckets is None else torch.tensor(position_buckets)
    by_position = []  # per window: key → [buckets]
    batches = list(_batches(windows, batch_size))
    with torch.inference_mode():
        for first, ids in progress(batches, description, len(batches)):
            logits = model(ids.to(model.device), use_cache=False).logits
            baseline_logits = None if baseline is None else baseline(ids.to(baseline.device), use_cache=False).logits
            for row in range(ids.shape[0]):
                sums, window_by_position = _prediction_sums(
                    logits[row], ids[row], None if baseline_logits is None else baseline_logits[row], edges)
                by_position.append(window_by_position)
                index = first + row
                scores.predictions[index] = ids.shape[1] - 1
                scores.nll[index] = sums["nll"]
                if baseline is not None:
                    scores.baseline_nll[index] = sums["baseline_nll"]
                    scores.kl[index] = sums["kl"]
                    scores.top1_agreements[index] = sums["top1_agreements"]
            del logits, baseline_logits
    if edges is not None:
        scores.by_position = {key: torch.stack([window[key] for window in by_position]) for key in by_position[0]}
    return scores


def evaluate_perplexity(model: str | Path, baseline: str | Path | None = None, *, source: TokenSource,
                        window: int | None = None, max_windows: int | None = None, batch_size: int = 1,
                        dtype: str = "float32", device: str | None = None, device_map: str | None = None,
                        progress: Progress = no_progress, engine: str = "transformers",
                        position_buckets: Sequence[int] | None = None) -> EvalReport:
    """WikiText-style perplexity of ``model`` (and ``baseline`` on the same windows), as a report.

    ``window`` defaults to 2048 or the shortest context of the models if that is less. Both models are
    loaded together when they fit in the memory of ``device`` (or of all GPUs with ``device_map``);
    otherwise they run one after the other and KL / top-1 agreement are reported as None with a note.
    ``position_buckets`` (rising boundaries, e.g. [512, 2048]) adds the figures per bucket of positions
    in the window ([0, 512), [512, 2048), [2048, window)) as ``by_position``.

    The report's keys are listed in docs/report.md ("eval").
    """
    started = time.perf_counter()
    torch_dtype = _parse_options(window, max_windows, batch_size, dtype, device, device_map)
    from mlaconv.target import engines

    engines.engine(engine)
    folders = resolve_models(model, baseline)
    differences: list[str] = []
    notes: list[str] = []

    def load_model(folder: Path):
        loaded = load_causal_lm(folder, torch_dtype, **placement)
        if engine != "transformers" and loaded.config.model_type == "deepseek_v3":
            shape_refused = engines.view(engine, loaded.config).shape_refused  # the shape alone: no bias scan
            if shape_refused and shape_refused not in notes:
                notes.append(shape_refused)
        if engine != "transformers":
            differences.extend(engines.apply(loaded, engine))
        return loaded

    for role, folder in folders.folders().items():  # --dtype applies to both: float16 is out if either is MLA
        refuse_float16_mla(folder, folders.configs[role], torch_dtype)
    context = shortest_context(folders)
    window = window if window is not None else min(DEFAULT_WINDOW, context or DEFAULT_WINDOW)
    if context and window > context:
        raise MlaconvError(f"--window {window} is longer than the models' context ({context} tokens)")

    tokenizer_folders = [folders.baseline, folders.model] if folders.baseline else [folders.model]
    tokens = load_eval_tokens(source, tokenizer_folders)
    stream_tokens = sum(len(ids) for ids in tokens.sequences)
    windows = cut_windows(tokens.sequences, window, keep_short=tokens.short_sequences_are_windows)
    windowed_tokens = sum(len(ids) for ids in windows)
    if not windows:
        raise MlaconvError(f"{tokens.source} has {stream_tokens} tokens, not one full window of {window}; "
                           "pass a longer text or a smaller --window")
    windows = windows[:max_windows]
    _check_windows(windows, folders, position_buckets)

    placement = {"device": device, "device_map": device_map}
    if folders.baseline is None:
        scores = score_windows(load_model(folders.model), windows, batch_size, progress=progress,
                               position_buckets=position_buckets)
    else:
        scores, note = _score_pair(folders, windows, batch_size, torch_dtype, placement, progress, load_model,
                                   position_buckets)
        if note:
            notes.append(note)

    figures = _figures(scores)
    return EvalReport(
        model=str(folders.model),
        baseline=str(folders.baseline) if folders.baseline else None,
        data=tokens.source,
        tokenizer=tokens.tokenizer,
        window=window,
        windows=len(windows),
        tokens=int(scores.predictions.sum().item()),
        stream_tokens=stream_tokens,
        dropped_tokens=stream_tokens - windowed_tokens,
        dtype=dtype,
        device=f"device_map={device_map}" if device_map else device or "cpu",
        engine=engine,
        engine_differences=differences,
        **figures,
        **_kv_cache(folders, torch_dtype),
        by_position=None if position_buckets is None else _by_position(scores, [0, *position_buckets, window]),
        notes=notes,
        seconds=round(time.perf_counter() - started, 2),
    )


def _score_pair(folders: ModelPair, windows: list[torch.Tensor], batch_size: int, dtype: torch.dtype,
                placement: dict, progress: Progress, load_model,
                position_buckets: Sequence[int] | None) -> tuple[WindowScores, str | None]:
    """Both models on the same batches when they fit together; else one after the other, PPL only."""
    longest = max(len(ids) for ids in windows)
    vocab = max(int(config["vocab_size"]) for config in folders.configs.values())
    logits_bytes = 2 * batch_size * longest * vocab * 4  # both models' logits of one batch, float32 at most
    need = parameter_bytes(folders.model, dtype) + parameter_bytes(folders.baseline, dtype) + logits_bytes
    have = _free_memory(placement["device"], placement["device_map"])
    if need <= MEMORY_HEADROOM * have:
        model = load_model(folders.model)
        baseline = load_causal_lm(folders.baseline, dtype, **placement)
        return score_windows(model, windows, batch_size, baseline=baseline, progress=progress,
                             position_buckets=position_buckets), None

    baseline = load_causal_lm(folders.baseline, dtype, **placement)
    baseline_scores = score_windows(baseline, windows, batch_size, progress=progress, description="scoring baseline",
                                    position_buckets=position_buckets)
    del baseline
    model = load_model(folders.model)
    scores = score_windows(model, windows, batch_size, progress=progress, description="scoring model",
                           position_buckets=position_buckets)
    scores.baseline_nll = baseline_scores.nll
    if scores.by_position is not None:
        scores.by_position["baseline_nll"] = baseline_scores.by_position["nll"]
    note = (f"KL divergence and top-1 agreement need both models' logits at once: both models need "
            f"{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB is free, so they ran one after the other "
            "(perplexities only); use a bigger machine or --device-map auto over several GPUs")
    return scores, note


def _prediction_sums(logits: torch.Tensor, ids: torch.Tensor, baseline_logits: torch.Tensor | None,
                     edges: torch.Tensor | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
    """Sums over one window's next-token predictions: NLL of each model, KL(baseline ‖ model), top-1 matches;
    with ``edges`` (position buckets' inner boundaries, [buckets − 1]) also per bucket, each [buckets] on the CPU,
    with the count of predictions.

    logits, baseline_logits: [length, vocab] (any float dtype, any device); ids: [length] int64.
    Position t predicts ids[t + 1], so the last position is not scored.
    """
    logits, labels = logits[:-1], ids[1:].to(logits.device)
    baseline_logits = None if baseline_logits is None else baseline_logits[:-1]
    rows = max(1, LOGIT_CHUNK_ELEMENTS // logits.shape[-1])
    keys = ("nll",) if baseline_logits is None else ("nll", "baseline_nll", "kl", "top1_agreements")
    sums = {key: torch.zeros((), dtype=torch.float64, device=logits.device) for key in keys}
    bucket = None if edges is None else torch.bucketize(torch.arange(len(labels)), edges, right=True)
    by_position = None if edges is None else {key: torch.zeros(len(edges) + 1, dtype=torch.float64) for key in keys}
    for start in range(0, len(labels), rows):
        chunk = slice(start, start + rows)
        logp = torch.log_softmax(logits[chunk].float(), -1)  # [rows, vocab]
        target = labels[chunk, None]  # [rows, 1]
        per_prediction = {"nll": -logp.gather(-1, target)[:, 0]}  # each [rows]
        if baseline_logits is not None:
            base_logp = torch.log_softmax(baseline_logits[chunk].to(logits.device).float(), -1)
            per_prediction |= {"baseline_nll": -base_logp.gather(-1, target)[:, 0],
                               "kl": (base_logp.exp() * (base_logp - logp)).sum(-1),
                               "top1_agreements": base_logp.argmax(-1) == logp.argmax(-1)}
        for key, values in per_prediction.items():
            sums[key] += values.double().sum()
            if by_position is not None:
                by_position[key].index_add_(0, bucket[chunk], values.double().cpu())
    if by_position is not None:
        by_position["predictions"] = torch.bincount(bucket, minlength=len(edges) + 1).double()
    return {key: value.item() for key, value in sums.items()}, by_position


def _batches(windows: Sequence[torch.Tensor], batch_size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(index of the first window, [batch, length] ids) for runs of consecutive equal-length windows."""
    first = 0
    while first < len(windows):
        length = len(windows[first])
        end = first + 1
        while end < len(windows) and end - first < batch_size and len(windows[end]) == length:
            end += 1
        yield first, torch.stack(list(windows[first:end]))
        first = end


def _figures(scores: WindowScores) -> dict:
    """Perplexity, and with the baseline's NLL the baseline's and the comparison."""
    figures = _perplexity(scores.nll, scores.predictions, prefix="")
    if scores.baseline_nll is not None:
        figures |= _perplexity(scores.baseline_nll, scores.predictions, prefix="baseline_") | _comparison(scores)
    return figures


def _by_position(scores: WindowScores, bounds: list[int]) -> list[PositionBucket]:
    """The figures of each position bucket [bounds[i], bounds[i + 1]), from its columns of the per-window sums."""
    buckets = []
    for column, (start, end) in enumerate(zip(bounds, bounds[1:])):
        sums = {key: values[:, column] for key, values in scores.by_position.items()}
        figures = _figures(WindowScores(**sums))
        buckets.append(PositionBucket(start, end, int(sums["predictions"].sum().item()), figures["ppl"],
                                      figures.get("baseline_ppl"), figures.get("drift"), figures.get("drift_stderr"),
                                      figures.get("kl_per_token"), figures.get("top1_agreement")))
    return buckets


def _perplexity(nll: torch.Tensor, predictions: torch.Tensor, prefix: str) -> dict:
    """PPL from per-window NLL sums; the standard error is over windows, carried to PPL by the delta method."""
    mean = (nll.sum() / predictions.sum()).item()
    stderr = _ratio_stderr(nll, predictions)
    return {f"{prefix}ppl": math.exp(mean), f"{prefix}ppl_stderr": None if stderr is None else math.exp(mean) * stderr,
            f"{prefix}nll": mean, f"{prefix}nll_stderr": stderr}


def _comparison(scores: WindowScores) -> dict:
    """Drift = ppl / baseline_ppl − 1 = exp(mean NLL difference) − 1, with the paired standard error over windows."""
    difference = scores.nll - scores.baseline_nll
    total = scores.predictions.sum()
    mean_difference = (difference.sum() / total).item()
    stderr = _ratio_stderr(difference, scores.predictions)
    drift = math.expm1(mean_difference)
    measured_together = scores.kl is not None
    return {
        "drift": drift,
        "drift_stderr": None if stderr is None else (1 + drift) * stderr,
        "nll_diff": mean_difference,
        "nll_diff_stderr": stderr,
        "kl_per_token": (scores.kl.sum() / total).item() if measured_together else None,
        "top1_agreement": (scores.top1_agreements.sum() / total).item() if measured_together else None,
    }


def _ratio_stderr(sums: torch.Tensor, counts: torch.Tensor) -> float | None:
    """Standard error of sum(sums) / sum(counts) over windows (windows are the independent units).

    sums, counts: [windows]. For equal counts this is the sample standard deviation of the per-window
    means over √windows; None with a single window.
    """
    windows = len(sums)
    if windows < 2:
        return None
    mean = sums.sum() / counts.sum()
    residual = sums - mean * counts
    return (torch.sqrt(residual.square().sum() * windows / (windows - 1)) / counts.sum()).item()


def _kv_cache(folders: ModelPair, dtype: torch.dtype) -> dict:
    """KV-cache elements and bytes per token over all layers (MLA: r + R; GQA: 2·n_kv·d; per layer)."""
    elements = {role: kv_cache_elements(folders.configs[role]) * int(folders.configs[role]["num_hidden_layers"])
                for role in folders.folders()}
    kv_bytes = {role: _kv_cache_bytes_per_token(folder, dtype) for role, folder in folders.folders().items()}
    report = {"kv_elements_per_token": elements, "kv_bytes_per_token": kv_bytes}
    if folders.baseline:
        report["kv_kept"] = elements["model"] / elements["baseline"]
    return report


def _kv_cache_bytes_per_token(folder: str | Path, dtype: torch.dtype) -> int:
    """Bytes of KV cache per token over all layers, for a model folder, at ``dtype``."""
    config = json.loads((Path(folder) / "config.json").read_text())
    element = torch.empty((), dtype=dtype).element_size()
    return kv_cache_elements(config) * int(config["num_hidden_layers"]) * element


def _parse_options(window: int | None, max_windows: int | None, batch_size: int, dtype: str, device: str | None,
                   device_map: str | None) -> torch.dtype:
    if window is not None and window < 2:
        raise MlaconvError(f"--window must be at least 2 tokens (one prediction), not {window}")
    if max_windows is not None and max_windows < 1:
        raise MlaconvError(f"--max-windows must be at least 1, not {max_windows}")
    if batch_size < 1:
        raise MlaconvError(f"--batch-size must be at least 1, not {batch_size}")
    if dtype not in DTYPES:
        raise MlaconvError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if device and device_map:
        raise MlaconvError("give --device or --device-map, not both")
    check_device(device)
    return DTYPES[dtype]


def resolve_models(model: str | Path, baseline: str | Path | None) -> ModelPair:
    """The folders of ``model`` and ``baseline`` and their configs; refused if their vocabularies differ."""
    model_folder = resolve_source(str(model))
    baseline_folder = resolve_source(str(baseline)) if baseline else None
    configs = {"model": read_config(model_folder)} | ({"baseline": read_config(baseline_folder)} if baseline else {})
    folders = ModelPair(model_folder, baseline_folder, configs)
    if baseline:
        vocab = {role: int(config["vocab_size"]) for role, config in folders.configs.items()}
        if vocab["model"] != vocab["baseline"]:
            raise MlaconvError(f"the model's vocabulary ({vocab['model']}) differs from the baseline's "
                               f"({vocab['baseline']}): they cannot be compared token by token")
    return folders


def shortest_context(folders: ModelPair) -> int | None:
    """The shortest ``max_position_embeddings`` of the models, or None if none gives one."""
    contexts = [int(c["max_position_embeddings"]) for c in folders.configs.values() if c.get("max_position_embeddings")]
    return min(contexts) if contexts else None


def _check_windows(windows: Sequence[torch.Tensor], folders: ModelPair, position_buckets: Sequence[int] | None) -> None:
    """Refuse ids outside the vocabulary, and position bucket boundaries that do not rise from above 0 to the last
    position scored in the longest window."""
    vocab = min(int(config["vocab_size"]) for config in folders.configs.values())
    highest = max(int(ids.max()) for ids in windows)
    if highest >= vocab:
        raise MlaconvError(f"token id {highest} is outside the vocabulary of {vocab} ids: "
                           "the ids do not come from this model's tokenizer")
    last = max(len(ids) for ids in windows) - 2
    bounds = [0, *(position_buckets or ()), last + 1]
    if any(low >= high for low, high in zip(bounds, bounds[1:])):
        raise MlaconvError(f"--position-buckets {','.join(map(str, position_buckets))}: the boundaries must rise "
                           f"from above 0 to at most {last}, the last position scored in a window of {last + 2} tokens")


def _free_memory(device: str | None, device_map: str | None) -> int:
    """Bytes free where the models will live: one GPU, all GPUs for a device map, else host RAM."""
    if device_map and torch.cuda.is_available():
        return sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    return free_memory_bytes(device)
