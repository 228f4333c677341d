"""The RESULT line every benchmark ends with, in one place; the record of past runs; and the
benchmarks page written from that record.

Every bench prints its figures through :func:`result`. With ``AREAL_BENCH_RECORD=1`` in the
environment it also appends each line, with the commit, the date and the machine, to
``bench/results.jsonl`` (``AREAL_BENCH_RESULTS=<file>`` names another file), so that the
repository keeps the history of real runs; without it nothing is written (test runs record
nothing). ``scripts/gen-docs`` renders the record as ``docs/benchmarks.md``::

    python bench/results.py markdown bench/results.jsonl docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.jsonl"
# Set to 1 (or true / yes) to append every RESULT line to the results file.
RECORD_ENV = "AREAL_BENCH_RECORD"
# Another results file than bench/results.jsonl.
FILE_ENV = "AREAL_BENCH_RESULTS"


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
    With ``AREAL_BENCH_RECORD=1`` the line is also appended to the results file
    (:func:`record`).
    """
    if ratio is None:
        ratio = value / baseline if baseline else float("nan")
    print(
        f"RESULT bench={bench} value={value:{spec}} unit={unit} baseline={baseline:{spec}} "
        f"ratio={ratio:{spec}} target={target}",
        flush=True,
    )
    if recording():
        record(
            {
                "bench": bench,
                "value": value,
                "unit": unit,
                "baseline": baseline,
                "ratio": ratio,
                "target": target,
            }
        )


# --- the record -------------------------------------------------------------------------------


def recording(env: Mapping[str, str] | None = None) -> bool:
    """Whether RESULT lines are appended to the results file (``AREAL_BENCH_RECORD``)."""
    env = os.environ if env is None else env
    return env.get(RECORD_ENV, "").strip().lower() in ("1", "true", "yes")


def results_file(env: Mapping[str, str] | None = None) -> Path:
    """The results file: ``AREAL_BENCH_RESULTS``, else ``bench/results.jsonl``."""
    env = os.environ if env is None else env
    return Path(env[FILE_ENV]) if env.get(FILE_ENV) else RESULTS


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def commit() -> str:
    """The checked-out commit (short hash), with ``+changes`` when tracked files differ from it
    (the figure then belongs to a tree no commit holds exactly); ``unknown`` outside git."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "unknown"
    # The results file itself changes with every recorded line: not a change of the tree.
    changed = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results.jsonl"
    )
    return f"{head}+changes" if changed else head


def machine() -> str:
    """The machine in words: CPU model and cores, and the GPU when torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    words = f"{cpu}, {os.cpu_count()} cores"
    # Only when the bench has imported torch already: recording must not import it.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        words += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return words


def load_average() -> float | None:
    """The machine's 1-minute load average when the line is recorded (None where the OS has
    none): on a shared machine it says how much else was running."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity: such a figure is stored as null."""
    return float(x) if math.isfinite(x) else None


def record(
    line: Mapping[str, Any],
    path: Path | None = None,
    *,
    now: dt.datetime | None = None,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Appends one RESULT line's fields, with the commit, date (UTC), machine, load average
    and command, to the results file as one JSON object; returns it."""
    when = (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)
    entry = {
        "bench": str(line["bench"]),
        "value": _finite(line["value"]),
        "unit": str(line["unit"]),
        "baseline": _finite(line["baseline"]),
        "ratio": _finite(line["ratio"]),
        "target": str(line["target"]),
        "commit": commit(),
        "date": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "load": load_average(),
        "command": shlex.join(["python", *(sys.argv if argv is None else argv)]),
    }
    path = path or results_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
    return entry


def load(path: Path) -> list[dict[str, Any]]:
    """Every recorded line of ``path``, in file order (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- the page ---------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.5g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(e: Mapping[str, Any], *, name: bool) -> str:
    cells = [f"[`{e['bench']}`](#{anchor(e['bench'])})"] if name else []
    cells += [
        _num(e["value"]),
        _cell(e["unit"]),
        _num(e["baseline"]),
        _num(e["ratio"]),
        f"`{_cell(e['target'])}`",
        e["date"][:10],
        f"`{e['commit']}`",
    ]
    return "| " + " | ".join(cells) + " |"


def anchor(bench: str) -> str:
    """The page anchor of a bench's history."""
    return "bench-" + bench.lower().replace("_", "-")


def markdown(entries: Iterable[Mapping[str, Any]]) -> str:
    """The benchmarks page: the latest run of each bench, then each bench's history (newest
    first), with the machines the runs were on."""
    by_bench: dict[str, list[Mapping[str, Any]]] = {}
    for e in sorted(entries, key=lambda e: e["date"]):  # stable: file order within a second
        by_bench.setdefault(e["bench"], []).append(e)
    out = [
        "# Benchmarks",
        "",
        "Generated from `bench/results.jsonl` by `scripts/gen-docs`; do not edit. Each line of "
        "that file is one `RESULT` line of a real run, recorded with the commit, date and "
        "machine: run a bench with `AREAL_BENCH_RECORD=1` to add its lines, then "
        "`./scripts/gen-docs`. `ratio` is value / baseline unless the bench says otherwise; "
        "`target` is the ratio the bench aims for (`none`: it gates nothing). A commit ending "
        "in `+changes` was measured on a tree with uncommitted changes; `load` is the "
        "machine's 1-minute load average when the line was recorded (above its core count, "
        "other work shared the machine and the figures are low).",
        "",
    ]
    if not by_bench:
        return "\n".join([*out, "No runs recorded yet."]) + "\n"
    machines: list[str] = []
    for runs in by_bench.values():
        for e in runs:
            if e["machine"] not in machines:
                machines.append(e["machine"])
    header = "| value | unit | baseline | ratio | target | date | commit |"
    rule = "|---|---|---|---|---|---|---|"
    out += ["## Latest", "", "| bench " + header, "|---" + rule]
    out += [_row(runs[-1], name=True) for _, runs in sorted(by_bench.items())]
    out += ["", "## History", ""]
    for bench, runs in sorted(by_bench.items()):
        out += [f'<a id="{anchor(bench)}"></a>', "", f"### `{bench}`", ""]
        out += [
            "| " + header.removeprefix("| ") + " machine | load | command |",
            rule + "---|---|---|",
        ]
        for e in reversed(runs):
            m = machines.index(e["machine"]) + 1
            # Lines recorded before the load was kept have none.
            load = _num(e.get("load"))
            out.append(_row(e, name=False) + f" {m} | {load} | `{_cell(e['command'])}` |")
        out.append("")
    out += ["## Machines", ""]
    out += [f"{i}. {_cell(m)}" for i, m in enumerate(machines, 1)]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/results.py markdown RESULTS OUT``: writes the benchmarks page."""
    parser = argparse.ArgumentParser(prog="python bench/results.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    page = sub.add_parser("markdown", help="write the benchmarks page from a results file")
    page.add_argument("results", type=Path, help="the results file (JSON lines)")
    page.add_argument("out", type=Path, help="the Markdown page to write")
    args = parser.parse_args(argv)
    args.out.write_text(markdown(load(args.results)))
    print(f"generated: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
