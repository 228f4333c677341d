"""The agent gateway's test mesh, in this process: a CoordinatorService over a WorkPool on
loopback (a rollout server registered with it), and the gateway app under uvicorn.

One copy for the gateway tests of every tier and for the real-model ones.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import uvicorn
from areal_clients.gateway import create_app
from arealgrpc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

from areal_grpc.config import GatewaySettings, ModelConfig, RunConfig
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from areal_grpc.ports import free_port
from areal_grpc.server import BackgroundServer, ServerOptions, sync_channel

MODEL = "builtin:micro"
VOCAB = 384
BATCH = 4  # the 429 test's capacity: BATCH x (max_staleness + 1) = 4 leases at version 0


@dataclass
class ServedCoordinator:
    """A CoordinatorService over ``pool``, served on loopback by a background event loop."""

    pool: WorkPool
    servicer: CoordinatorServicer
    server: BackgroundServer
    address: str

    def register_rollout(self, address: str, worker_id: str = "rollout-0") -> None:
        """Registers a rollout server, as a launcher does."""
        with sync_channel(self.address) as channel:
            coordinator_pb2_grpc.CoordinatorServiceStub(channel).RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(
                    role=coordinator_pb2.WORKER_ROLE_ROLLOUT, address=address, worker_id=worker_id
                ),
                timeout=30,
            )

    def leases(self) -> list[str]:
        """The ids of the leases the pool holds now."""

        async def ids() -> list[str]:
            return list(self.pool.leases)

        return self.server.call(ids())

    def buffered(self) -> list[Any]:
        """The finished work in the pool's buffer (each has ``work`` and ``group``)."""

        async def items() -> list[Any]:
            return list(self.pool.buffer)

        return self.server.call(items())

    def groups(self) -> list[tuple[str, common_pb2.TrajectoryGroup]]:
        """(task id, group) of everything in the pool's buffer."""
        return [(f.work.task_id, f.group) for f in self.buffered()]

    def stop(self) -> None:
        """Stops the servicer's sweeper, then the server."""
        self.server.call(self.servicer.stop())
        self.server.stop()


def serve_pool(pool: WorkPool, rollout_address: str | None = None) -> ServedCoordinator:
    """Serves ``pool`` as the CoordinatorService (its lease sweeper started), with the rollout
    server at ``rollout_address`` registered when one is given."""
    servicer = CoordinatorServicer(pool)
    server = BackgroundServer([servicer.as_service()], ServerOptions(host="127.0.0.1", port=0))
    address = server.start().address

    async def start() -> None:
        servicer.start()

    server.call(start())
    served = ServedCoordinator(pool, servicer, server, address)
    try:
        if rollout_address is not None:
            served.register_rollout(rollout_address)
    except BaseException:
        served.stop()
        raise
    return served


def start_mesh(
    rollout_address: str | None, batch: int = BATCH, lease_ttl_s: float = 60.0
) -> ServedCoordinator:
    """A synchronous pool (``batch`` groups a step, max_staleness 0) for the micro model's
    vocabulary, served with the rollout server at ``rollout_address`` registered."""
    pool = WorkPool(batch, 0, vocab_size=VOCAB, lease_ttl_s=lease_ttl_s)
    return serve_pool(pool, rollout_address)


@contextlib.contextmanager
def rollout_process(log_dir: Path, model: str = MODEL, name: str = "rollout") -> Iterator[Child]:
    """``python -m areal_servers.rollout`` serving ``model`` for the block."""
    argv = python_module_argv("areal_servers.rollout", "--port", "0", f"model.source={model}")
    child = start_child(name, argv, log_dir=log_dir)
    try:
        yield child
    finally:
        stop_children([child])


@contextlib.contextmanager
def coordinator_with(rollout_address: str | None, pool: WorkPool) -> Iterator[ServedCoordinator]:
    """:func:`serve_pool` for the block."""
    served = serve_pool(pool, rollout_address)
    try:
        yield served
    finally:
        served.stop()


@dataclass
class Gateway:
    """The gateway app under uvicorn in a thread."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_gateway(run: RunConfig, coordinator: str, api_key: str | None = None) -> Gateway:
    """``run``'s gateway under uvicorn in a thread, on a free loopback port."""
    port = free_port()
    app = create_app(run, coordinator, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    gateway = Gateway(f"http://127.0.0.1:{port}", server, thread)
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            gateway.stop()
            raise AssertionError("the gateway did not start")
        time.sleep(0.05)
    return gateway


@contextlib.contextmanager
def gateway_serving(run: RunConfig, coordinator: str) -> Iterator[str]:
    """:func:`serve_gateway` for the block; yields its base URL."""
    gateway = serve_gateway(run, coordinator)
    try:
        yield gateway.url
    finally:
        gateway.stop()


def gateway_run(model: str = MODEL, **gateway: Any) -> RunConfig:
    """A run config whose policy is ``model``, with these gateway settings."""
    return RunConfig(model=ModelConfig(source=model), gateway=GatewaySettings(**gateway))


def client(gw: Gateway, **kw: Any) -> openai.OpenAI:
    """The official ``openai`` client of ``gw`` (no retries)."""
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, **kw)


CHECK_TOOL = {
    "type": "function",
    "function": {
        "name": "check",
        "description": "Checks an answer.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
