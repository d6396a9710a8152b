"""Calibration windows: cut from text, a dataset or token-id files, and split into the fit, select and audit sets.

*fit* windows give the statistics and the refinement's steps, *select* windows make every choice, *audit* windows are
only measured on (``mlaconv.calibration.streamer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mlaconv.errors import MlaconvError
from mlaconv.io.models import load_tokenizer
from mlaconv.io.text import load_dataset_text, read_text, read_token_lines
from mlaconv.source.spec import SourceSpec


@dataclass(frozen=True)
class CalibrationData:
    """What a conversion calibrates on: text or token-id files and/or a dataset, and what the report says of it."""

    files: tuple[str, ...]
    dataset: str | None
    description: str


def load_calibration_tokens(source: Path, spec: SourceSpec, files: list[str], dataset: str | None,
                            tokens: int, window: int, seed: int = 0) -> torch.Tensor:
    """[B, S] calibration windows: ``tokens // window`` of the data's windows (``cut_windows``, at least one), drawn
    with a fixed seed (``drawn_windows``)."""
    windows = cut_windows(source, spec, files, dataset, window)
    return windows[drawn_windows(windows.shape[0], tokens // windows.shape[1], seed)]


def drawn_windows(count: int, wanted: int, seed: int = 0) -> torch.Tensor:
    """The indices (ascending) of ``wanted`` of ``count`` windows drawn with ``seed`` (all when fewer, one at least)."""
    wanted = max(1, min(count, wanted))
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:wanted].sort().values


def cut_windows(source: Path, spec: SourceSpec, files: list[str], dataset: str | None, window: int) -> torch.Tensor:
    """Every non-overlapping window [N, S] of the calibration data, in order: text (tokenized once with the source
    tokenizer) or token-id files.

    Text files and a Hugging Face dataset (``NAME[:CONFIG[:SPLIT]]``, train split by default) are
    joined with blank lines and tokenized once; ``.jsonl`` files hold ``{"input_ids": [...]}`` lines.
    """
    window = min(window, spec.max_position_embeddings)
    if window < 2:
        raise MlaconvError(f"--calib-window must be at least 2, got {window}")
    texts, sequences = [], []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise MlaconvError(f"calibration file not found: {name}")
        if path.suffix == ".jsonl":
            sequences.extend(read_token_lines(path))
        else:
            texts.append(read_text(path))
    if dataset:
        texts.append(load_dataset_text(dataset, default_split="train"))
    if texts:
        tokenizer = load_tokenizer(source)
        if tokenizer is None:
            raise MlaconvError(f"{source} has no tokenizer: give calibration as token ids (--calib FILE.jsonl)")
        sequences.append(torch.tensor(tokenizer("\n\n".join(texts), verbose=False)["input_ids"], dtype=torch.long))
    windows = [seq[k : k + window] for seq in sequences for k in range(0, len(seq) - window + 1, window)]
    if not windows:
        raise MlaconvError(f"the calibration data is shorter than one window of {window} tokens")
    ids = torch.stack(windows)
    if ids.max() >= spec.vocab_size:
        raise MlaconvError(f"calibration token ids fall outside the vocabulary (size {spec.vocab_size})")
    return ids


MIN_WINDOWS = 3  # one to fit, one to select, one to audit
MAX_HELD_WINDOWS = 8  # select and audit windows each, at most
SPLIT_SEED = 1


@dataclass(frozen=True)
class WindowSplit:
    """Indices into the [B, S] calibration windows of the three disjoint sets."""

    fit: tuple[int, ...]  # E[x xᵀ], the attention profile μ, the refinement's gradient steps
    select: tuple[int, ...]  # variant, (r, R) split, the refinement's best step and its acceptance
    audit: tuple[int, ...]  # measured only: the report's per-layer figures and the whole-model check
    note: str | None = None  # why the sets are small, when they are


def split_windows(count: int, seed: int = SPLIT_SEED) -> WindowSplit:
    """Split ``count`` windows at random (fixed seed): select and audit get a quarter each, at least 1 and at
    most ``MAX_HELD_WINDOWS``; fit gets the rest. Fewer than 3 windows are refused; below 16 the note says that
    select and audit rest on fewer than 4 windows each."""
    if count < MIN_WINDOWS:
        raise MlaconvError(f"calibration gives {count} window(s); at least {MIN_WINDOWS} are needed (to fit, to "
                           "select and to audit): give more --calib-tokens or a shorter --calib-window")
    held = min(MAX_HELD_WINDOWS, max(1, count // 4))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    note = None
    if held < 4:
        note = (f"only {count} calibration windows: {held} select and {held} audit, so the choices and the audited "
                "figures rest on little data (16 windows or more give 4 each)")
    return WindowSplit(fit=tuple(sorted(order[2 * held :])), select=tuple(sorted(order[:held])),
                       audit=tuple(sorted(order[held : 2 * held])), note=note)
