"""A rollout server on vLLM's CPU build, for real (no fake stands in for it): RolloutService and
WeightSyncService over ``VLLMEngine`` on a real gRPC server on loopback.

Callers depend on the ``vllm_installed`` fixture (tests/system/conftest.py), which skips where
vLLM is not installed, or fails with ``AREAL_REQUIRE_VLLM=1`` as CI sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.service import RolloutServicer
from areal_servers.rollout.vllm_engine import VLLMEngine
from areal_servers.rollout.weight_sync import WeightSyncServicer, build_weight_sync_service
from arealgrpc.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    weight_sync_pb2,
    weight_sync_pb2_grpc,
)

from areal_grpc.config import LoraSettings, VllmSettings
from areal_grpc.model import load_tokenizer
from areal_grpc.server import BackgroundServer, service, sync_channel
from areal_grpc.weight_transfer import PUSH_WEIGHTS_METHOD, encode_push_request
from tests.support.weightsync import push_messages

RPC_TIMEOUT = 120.0
# The built-in model vLLM's CPU attention serves (heads of 32; builtin:micro's 16 it does not).
TINY = "builtin:tiny"
# Small enough for several engines on a 24 GiB machine, large enough for every test here.
SETTINGS = VllmSettings(kv_cache_gib=0.25, max_model_len=256, max_num_seqs=32)


@dataclass
class VllmServer:
    """A rollout server on vLLM, its stubs, and the fatal failures its engine reported."""

    server: BackgroundServer
    address: str
    engine: VLLMEngine
    weight_sync: WeightSyncServicer
    channel: grpc.Channel
    rollout: rollout_pb2_grpc.RolloutServiceStub
    sync: weight_sync_pb2_grpc.WeightSyncServiceStub
    fatal: list[str] = field(default_factory=list)
    # Where UpdateFromDisk paths must lie (None: no disk updates).
    disk_root: Path | None = None

    def version(self) -> int:
        """The version GetRolloutStatus reports."""
        status = self.rollout.GetRolloutStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=RPC_TIMEOUT
        )
        return int(status.policy_version)

    def generate(self, prompt: list[int], **sampling: object) -> rollout_pb2.GenerateResponse:
        """One Generate call (``sampling``: SamplingParams fields)."""
        return self.rollout.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
            ),
            timeout=RPC_TIMEOUT,
        )

    def greedy(self, prompt: list[int], n: int = 12) -> rollout_pb2.Completion:
        """A greedy completion of ``n`` tokens (EOS ignored)."""
        reply = self.generate(prompt, temperature=0.0, max_new_tokens=n, ignore_eos=True)
        return reply.completions[0]

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> object:
        """PushWeights (STREAM) of ``state_dict`` as ``version``."""
        return self.push_messages(push_messages(state_dict, version, chunk_bytes=1 << 16))

    def push_messages(self, messages: list[object]) -> weight_sync_pb2.PushWeightsResponse:
        """PushWeights of prepared messages (a header, then chunks)."""
        call = self.channel.stream_unary(
            PUSH_WEIGHTS_METHOD,
            request_serializer=encode_push_request,
            response_deserializer=weight_sync_pb2.PushWeightsResponse.FromString,
        )
        return call(iter(messages), timeout=RPC_TIMEOUT)

    def close(self) -> None:
        """Stops the server, then the engine (and vLLM's processes)."""
        self.channel.close()
        self.server.call(self.weight_sync.close())
        self.server.call(self.engine.close(), timeout_s=120)
        self.server.stop()


def start_vllm_server(
    model: str = TINY,
    settings: VllmSettings = SETTINGS,
    lora: LoraSettings | None = None,
    disk_root: Path | None = None,
) -> VllmServer:
    """A started rollout server on a fresh vLLM engine (fatal failures are recorded, not
    exited on: this is the test process). Callers depend on the ``vllm_installed`` fixture."""
    fatal: list[str] = []
    engine = VLLMEngine(model, settings, lora=lora)
    engine.on_death(fatal.append)
    rollout = RolloutServicer(engine, load_tokenizer(model))
    ws = build_weight_sync_service(
        engine,
        ReceiverConfig(
            disk_root=str(disk_root) if disk_root else None,
            socket_host="127.0.0.1",
            group_timeout_s=120,
        ),
    )
    server = BackgroundServer(
        [
            service(rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2),
            ws,
        ]
    )
    running = server.start()
    try:
        # vLLM's AsyncLLM belongs to the event loop that serves the engine.
        server.call(engine.start(), timeout_s=settings.start_timeout_s)
    except BaseException:
        server.call(engine.close(), timeout_s=120)
        server.stop()
        raise
    channel = sync_channel(running.address)
    return VllmServer(
        server,
        running.address,
        engine,
        ws.servicer,  # type: ignore[arg-type]
        channel,
        rollout_pb2_grpc.RolloutServiceStub(channel),
        weight_sync_pb2_grpc.WeightSyncServiceStub(channel),
        fatal,
        disk_root,
    )
