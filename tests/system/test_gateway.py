"""The gateway driven from Node by the official ``openai`` npm package (pinned in
package.json): a rollout server process (builtin:micro), an in-process CoordinatorService over
a WorkPool with that server registered, and the gateway app served by uvicorn (the Python
client's tests: tests/e2e/test_gateway.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_grpc.launch import Child
from tests.support.gateway import (
    Gateway,
    ServedCoordinator,
    gateway_run,
    rollout_process,
    serve_gateway,
    start_mesh,
)
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    with rollout_process(tmp_path_factory.mktemp("rollout-logs")) as child:
        yield child


@pytest.fixture(scope="module")
def mesh(rollout: Child) -> Iterator[ServedCoordinator]:
    m = start_mesh(rollout.address, batch=64)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def gateway(mesh: ServedCoordinator) -> Iterator[Gateway]:
    gw = serve_gateway(gateway_run(max_tokens=8), mesh.address)
    yield gw
    gw.stop()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not on PATH (Node.js 20+)")
def test_the_openai_npm_client_from_node(
    gateway: Gateway, mesh: ServedCoordinator, node_modules: Path
) -> None:
    """The official ``openai`` npm package (pinned in package.json) in Node: a session with a
    plain and a streamed turn, a 400 naming its field, and an accepted reward."""
    proc = subprocess.run(
        ["node", str(ROOT / "tests/node/openai_gateway.mjs"), gateway.url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["finish_reason"] in ("stop", "length")
    assert out["chunks"] >= 2
    assert out["bad"] == {"status": 400, "param": "n"}
    assert out["reward"]["accepted"] is True and out["reward"]["trajectories"] == 1
    (group,) = [g for task, g in mesh.groups() if task == out["session_id"]]
    # The streamed turn continued the plain one: one trajectory with two sampled runs.
    mask = list(group.trajectories[0].loss_mask)
    assert sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])) == 2
