"""SGLang's real server as the rollout engine (its torch-native CPU path here): no fake stands
in for it.

The tests skip, saying how to install it, where SGLang's venv is missing (the default install;
the ``sglang_installed`` fixture); CI builds it (``./scripts/setup --sglang``) and sets
``AREAL_REQUIRE_SGLANG=1``, which turns that skip into a failure. The module's tests share one
SGLang server (20-40 s to start here) behind a real gRPC server on loopback: RolloutService and
WeightSyncService over ``SGLangEngine`` (tests/support/sglang.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.sglang import SglangServer, start_sglang_server


@pytest.fixture(scope="module")
def sglang_server(
    sglang_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    """A rollout server on SGLang serving the built-in tiny model, for the module (disk
    updates from under its ``disk_root``)."""
    s = start_sglang_server(disk_root=tmp_path_factory.mktemp("sglang-disk-root"))
    yield s
    s.close()
