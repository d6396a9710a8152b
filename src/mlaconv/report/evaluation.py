"""``EvalReport``: what ``mlaconv.evaluate_perplexity`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaconv.report.record import Record, optional


@dataclass
class EvalReport(Record):
    """What ``mlaconv.evaluate_perplexity`` returns (docs/report.md, "eval"); the ``baseline_*`` and comparison
    keys are written only with a baseline."""

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
    notes: list[str] = field(kw_only=True)
    seconds: float = field(kw_only=True)
