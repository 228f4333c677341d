"""The whole suite's set-up, kept light: nothing here imports torch or OpenTelemetry.

The tests live in four tiers, one directory each, and each test gets its tier's marker from
that directory (``-m unit``, ``-m "unit or service"``; ``./scripts/test --fast`` runs those two):

* ``unit``: no sockets, no servers, no child processes beyond a one-shot command that exits by
  itself (``git ls-files``, a ``python -c`` probe, a CLI's ``--help``);
* ``service``: servers in this process (a gRPC server on loopback, the gateway app);
* ``e2e``: subprocess meshes (``python -m areal_grpc.coordinator``, server processes,
  multi-process trainer groups);
* ``system``: Ray, Slurm, Node, the real model, vLLM and GPUs.

Shared helpers (fakes, meshes, ports) live in ``tests/support``; conftests keep fixtures.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

if TYPE_CHECKING:
    from tests.support.coordinator import CoordinatorCommand

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "service", "e2e", "system")


def pytest_configure(config: pytest.Config) -> None:
    """The suite runs on the CPU wherever it runs; ``-m gpu`` selects the GPU tests instead.

    Hiding GPUs (before anything initialises CUDA) keeps every CPU test, and every server
    process it starts, on the CPU even on a GPU machine, where "auto" devices would otherwise
    put two trainer ranks on one GPU.
    """
    if "gpu" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its tier, the first directory under ``tests/`` it lives in."""
    for item in items:
        try:
            tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test file outside tests/, named on the command line
            continue
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live under tests/{{{','.join(TIERS)}}}/")
        item.add_marker(tier)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """One torch thread per test process (CI has 2 cores), wherever torch was imported."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Runs an ``async def`` test with ``asyncio.run`` on a fresh event loop (no plugin)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    asyncio.run(pyfuncitem.obj(**kwargs))
    return True


@pytest.fixture
def coordinator_command() -> Iterator[CoordinatorCommand]:
    """A :class:`~tests.support.coordinator.CoordinatorCommand`; no run it started outlives
    the test."""
    from tests.support.coordinator import CoordinatorCommand

    command = CoordinatorCommand()
    try:
        yield command
    finally:
        command.close()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA and certificates (see :func:`tests.support.pki.make_pki`), read-only."""
    from tests.support.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
