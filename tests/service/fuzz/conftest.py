"""Fixtures of the fuzz tests (their shared pieces: tests/support/fuzz.py)."""

from __future__ import annotations

import gc
from collections.abc import Generator
from typing import Any

import pytest

from tests.support.fuzz import Tally


@pytest.fixture(scope="module")
def tally() -> Any:
    """A tally per test module, printed (pytest -s) when the module's tests are done."""
    t = Tally()
    yield t
    print(t.report())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None]:
    """Formats reports with the garbage collector off.

    CPython 3.11.7 can fail ``ast.parse`` (which pytest runs to show traceback source) with
    "SystemError: AST constructor recursion depth mismatch" when a collection runs finalizers
    in the middle of it; the grpc objects these tests leave behind made that happen now and
    then, as a pytest INTERNALERROR.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
