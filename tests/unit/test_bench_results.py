"""One helper prints every benchmark's RESULT line: ``bench/results.py::result``.

A benchmark that formats the line by hand drifts from the others (a missing field, another
number format), so the source of every other bench is scanned for a hand-written one.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
from pathlib import Path
from types import ModuleType

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
