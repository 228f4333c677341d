"""Fixtures of the system tier: what vLLM, SGLang and the Node tests need from this machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import ROOT


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skips (or, with AREAL_REQUIRE_VLLM=1 as CI sets, fails) where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is not None:
        return
    message = "vLLM is not installed (./scripts/setup --vllm installs its CPU build)"
    if os.environ.get("AREAL_REQUIRE_VLLM"):
        pytest.fail(message + ", and AREAL_REQUIRE_VLLM is set")
    pytest.skip(message)


@pytest.fixture(scope="session")
def sglang_installed() -> None:
    """Skips (or, with AREAL_REQUIRE_SGLANG=1 as CI sets, fails) where SGLang's venv is not
    installed."""
    from areal_servers.rollout.sglang_server import sglang_python

    from areal_grpc.config import SglangSettings
    from areal_grpc.errors import FieldError

    try:
        sglang_python(SglangSettings())
        return
    except FieldError as exc:
        message = f"SGLang is not installed ({exc})"
    if os.environ.get("AREAL_REQUIRE_SGLANG"):
        pytest.fail(message + ", and AREAL_REQUIRE_SGLANG is set")
    pytest.skip(message)


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """The repository's node_modules (``npm ci`` from package-lock.json once, when a package
    the Node tests use is missing)."""
    if not all((ROOT / "node_modules" / p).exists() for p in (".bin/tsc", "openai")):
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=ROOT,
            check=True,
            timeout=300,
        )
    return ROOT / "node_modules"
