"""The plain verdict on a converted model: close, degraded or broken, from its measured agreement with the source.

The thresholds are on KL(source ‖ converted) per token and top-1 agreement, the two figures every check of mlaconv
measures (the built-in check, ``--eval-*``, ``mlaconv heal``). "close" is about what a ≤ 5% perplexity drift
costs (on the bench's models a drift of +0.4–1.2% came with KL 0.005–0.011, SmolLM2-135M's +31% with KL 0.28);
"broken" is a model whose next-token distributions have little left of the source's (the weights-only SmolLM2-135M
at half its KV cache: KL 4.97, top-1 7%). The verdict uses the evaluation when one ran (more tokens, the user's
text), else the built-in check.
"""

from __future__ import annotations

from mlaconv.report import EvalReport
from mlaconv.report.conversion import Verdict, Verification
from mlaconv.report.record import Failure

CLOSE_KL = 0.05  # KL per token below this, with top-1 agreement at least CLOSE_TOP1: close
CLOSE_TOP1 = 0.90
BROKEN_KL = 1.0  # KL per token at or above this, or top-1 agreement below BROKEN_TOP1: broken
BROKEN_TOP1 = 0.40

CLOSE, DEGRADED, BROKEN, NONE = "close", "degraded", "broken", "none"
ADVICE = {
    CLOSE: "",
    DEGRADED: "measure it on your own tasks before serving; calibrating on text like yours (--calib), a larger "
              "--kv-keep or `mlaconv heal` brings it closer",
    BROKEN: "do not serve it; calibrate with --calib (text like yours) or raise --kv-keep",
}


def level(kl: float, top1: float) -> str:
    """close, degraded or broken for these figures (thresholds above)."""
    if kl >= BROKEN_KL or top1 < BROKEN_TOP1:
        return BROKEN
    if kl < CLOSE_KL and top1 >= CLOSE_TOP1:
        return CLOSE
    return DEGRADED


def message(verdict: str, kl: float | None = None, top1: float | None = None, basis: str = "") -> str:
    """One line: the verdict, the figures it rests on, and what to do."""
    if verdict == NONE:
        return f"no verdict: {basis}"
    advice = ADVICE[verdict]
    return (f"{verdict}: KL {kl:.3g} per token, top-1 agreement {top1:.1%} against the source on {basis}"
            + (f"; {advice}" if advice else ""))


def conversion_verdict(check: Verification | Failure | None, evaluation: EvalReport | Failure | None) -> Verdict:
    """The verdict on a conversion from its evaluation (when it measured KL) or else its built-in check."""
    if isinstance(evaluation, EvalReport) and evaluation.kl_per_token is not None:
        basis = f"the evaluation ({evaluation.data}, {evaluation.tokens:,} predictions)"
        return judged(evaluation.kl_per_token, evaluation.top1_agreement, basis)
    if isinstance(check, Verification) and check.kl is not None:
        return judged(check.kl, check.top1, f"the built-in check ({check.tokens:,} tokens)")
    if check is None:
        why = "the built-in check was not run (--no-verify)"
    elif isinstance(check, Failure):
        why = "the built-in check failed"
    else:
        why = f"the built-in check was skipped ({check.skipped})"
    return Verdict(NONE, why, message(NONE, basis=why))


def judged(kl: float, top1: float, basis: str) -> Verdict:
    verdict = level(kl, top1)
    return Verdict(verdict, basis, message(verdict, kl, top1, basis), kl, top1)
