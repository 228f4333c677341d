"""The gateway's OpenAPI document tells the truth: schemathesis, with every check, against a
live gateway (a rollout server process, the in-process coordinator of tests/support/gateway,
the app under uvicorn with a bearer key).

Requests valid by the document must be accepted (or refused only with a status the
document gives for a reason a schema cannot express: 404 for an unknown session, 409, 429),
requests invalid by it must be refused with a 4xx, and every answer must carry a documented
status and match its schema (OpenAI's error object for errors). No answer may be a 5xx.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from areal_grpc.launch import Child
from tests.support.gateway import (
    MODEL,
    Gateway,
    ServedCoordinator,
    gateway_run,
    rollout_process,
    serve_gateway,
    start_mesh,
)
from tests.support.paths import ROOT
from tests.support.schemathesis_hooks import MODEL_ENV

pytestmark = pytest.mark.slow

API_KEY = "sk-openapi-test"
# Cases per operation and phase: enough to reach every field's bounds, within a minute or so
# on CI's two cores. The seed makes a failure reproducible (`st run ... --seed`).
MAX_EXAMPLES = 25
SEED = 20261128


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    with rollout_process(tmp_path_factory.mktemp("rollout-logs")) as child:
        yield child


@pytest.fixture(scope="module")
def mesh(rollout: Child) -> Iterator[ServedCoordinator]:
    # Room for the sessions the stateful phase opens (nothing trains, so none is freed).
    m = start_mesh(rollout.address, batch=256)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def gateway(mesh: ServedCoordinator) -> Iterator[Gateway]:
    gw = serve_gateway(gateway_run(max_tokens=8), mesh.address, api_key=API_KEY)
    yield gw
    gw.stop()


def test_schemathesis_finds_nothing_the_document_does_not_say(
    gateway: Gateway, tmp_path: Path
) -> None:
    """`st run <gateway>/openapi.json --checks all`: no failure, no server error."""
    report = tmp_path / "junit.xml"
    argv = [
        # The schemathesis CLI (`st`), a pinned dev dependency.
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{gateway.url}/openapi.json",
        "--checks",
        "all",
        "--header",
        f"Authorization: Bearer {API_KEY}",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        "--generation-database",
        "none",
        "--request-timeout",
        "60",
        "--workers",
        "1",
        "--no-color",
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks",
        MODEL_ENV: MODEL,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env, check=False
    )
    # On failure, the output names each failure's check, its request (a curl line) and the
    # answer.
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-4000:]
    junit = report.read_text()
    assert "<testcase" in junit and "<failure" not in junit and "<error" not in junit, junit


def test_a_prompt_that_fills_the_context_is_400_and_max_tokens_stops_at_the_context(
    gateway: Gateway,
) -> None:
    """What the document cannot say in a schema, and schemathesis leaves out: the context's
    bound on the prompt (400 context_length_exceeded), and max_tokens cut to the room the
    prompt leaves (the reply ends with finish_reason length)."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    full = httpx.post(
        f"{gateway.url}/v1/completions", json={"prompt": [5] * 512}, headers=auth, timeout=60
    )
    assert full.status_code == 400, full.text
    assert full.json()["error"]["code"] == "context_length_exceeded"
    assert full.json()["error"]["param"] == "prompt"
    near = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"prompt": [5] * 509, "max_tokens": 1 << 20, "return_token_ids": True},
        headers=auth,
        timeout=60,
    )
    assert near.status_code == 200, near.text
    (choice,) = near.json()["choices"]
    assert len(choice["token_ids"]) <= 3
    assert choice["finish_reason"] in ("length", "stop")
