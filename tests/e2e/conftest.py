"""Fixtures of the e2e tier (subprocess meshes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.otlp import OtlpCollector, serve_otlp_collector


@pytest.fixture
def otlp_collector() -> Iterator[OtlpCollector]:
    """An :class:`OtlpCollector` served on a free loopback port for the test."""
    with serve_otlp_collector() as collector:
        yield collector
