"""The RESULT line every benchmark ends with (README.md, "Status"), in one place."""

from __future__ import annotations


def result(
    bench: str,
    value: float,
    unit: str,
    baseline: float,
    target: str,
    *,
    ratio: float | None = None,
    spec: str = ".4g",
) -> None:
    """``RESULT bench=... value=... unit=... baseline=... ratio=... target=...``.

    ``ratio`` defaults to value / baseline; a case that compares otherwise (a gain in
    accuracy: value - baseline) passes its own. ``target`` is printed as given (``"none"``
    where a case gates nothing). ``spec`` formats value, baseline and ratio (a case whose
    figures differ in the fourth decimal, such as max/mean ratios near 1, passes ``".4f"``).
    """
    if ratio is None:
        ratio = value / baseline if baseline else float("nan")
    print(
        f"RESULT bench={bench} value={value:{spec}} unit={unit} baseline={baseline:{spec}} "
        f"ratio={ratio:{spec}} target={target}",
        flush=True,
    )
