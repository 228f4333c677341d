"""vLLM's CPU build as the rollout engine, for real: no fake stands in for it.

The tests skip, saying how to install it, where vLLM is not installed (the default install;
the ``vllm_installed`` fixture); CI installs it (``./scripts/setup --vllm``) and sets
``AREAL_REQUIRE_VLLM=1``, which turns that skip into a failure. Each module serves one
engine (vLLM takes 20-60 s to start here) on a real gRPC server on loopback: RolloutService
and WeightSyncService over ``VLLMEngine`` (tests/support/vllm.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.vllm import VllmServer, start_vllm_server


@pytest.fixture(scope="module")
def vllm_server(
    vllm_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A rollout server on vLLM serving the built-in tiny model, for the module (disk
    updates from under its ``disk_root``)."""
    s = start_vllm_server(disk_root=tmp_path_factory.mktemp("vllm-disk-root"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def make_vllm_server(vllm_installed: None) -> Iterator[Callable[..., VllmServer]]:
    """Starts rollout servers on vLLM (see :func:`start_vllm_server`); all closed at the end."""
    started: list[VllmServer] = []

    def make(**kw: object) -> VllmServer:
        s = start_vllm_server(**kw)  # type: ignore[arg-type]
        started.append(s)
        return s

    yield make
    for s in started:
        s.close()
