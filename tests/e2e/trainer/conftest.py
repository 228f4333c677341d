"""Fixtures of the trainer tests (helpers in tests/support/trainer.py, imported when a test
asks: this conftest imports no torch)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def make_batch() -> Callable[..., dict]:
    """``make_batch(n_groups=4, group_size=2, seed=0)`` -> a padded trajectory batch."""
    from tests.support.trainer import random_batch

    return random_batch
