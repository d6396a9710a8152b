"""Synthetic passkey retrieval (Mohtashami & Jaggi, "Landmark Attention", 2023): does the model still find what it
was told thousands of tokens ago?

Each prompt is plain text (no chat template): an instruction, filler sentences, a needle sentence holding a 5-digit
key at a depth of the filler, and the question. It is tokenized as the tokenizer does by default (its BOS rule),
with the baseline's tokenizer when there is one (a converted folder may resolve to another tokenizer class), else
the model's, and fitted to each length by the number of filler sentences: the most that keep the prompt and the
answer within the length. Trial k of N puts the needle at depth (k + 0.5) / N of the filler; the keys are drawn
from the seed and the length. Both models see the very same ids, answer greedily in ``NEW_TOKENS`` tokens, and are right when
the first 5-digit number of the answer is the key.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from mlaconv.devices import DTYPES, check_device
from mlaconv.errors import MlaconvError
from mlaconv.evaluate.perplexity import resolve_models, shortest_context
from mlaconv.io.models import load_causal_lm, load_tokenizer, refuse_float16_mla
from mlaconv.progress import Progress, no_progress
from mlaconv.report.evaluation import DepthBucket, RetrievalCase, RetrievalLength, RetrievalReport

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
               "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)  # those within the models' context
NEW_TOKENS = 8  # greedy answer tokens: a 5-digit number even one digit per token, after a space
DEPTH_BUCKETS = 5  # the depths reported: [0, 0.2), [0.2, 0.4), … [0.8, 1]
KEY = re.compile(r"(?<!\d)\d{5}(?!\d)")


@dataclass
class PasskeyPrompt:
    """One prompt: the length it was fitted to, the needle's depth in the filler (0–1), the key, its ids ([tokens])."""

    length: int
    depth: float
    key: int
    ids: torch.Tensor


def passkey_text(sentences: int, depth: float, key: int) -> str:
    """The prompt with ``sentences`` filler sentences and the needle after round(depth · sentences) of them."""
    filler = [FILLER[i % len(FILLER)] for i in range(sentences)]
    at = round(depth * sentences)
    return " ".join([INSTRUCTION, *filler[:at], NEEDLE.format(key=key), *filler[at:], QUESTION])


def passkey_prompts(tokenizer, lengths: Sequence[int], trials: int, seed: int) -> list[PasskeyPrompt]:
    """``trials`` prompts per length, each at most ``length − NEW_TOKENS`` tokens, needles spread evenly in depth;
    the keys of a length depend on the seed and that length only."""
    prompts = []
    for length in lengths:
        keys = random.Random(f"passkey {seed} {length}")
        for trial in range(trials):
            depth, key = (trial + 0.5) / trials, keys.randint(10_000, 99_999)
            prompts.append(PasskeyPrompt(length, depth, key, _fit(tokenizer, length, depth, key)))
    return prompts


def answer_is_right(answer: str, key: int) -> bool:
    """Whether the first 5-digit number in ``answer`` is ``key``."""
    found = KEY.search(answer)
    return found is not None and int(found.group()) == key


