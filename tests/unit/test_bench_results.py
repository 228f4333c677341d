"""One helper prints every benchmark's RESULT line: ``bench/results.py::result``.

A benchmark that formats the line by hand drifts from the others (a missing field, another
number format), so the source of every other bench is scanned for a hand-written one.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.paths import ROOT

BENCH = ROOT / "bench"
HAND_WRITTEN = re.compile(r"RESULT\s+bench=")
LINE = re.compile(
    r"RESULT bench=(?P<bench>\S+) value=(?P<value>\S+) unit=(?P<unit>\S+) "
    r"baseline=(?P<baseline>\S+) ratio=(?P<ratio>\S+) target=(?P<target>\S+)"
)


def _results() -> ModuleType:
    """``bench/results.py`` as a module (bench/ is a directory of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_results", BENCH / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes of a module and of its classes and functions."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                found.add(id(body[0].value))
    return found


def hand_written_results(path: Path) -> list[int]:
    """Lines of ``path`` with a string literal (f-strings included, docstrings not) that
    spells a RESULT line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                v.value
                for v in node.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docs:
                continue
            text = node.value
        else:
            continue
        if HAND_WRITTEN.search(text):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_only_results_py_spells_the_result_line() -> None:
    assert hand_written_results(BENCH / "results.py"), "the scan no longer finds the helper's line"
    offenders = {
        path.name: lines
        for path in sorted(BENCH.glob("*.py"))
        if path.name != "results.py" and (lines := hand_written_results(path))
    }
    assert not offenders, f"print RESULT lines through results.result(): {offenders}"


def test_result_prints_one_line_in_the_documented_format(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _results().result
    result("weight_sync_socket", 0.29, "s", 0.232, "1.3")
    result("algo_ppo", 0.75, "accuracy", 0.7, "none", ratio=0.05)
    result("idle", 1.0, "s", 0.0, "none")
    result("dispatch_balance_m2", 1.00012, "max_over_mean", 1.0046, "1.0", spec=".4f")
    out = capsys.readouterr().out
    assert out.endswith("\n")
    lines = out.splitlines()
    assert lines == [
        "RESULT bench=weight_sync_socket value=0.29 unit=s baseline=0.232 ratio=1.25 target=1.3",
        "RESULT bench=algo_ppo value=0.75 unit=accuracy baseline=0.7 ratio=0.05 target=none",
        "RESULT bench=idle value=1 unit=s baseline=0 ratio=nan target=none",
        "RESULT bench=dispatch_balance_m2 value=1.0001 unit=max_over_mean baseline=1.0046 "
        "ratio=0.9955 target=1.0",
    ]
    ratios = []
    for line in lines:
        fields = LINE.fullmatch(line)
        assert fields is not None, line
        assert all(isinstance(float(fields[k]), float) for k in ("value", "baseline", "ratio"))
        ratios.append(float(fields["ratio"]))
    assert math.isnan(ratios[2])


# --- the record of runs and the benchmarks page -----------------------------------------------

RECORD_KEYS = {
    "bench",
    "value",
    "unit",
    "baseline",
    "ratio",
    "target",
    "commit",
    "date",
    "machine",
    "command",
    "load",
}


def test_result_records_nothing_unless_asked(monkeypatch, tmp_path, capsys) -> None:
    results = _results()
    target = tmp_path / "results.jsonl"
    monkeypatch.setenv("AREAL_BENCH_RESULTS", str(target))
    monkeypatch.delenv("AREAL_BENCH_RECORD", raising=False)
    results.result("idle", 1.0, "s", 2.0, "none")
    monkeypatch.setenv("AREAL_BENCH_RECORD", "0")
    results.result("idle", 1.0, "s", 2.0, "none")
    assert capsys.readouterr().out.count("RESULT bench=idle") == 2
    assert not target.exists()


def test_result_appends_each_line_with_commit_date_and_machine(
    monkeypatch, tmp_path, capsys
) -> None:
    results = _results()
    target = tmp_path / "results.jsonl"
    monkeypatch.setenv("AREAL_BENCH_RESULTS", str(target))
    monkeypatch.setenv("AREAL_BENCH_RECORD", "1")
    results.result("weight_sync_socket", 0.29, "s", 0.232, "1.3")
    results.result("idle", 1.0, "s", 0.0, "none")
    printed = capsys.readouterr().out.splitlines()
    lines = target.read_text().splitlines()
    assert len(lines) == len(printed) == 2
    first, second = (json.loads(line) for line in lines)
    assert set(first) == set(second) == RECORD_KEYS
    # The figures the RESULT line printed, at full precision.
    assert first["bench"] == "weight_sync_socket" and first["value"] == 0.29
    assert first["baseline"] == 0.232 and first["ratio"] == pytest.approx(0.29 / 0.232)
    assert first["target"] == "1.3" and first["unit"] == "s"
    # JSON has no NaN: a ratio over a zero baseline is null.
    assert second["ratio"] is None
    assert re.fullmatch(r"[0-9a-f]{12}(\+changes)?|unknown", first["commit"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", first["date"])
    assert "cores" in first["machine"]
    assert first["command"].startswith("python ")
    assert first["load"] is None or first["load"] >= 0


def entry(bench: str, value: float, date: str, **extra: Any) -> dict[str, Any]:
    return {
        "bench": bench,
        "value": value,
        "unit": "s",
        "baseline": 1.0,
        "ratio": value,
        "target": "none",
        "commit": "abc123",
        "date": date,
        "machine": "cpu A, 2 cores",
        "command": "python x.py",
        "load": 1.5,
        **extra,
    }


def test_the_page_shows_the_latest_of_each_bench_and_its_history_newest_first() -> None:
    results = _results()
    page = results.markdown(
        [
            entry("b_bench", 3.0, "2026-01-03T00:00:00Z", machine="cpu B | 16 cores"),
            entry("a_bench", 1.0, "2026-01-01T00:00:00Z"),
            entry("b_bench", 2.0, "2026-01-02T00:00:00Z"),
            entry("a_bench", 0.5, "2026-01-05T00:00:00Z", ratio=None),
        ]
    )
    latest = page.split("## Latest", 1)[1].split("## History", 1)[0]
    rows = [line for line in latest.splitlines() if line.startswith("| [`")]
    assert rows == [
        "| [`a_bench`](#bench-a-bench) | 0.5 | s | 1 | n/a | `none` | 2026-01-05 | `abc123` |",
        "| [`b_bench`](#bench-b-bench) | 3 | s | 1 | 3 | `none` | 2026-01-03 | `abc123` |",
    ]
    history = page.split("## History", 1)[1]
    b = history.split("### `b_bench`", 1)[1].split("## Machines", 1)[0]
    values = [line.split(" | ")[0] for line in b.splitlines() if line.startswith("| ")][1:]
    assert values == ["| 3", "| 2"]
    # Each run names its machine (by number), the load average and the command.
    assert "| 1 | 1.5 | `python x.py` |" in b
    # Machines are listed once each and referenced by number; a | in text is escaped.
    assert "1. cpu A, 2 cores" in page and "2. cpu B \\| 16 cores" in page
    assert '<a id="bench-a-bench"></a>' in page and '<a id="bench-b-bench"></a>' in page
    assert results.markdown([]).endswith("No runs recorded yet.\n")


def test_the_committed_page_is_what_the_recorded_results_generate() -> None:
    results = _results()
    recorded = results.load(BENCH / "results.jsonl")
    assert recorded, "bench/results.jsonl holds no runs"
    for line in recorded:
        # The load average came later: the first lines have none.
        assert RECORD_KEYS - {"load"} <= set(line) <= RECORD_KEYS, line
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page == results.markdown(recorded), "run ./scripts/gen-docs"
