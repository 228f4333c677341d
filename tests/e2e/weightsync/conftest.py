"""Fixtures of the weight-sync tests (helpers in tests/support/weightsync.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.weightsync import (
    MakeRollout,
    Trainers,
    rollout_factory,
    start_trainers,
    stop_trainers,
)


@pytest.fixture(scope="session")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    """Two ``areal-trainer`` rank processes (FSDP2 over gloo, builtin:micro), shared by the
    directory, publishing DISK versions under ``weights_root``."""
    t = start_trainers(tmp_path_factory.mktemp("trainers"))
    yield t
    stop_trainers(t)


@pytest.fixture
def make_rollout() -> Iterator[MakeRollout]:
    """Starts rollout servers on loopback (see ``rollout_factory``); stopped after the test."""
    with rollout_factory() as make:
        yield make
