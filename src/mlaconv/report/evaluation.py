"""``EvalReport`` and ``RetrievalReport``: what ``mlaconv.evaluate_perplexity`` and ``mlaconv.evaluate_retrieval``
return."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaconv.report.record import Record, optional


@dataclass
class PositionBucket(Record):
    """The figures over the predictions made at positions start ≤ t < end of each window (docs/report.md,
    "eval.by_position[]"); the comparison keys are written only with a baseline."""

    start: int
    end: int
    predictions: int
    ppl: float
    baseline_ppl: float | None = optional()
    drift: float | None = optional("baseline_ppl")
    drift_stderr: float | None = optional("baseline_ppl")
    kl: float | None = optional("baseline_ppl")
    top1: float | None = optional("baseline_ppl")


@dataclass
class EvalReport(Record):
    """What ``mlaconv.evaluate_perplexity`` returns (docs/report.md, "eval"); the ``baseline_*`` and comparison
    keys are written only with a baseline, ``by_position`` only with position buckets."""

    model: str
    baseline: str | None
    data: str
    tokenizer: str | None
    window: int
    windows: int
    tokens: int
    stream_tokens: int
    dropped_tokens: int
    dtype: str
    device: str
    engine: str
    engine_differences: list[str]
    ppl: float
    ppl_stderr: float | None
    nll: float
    nll_stderr: float | None
    baseline_ppl: float | None = optional("baseline")
    baseline_ppl_stderr: float | None = optional("baseline")
    baseline_nll: float | None = optional("baseline")
    baseline_nll_stderr: float | None = optional("baseline")
    drift: float | None = optional("baseline")
    drift_stderr: float | None = optional("baseline")
    nll_diff: float | None = optional("baseline")
    nll_diff_stderr: float | None = optional("baseline")
    kl_per_token: float | None = optional("baseline")
    top1_agreement: float | None = optional("baseline")
    kv_elements_per_token: dict[str, int] = field(kw_only=True)  # by role: model, baseline
    kv_bytes_per_token: dict[str, int] = field(kw_only=True)
    kv_kept: float | None = optional("baseline")
    by_position: list[PositionBucket] = optional()  # None (left out) without position buckets
    notes: list[str] = field(kw_only=True)
    seconds: float = field(kw_only=True)


@dataclass
class RetrievalCase(Record):
    """One passkey prompt and each model's answer (docs/report.md, "retrieval.lengths[].cases[]")."""

    depth: float
    key: int
    prompt_tokens: int
    answer: str
    correct: bool
    baseline_answer: str | None = optional()
    baseline_correct: bool | None = optional("baseline_answer")


@dataclass
class DepthBucket(Record):
    """Accuracy over the prompts whose needle lies at depths start ≤ depth < end (docs/report.md,
    "retrieval.lengths[].by_depth[]")."""

    start: float
    end: float
    trials: int
    accuracy: float
    baseline_accuracy: float | None = optional()


@dataclass
class RetrievalLength(Record):
    """The prompts of one length (docs/report.md, "retrieval.lengths[]")."""

    length: int
    prompt_tokens: list[int]  # [fewest, most]
    accuracy: float
    baseline_accuracy: float | None = optional()
    by_depth: list[DepthBucket] = field(kw_only=True)
    cases: list[RetrievalCase] = field(kw_only=True)


@dataclass
class RetrievalReport(Record):
    """What ``mlaconv.evaluate_retrieval`` returns (docs/report.md, "retrieval"); the ``baseline_*`` keys are
    written only with a baseline."""

    task: str
    model: str
    baseline: str | None
    tokenizer: str
    seed: int
    trials: int
    new_tokens: int
    dtype: str
    device: str
    accuracy: float
    baseline_accuracy: float | None = optional("baseline")
    lengths: list[RetrievalLength] = field(kw_only=True)
    seconds: float = field(kw_only=True)
