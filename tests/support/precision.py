"""Tolerances of bf16 compute, from its arithmetic."""

from __future__ import annotations

# bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-8 of it.
BF16_EPS = 2.0**-8
# float32 rounding of log-probs |logp| < 20 (the test models'): what an fp32 forward is off by.
FP32_GAP = 1e-5


def bf16_logprob_tol(max_logit: float) -> float:
    """How far a log-prob from bf16 logits may be from another computation's: each logit is
    off by a few (4) bf16 roundings of the largest one, and a log-prob moves by at most twice
    the largest logit change."""
    return 2 * 4 * BF16_EPS * max_logit
