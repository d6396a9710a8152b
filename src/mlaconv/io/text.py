"""Reading evaluation and calibration inputs: UTF-8 text files, token-id JSONL files and Hugging Face datasets."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlaconv.errors import MlaconvError

WIKITEXT = ("wikitext", "wikitext-2-raw-v1", "test")  # what plain ``--dataset wikitext`` means
DEFAULT_SPLIT = "test"


def read_text(path: Path) -> str:
    if not path.is_file():
        raise MlaconvError(f"no such text file: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MlaconvError(f"{path} is not UTF-8 text: {exc}") from None


def read_token_lines(path: Path) -> list[torch.Tensor]:
    """One [length] int64 tensor per non-blank ``{"input_ids": [...]}`` line."""
    if not path.is_file():
        raise MlaconvError(f"no such token file: {path}")
    sequences = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
                if not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise ValueError
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise MlaconvError(f"{path} line {number}: expected {{\"input_ids\": [non-negative integers]}}") from None
            sequences.append(torch.tensor(ids, dtype=torch.long))
    if not any(len(ids) for ids in sequences):
        raise MlaconvError(f"{path} holds no token ids: there is nothing to evaluate on")
    return sequences


def parse_dataset(spec: str, default_split: str = DEFAULT_SPLIT) -> tuple[str, str | None, str]:
    """``NAME[:CONFIG[:SPLIT]]`` → (name, config, split); plain ``wikitext`` is WikiText-2 raw."""
    if spec == WIKITEXT[0]:
        return WIKITEXT[0], WIKITEXT[1], default_split
    name, config, split = (spec.split(":") + [None, None])[:3]
    if not name or spec.count(":") > 2:
        raise MlaconvError(f"dataset {spec!r}: expected NAME[:CONFIG[:SPLIT]], e.g. wikitext:wikitext-2-raw-v1:test")
    return name, config or None, split or default_split


def load_dataset_text(spec: str, default_split: str = DEFAULT_SPLIT) -> str:
    """The dataset's ``text`` column joined with blank lines, as the GPTQ protocol does for WikiText-2."""
    name, config, split = parse_dataset(spec, default_split)
    try:
        import datasets
    except ImportError:
        raise MlaconvError("--dataset needs the `datasets` library: pip install 'mlaconv[datasets]'") from None
    datasets.disable_progress_bars()
    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # datasets raises many types; offline, "not cached" is the usual one
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MlaconvError(f"cannot load dataset {name} (config {config}, split {split}): {reason} "
                           "(without network, set HF_HUB_OFFLINE=1 and have it in the local Hugging Face datasets "
                           "cache, or pass --text FILE)") from None
    if "text" not in data.column_names:
        raise MlaconvError(f"dataset {name} has no 'text' column (columns: {', '.join(data.column_names)})")
    return "\n\n".join(data["text"])
