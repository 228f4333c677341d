"""The RESULT line every benchmark ends with (DEVELOPERS.md), in one place."""

from __future__ import annotations


def result(
    bench: str,
    value: float,
    unit: str,
    baseline: float,
    target: str,
    *,
    ratio: float | None = None,
) -> None:
    """``RESULT bench=... value=... unit=... baseline=... ratio=... target=...``.

    ``ratio`` defaults to value / baseline; a case that compares otherwise (a gain in
    accuracy: value - baseline) passes its own.
    """
    if ratio is None:
        ratio = value / baseline if baseline else float("nan")
    print(
        f"RESULT bench={bench} value={value:.4g} unit={unit} baseline={baseline:.4g} "
        f"ratio={ratio:.4g} target={target}",
        flush=True,
    )
