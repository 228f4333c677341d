"""Fixtures of the weight-sync tests (helpers in tests/support/weightsync.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.weightsync import MakeRollout, rollout_factory


@pytest.fixture
def make_rollout() -> Iterator[MakeRollout]:
    """Starts rollout servers on loopback (see ``rollout_factory``); stopped after the test."""
    with rollout_factory() as make:
        yield make
