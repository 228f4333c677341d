"""Seconds as ``google.protobuf.Duration`` and back (the contract's durations)."""

from __future__ import annotations

from google.protobuf import duration_pb2

__all__ = ["duration", "seconds"]


def duration(seconds_: float) -> duration_pb2.Duration:
    """``seconds_`` (a float) as a Duration, to the nanosecond."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds_ * 1e9))
    return d


def seconds(d: duration_pb2.Duration) -> float:
    """A Duration in seconds."""
    return d.ToNanoseconds() / 1e9
