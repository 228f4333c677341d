"""Limits of the contract's SamplingParams (``common.proto``) that more than one side checks:
the rollout engines, and the gateway before it starts a reply stream."""

from __future__ import annotations

__all__ = ["MIN_TEMPERATURE", "MIN_TOP_P"]

# Below this (but above 0, greedy) logits / T overflows to inf and the log-probs become NaN.
MIN_TEMPERATURE = 1e-3
# The smallest top_p the gateway takes: far above the 32-bit float's smallest positive value,
# so it never becomes 0 on the wire.
MIN_TOP_P = 1e-30
