"""vLLM's CPU build as the rollout engine, for real: no fake stands in for it.

The tests skip, saying how to install it, where vLLM is not installed (the default install;
the ``vllm_installed`` fixture); CI installs it (``./scripts/setup --vllm``) and sets
``AREAL_REQUIRE_VLLM=1``, which turns that skip into a failure. Each module serves one
engine (vLLM takes 20-60 s to start here) on a real gRPC server on loopback: RolloutService
and WeightSyncService over ``VLLMEngine``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
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

from areal_grpc.chunks import iter_chunk_views
from areal_grpc.config import LoraSettings, VllmSettings
from areal_grpc.model import load_tokenizer
from areal_grpc.server import BackgroundServer, service, sync_channel
from areal_grpc.weight_transfer import PUSH_WEIGHTS_METHOD, encode_push_request

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
        return self.push_messages(push_messages(state_dict, version))

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


def push_messages(
    state_dict: dict[str, torch.Tensor], version: int, chunk_bytes: int = 1 << 16
) -> list[object]:
    """A PushWeights stream: its header, then the tensors' chunks."""
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    header = weight_sync_pb2.PushWeightsRequest(
        header=weight_sync_pb2.PushWeightsHeader(
            policy_version=version, tensor_count=len(state_dict), total_bytes=total
        )
    )
    return [header, *iter_chunk_views(state_dict, chunk_bytes)]


def start_vllm_server(
    model: str = TINY,
    settings: VllmSettings = SETTINGS,
    lora: LoraSettings | None = None,
    disk_root: Path | None = None,
) -> VllmServer:
    """A started rollout server on a fresh vLLM engine (fatal failures are recorded, not
    exited on: this is the test process). Callers depend on the ``vllm_installed`` fixture."""
    fatal: list[str] = []
    engine = VLLMEngine(model, settings, lora=lora, on_fatal=fatal.append)
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


@pytest.fixture(scope="module")
def vllm_server(
    vllm_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A rollout server on vLLM serving the built-in tiny model, for the module (disk
    updates from under its ``disk_root``)."""
    s = start_vllm_server(disk_root=tmp_path_factory.mktemp("vllm-disk-root"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def make_vllm_server(vllm_installed: None) -> Iterator[Callable[..., VllmServer]]:
    """Starts rollout servers on vLLM (see :func:`start_vllm_server`); all closed at the end."""
    started: list[VllmServer] = []

    def make(**kw: object) -> VllmServer:
        s = start_vllm_server(**kw)  # type: ignore[arg-type]
        started.append(s)
        return s

    yield make
    for s in started:
        s.close()