def evaluate_retrieval(model: str | Path, baseline: str | Path | None = None, *, lengths: Sequence[int] | None = None,
                       trials: int = 10, seed: int = 0, dtype: str = "float32", device: str | None = None,
                       progress: Progress = no_progress) -> RetrievalReport:
    """Passkey accuracy of ``model`` (and ``baseline``, on the same prompts) at each of ``lengths`` tokens.

    ``lengths`` defaults to those of 1k, 2k, 4k and 8k within the models' context (1k at least); lengths over
    the context are refused; float16 is refused for an MLA checkpoint, as in
    ``evaluate_perplexity``. The models run one after the other. The report's keys are listed in docs/report.md
    ("retrieval").
    """
    started = time.perf_counter()
    if dtype not in DTYPES:
        raise MlaconvError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    check_device(device)
    if trials < 1:
        raise MlaconvError(f"--trials must be at least 1, not {trials}")
    folders = resolve_models(model, baseline)
    for role, folder in folders.folders().items():
        refuse_float16_mla(folder, folders.configs[role], DTYPES[dtype])
    context = shortest_context(folders)
    if lengths is None:
        lengths = [n for n in DEFAULT_LENGTHS if not context or n <= context] or DEFAULT_LENGTHS[:1]
    lengths = sorted(set(lengths))
    if not lengths:
        raise MlaconvError("--lengths names no length")
    if context and lengths[-1] > context:
        raise MlaconvError(f"--lengths {lengths[-1]} is longer than the models' context ({context} tokens)")

    roles = dict(reversed(folders.folders().items()))  # the baseline first: its tokenizer, and it runs first
    tokenizer, tokenizer_folder = _tokenizer(roles.values())
    prompts = passkey_prompts(tokenizer, lengths, trials, seed)
    answers = {role: _answers(load_causal_lm(folder, DTYPES[dtype], device=device), tokenizer, prompts, progress,
                              f"passkey, {role}") for role, folder in roles.items()}  # one model in memory at a time
    results = [(prompt, {role: answers[role][i] for role in roles}) for i, prompt in enumerate(prompts)]
    by_length = [_length(length, [result for result in results if result[0].length == length]) for length in lengths]
    accuracy, baseline_accuracy = _accuracies([case for length in by_length for case in length.cases])
    return RetrievalReport(
        task="passkey", model=str(folders.model), baseline=str(folders.baseline) if folders.baseline else None,
        tokenizer=f"{type(tokenizer).__name__} from {tokenizer_folder}", seed=seed, trials=trials,
        new_tokens=NEW_TOKENS, dtype=dtype, device=device or "cpu", accuracy=accuracy,
        baseline_accuracy=baseline_accuracy, lengths=by_length, seconds=round(time.perf_counter() - started, 2))


def _fit(tokenizer, length: int, depth: float, key: int) -> torch.Tensor:
    """The ids of the prompt with the most filler sentences that leaves room for the answer in ``length``."""
    def encode(sentences: int) -> list[int]:
        return tokenizer(passkey_text(sentences, depth, key), verbose=False)["input_ids"]

    budget = length - NEW_TOKENS
    if (bare := len(encode(0))) > budget:
        raise MlaconvError(f"--lengths {length} is too short: the instruction, needle and question take {bare} tokens "
                           f"and the answer {NEW_TOKENS} more")
    low, high = 0, budget  # encode(low) fits; more than `budget` sentences never do (each is a token at least)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if len(encode(middle)) <= budget else (low, middle - 1)
    return torch.tensor(encode(low), dtype=torch.long)


def _tokenizer(folders: Iterable[Path]) -> tuple[object, Path]:
    """The first folder's tokenizer that exists, and that folder."""
    folders = list(folders)
    for folder in folders:
        if (tokenizer := load_tokenizer(folder)) is not None:
            return tokenizer, folder
    raise MlaconvError(f"{' nor '.join(map(str, folders))} has no tokenizer (tokenizer.json, tokenizer.model or "
                       "vocab.json) to write the prompts with")


def _answers(model, tokenizer, prompts: list[PasskeyPrompt], progress: Progress, description: str) -> list[str]:
    """The text of each prompt's greedy answer of ``NEW_TOKENS`` tokens (less if the model ends it)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    answers = []
    with torch.inference_mode():
        for prompt in progress(prompts, description, len(prompts)):
            ids = prompt.ids[None].to(model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def _length(length: int, results: list[tuple[PasskeyPrompt, dict[str, str]]]) -> RetrievalLength:
    """One length's figures from its prompts and each role's answer to them."""
    cases = [RetrievalCase(prompt.depth, prompt.key, len(prompt.ids), answers["model"],
                           answer_is_right(answers["model"], prompt.key), answers.get("baseline"),
                           None if "baseline" not in answers else answer_is_right(answers["baseline"], prompt.key))
             for prompt, answers in results]
    by_depth = []
    for bucket in range(DEPTH_BUCKETS):
        start, end = bucket / DEPTH_BUCKETS, (bucket + 1) / DEPTH_BUCKETS
        inside = [case for case in cases if start <= case.depth < end]
        if inside:
            by_depth.append(DepthBucket(start, end, len(inside), *_accuracies(inside)))
    tokens = [case.prompt_tokens for case in cases]
    return RetrievalLength(length, [min(tokens), max(tokens)], *_accuracies(cases), by_depth=by_depth, cases=cases)


def _accuracies(cases: list[RetrievalCase]) -> tuple[float, float | None]:
    """The model's share of right answers, and the baseline's (None without one)."""
    baseline = None if cases[0].baseline_correct is None else sum(c.baseline_correct for c in cases) / len(cases)
    return sum(c.correct for c in cases) / len(cases), baseline
