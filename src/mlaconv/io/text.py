"""Reading evaluation and calibration inputs: UTF-8 text files, token-id JSONL files and Hugging Face datasets,
and turning an evaluation source into the ids and windows ``mlaconv.evaluate.perplexity`` scores."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from mlaconv.errors import MlaconvError
from mlaconv.io.models import load_tokenizer

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


@dataclass(frozen=True)
class TokenSource:
    """Where the evaluation ids come from: exactly one of a text file, a dataset, or JSON lines of ids.

    ``dataset`` is ``NAME[:CONFIG[:SPLIT]]`` for ``datasets.load_dataset`` (split ``test`` by default);
    plain ``wikitext`` means WikiText-2 raw, test split.
    """

    text: Path | None = None
    dataset: str | None = None
    tokens: Path | None = None

    def __post_init__(self) -> None:
        for name in ("text", "tokens"):  # a str path is a path (frozen: set through object)
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, Path(getattr(self, name)))
        given = [name for name in ("text", "dataset", "tokens") if getattr(self, name) is not None]
        if len(given) != 1:
            raise MlaconvError("give exactly one of --text FILE, --dataset NAME or --tokens FILE.jsonl"
                               + (f" (got {', '.join('--' + name for name in given)})" if given else ""))

    def describe(self) -> str:
        if self.dataset is not None:
            name, config, split = parse_dataset(self.dataset)
            return f"dataset {name}{':' + config if config else ''}, split {split}"
        return f"text {self.text}" if self.text is not None else f"token ids {self.tokens}"


@dataclass
class EvalTokens:
    """Token ids to evaluate on: one sequence per text stream or per JSON line (each [length] int64)."""

    sequences: list[torch.Tensor]
    source: str
    tokenizer: str | None  # "Class from folder", or None for pre-tokenized ids
    short_sequences_are_windows: bool  # pre-tokenized lines shorter than the window are scored whole


def load_eval_tokens(source: TokenSource, tokenizer_folders: Sequence[Path]) -> EvalTokens:
    """Read ``source`` into ids; text is tokenized once with the first folder's tokenizer that exists.

    Text goes through ``tokenizer(text)`` with its default special tokens, as GPTQ's loader does (for
    Llama that is one BOS at the start of the stream, none per window).
    """
    if source.tokens is not None:
        return EvalTokens(read_token_lines(source.tokens), source.describe(), None, short_sequences_are_windows=True)
    text = read_text(source.text) if source.text is not None else load_dataset_text(source.dataset)
    if not text.strip():
        raise MlaconvError(f"{source.describe()} is empty: there is nothing to evaluate on")
    for folder in tokenizer_folders:
        tokenizer = load_tokenizer(folder)
        if tokenizer is not None:
            ids = tokenizer(text, verbose=False)["input_ids"]
            return EvalTokens([torch.tensor(ids, dtype=torch.long)], source.describe(),
                              f"{type(tokenizer).__name__} from {folder}", short_sequences_are_windows=False)
    names = " nor ".join(str(folder) for folder in tokenizer_folders)
    raise MlaconvError(f"{names} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json) to turn text into "
                       "ids; evaluate on pre-tokenized ids instead (--tokens FILE.jsonl)")


def cut_windows(sequences: Sequence[torch.Tensor], window: int, keep_short: bool = False) -> list[torch.Tensor]:
    """Non-overlapping windows, in order: ``len // window`` full windows per sequence, remainder dropped;
    with ``keep_short``, a sequence shorter than ``window`` (but at least 2 tokens) is one window of its own.

    sequences: each [length] int64. Returns views, each [window] (or [length] for a short sequence).
    """
    windows: list[torch.Tensor] = []
    for ids in sequences:
        if len(ids) >= window:
            windows.extend(ids[: len(ids) // window * window].split(window))
        elif keep_short and len(ids) >= 2:
            windows.append(ids)
    return windows


def token_counts(text: str, option: str) -> list[int]:
    """Comma-separated token counts, ``k`` meaning 1024 (``1k,2k,4096`` → [1024, 2048, 4096]); refused in one line."""
    counts = []
    for part in text.split(","):
        if not (match := re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", part)):
            raise MlaconvError(f"{option} {text!r}: expected token counts separated by commas, such as 1k,2k,4096")
        counts.append(int(match.group(1)) * (1024 if match.group(2) else 1))
    return counts
