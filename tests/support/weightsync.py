"""Real parts for the weight-sync tests: trainer rank processes and in-process rollout servers.

* :func:`start_trainers`: ``areal-trainer`` rank processes (FSDP2 over gloo on loopback,
  builtin:micro by default) publishing DISK versions under their ``weights_root`` (the e2e
  tier's ``trainers`` fixture shares one group of two by the session).
* :func:`rollout_factory`: rollout servers on loopback (real HFEngine, or the engine given, +
  RolloutService + WeightSyncService) on a background event loop, all stopped at the end of
  the block (the ``make_rollout`` fixtures).
* What the tests send and compare: :func:`publish` (the coordinator's fleet update, checked),
  :func:`push_messages`, :func:`shifted`, :func:`tensor_digest`, :func:`reference_greedy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from areal_clients.fleet import FleetUpdateResult, update_fleet_weights
from areal_servers.rollout.engine import InferenceEngine
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.service import RolloutServicer
from areal_servers.rollout.weight_sync import WeightSyncServicer, build_weight_sync_service
from arealgrpc.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weight_sync_pb2,
    weight_sync_pb2_grpc,
)
from safetensors.torch import load_file

from areal_grpc.chunks import iter_chunk_views
from areal_grpc.config import LoraSettings, ModelConfig, RolloutConfig
from areal_grpc.model import load_tokenizer
from areal_grpc.ports import free_port
from areal_grpc.server import BackgroundServer, service, sync_channel
from areal_grpc.weight_transfer import PUSH_WEIGHTS_METHOD, encode_push_request

MODEL = "builtin:micro"
RPC_TIMEOUT = 120.0


def distributed_offer(**params: Any) -> weight_sync_pb2.TransferOption:
    """A DISTRIBUTED offer; ``params`` override the DistributedParams defaults (NCCL, a
    sender at 127.0.0.1:29999, world size 2, the receiver at rank 1, group "g")."""
    fields: dict[str, Any] = {
        "backend": weight_sync_pb2.COLLECTIVE_BACKEND_NCCL,
        "master_address": "127.0.0.1",
        "master_port": 29999,
        "world_size": 2,
        "rank_offset": 1,
        "group_name": "g",
    }
    return weight_sync_pb2.TransferOption(
        method=weight_sync_pb2.TRANSFER_METHOD_DISTRIBUTED,
        distributed=weight_sync_pb2.DistributedParams(**(fields | params)),
    )


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class Trainers:
    processes: list[subprocess.Popen[str]]
    addresses: list[str]
    stubs: list[trainer_pb2_grpc.TrainerServiceStub]
    channels: list[grpc.Channel]
    weights_root: Path
    export_root: Path
    step: int = 0

    def version(self) -> int:
        return int(
            self.stubs[0]
            .GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=RPC_TIMEOUT)
            .policy_version
        )

    def train_step(self) -> int:
        """One real training step on both ranks; returns the new policy version."""
        version = self.version()
        rng = random.Random(self.step)
        ranks = len(self.stubs)
        groups = []
        for g in range(2):
            group = common_pb2.TrajectoryGroup(group_id=f"s{self.step}g{g}")
            for _ in range(2):
                n, prompt = 10, 3
                group.trajectories.append(
                    common_pb2.Trajectory(
                        token_ids=[rng.randrange(3, 250) for _ in range(n)],
                        # Near the initial policy's log-probs (uniform over ~384 tokens).
                        logprobs=[0.0] * prompt + [-5.9] * (n - prompt),
                        versions=[-1] * prompt + [version] * (n - prompt),
                        loss_mask=[False] * prompt + [True] * (n - prompt),
                        reward=float(rng.random() > 0.5),
                        prompt_length=prompt,
                        group_id=group.group_id,
                    )
                )
            groups.append(group)

        def messages(shard: list[common_pb2.TrajectoryGroup]):
            begin = trainer_pb2.StepBegin(
                global_step=self.step, policy_version=version, group_count=len(shard)
            )
            yield trainer_pb2.TrainStepRequest(begin=begin)
            for g in shard:
                yield trainer_pb2.TrainStepRequest(group=g)
            yield trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd())

        def run(rank: int, shard: list[common_pb2.TrajectoryGroup]) -> trainer_pb2.StepStats:
            stats = None
            for resp in self.stubs[rank].TrainStep(messages(shard), timeout=RPC_TIMEOUT):
                if resp.HasField("stats"):
                    stats = resp.stats
            assert stats is not None
            return stats

        shards = [groups[r::ranks] for r in range(ranks)]
        with ThreadPoolExecutor(ranks) as pool:
            stats = list(pool.map(lambda r: run(r, shards[r]), range(ranks)))
        self.step += 1
        assert stats[0].policy_version == version + 1
        return version + 1

    def export(self, name: str) -> Path:
        """ExportModel on both ranks (collective); the HF directory rank 0 wrote."""
        path = self.export_root / name

        def run(rank: int) -> trainer_pb2.ExportModelResponse:
            return self.stubs[rank].ExportModel(
                trainer_pb2.ExportModelRequest(path=str(path)), timeout=RPC_TIMEOUT
            )

        with ThreadPoolExecutor(len(self.stubs)) as pool:
            list(pool.map(run, range(len(self.stubs))))
        return path


def start_trainers(
    base: Path,
    ranks: int = 2,
    device: str = "cpu",
    extra: tuple[str, ...] = (),
    model: str = MODEL,
) -> Trainers:
    """``ranks`` real trainer processes (FSDP2; rank r on ``device``, "cuda" meaning cuda:r)."""
    weights_root = base / "weights"
    export_root = base / "export"
    weights_root.mkdir()
    export_root.mkdir()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs, addresses, stubs, channels = [], [], [], []
    for r in range(ranks):
        cmd = [
            sys.executable,
            "-m",
            "areal_servers.trainer",
            "--port=0",
            f"--rank={r}",
            f"--world-size={ranks}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            f"--device={device if device != 'cuda' else f'cuda:{r}'}",
            "--log-level=WARNING",
            f"model.source={model}",
            "trainer.torch_threads=1",
            # Large enough that one step visibly changes greedy outputs.
            "trainer.optimizer.lr=3e-3",
            "trainer.ppo.rejection.metric=none",
            "trainer.collective_timeout_s=120",
            # fp32 compute: these tests compare served log-probs with fp32 references.
            "trainer.mixed_precision=off",
            f"weight_sync.disk_root={weights_root}",
            f"output.dir={export_root}",
            "weight_sync.keep_versions=2",
            # Small buckets so even the micro model travels in several of them.
            "weight_sync.bucket_mb=0.1",
            "weight_sync.timeout_s=120",
            *extra,
        ]
        log = open(base / f"rank{r}.log", "w")  # noqa: SIM115 (lives with the process)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("LISTENING "), f"rank {r} did not start: {line!r}"
        address = line.split()[1]
        channel = sync_channel(address)
        procs.append(proc)
        addresses.append(address)
        channels.append(channel)
        stubs.append(trainer_pb2_grpc.TrainerServiceStub(channel))
    return Trainers(procs, addresses, stubs, channels, weights_root, export_root)


def stop_trainers(t: Trainers) -> None:
    """SIGTERM every rank, then kill what has not left within 30 s."""
    for c in t.channels:
        c.close()
    for p in t.processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in t.processes:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


@dataclass
class Rollout:
    server: BackgroundServer
    address: str
    engine: InferenceEngine
    weight_sync: WeightSyncServicer
    channel: grpc.Channel
    rollout: rollout_pb2_grpc.RolloutServiceStub
    sync: weight_sync_pb2_grpc.WeightSyncServiceStub

    def version(self) -> int:
        """The version GetRolloutStatus reports."""
        return int(
            self.rollout.GetRolloutStatus(
                rollout_pb2.GetRolloutStatusRequest(), timeout=RPC_TIMEOUT
            ).policy_version
        )

    def digests(self) -> dict[str, str]:
        """Checksums of the weights being served."""
        assert isinstance(self.engine, HFEngine)
        return {k: tensor_digest(v) for k, v in self.engine.model.state_dict().items()}

    def greedy(self, prompt: list[int], n: int = 12) -> list[int]:
        """Greedy completion through the Generate RPC."""
        reply = self.rollout.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=prompt,
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=n, ignore_eos=True
                ),
            ),
            timeout=RPC_TIMEOUT,
        )
        return list(reply.completions[0].output_ids)


MakeRollout = Callable[..., Rollout]


@contextlib.contextmanager
def rollout_factory() -> Iterator[MakeRollout]:
    """``make(disk_root=None, device="cpu", lora=None, engine=None, dtype="float32",
    **receiver_config)`` starts a :class:`Rollout` (HFEngine on builtin:micro serving
    ``dtype`` unless ``engine`` is given); every one started is stopped when the block ends."""
    started: list[Rollout] = []

    def make(
        disk_root: str | Path | None = None,
        device: str = "cpu",
        lora: LoraSettings | None = None,
        engine: InferenceEngine | None = None,
        dtype: str = "float32",
        **kw: object,
    ) -> Rollout:
        if engine is None:
            engine = HFEngine(
                ModelConfig(source=MODEL, lora=lora or LoraSettings()),
                RolloutConfig(device=device, dtype=dtype),  # type: ignore[arg-type]
            )
        rollout = RolloutServicer(engine, load_tokenizer(MODEL))
        kw.setdefault("group_timeout_s", 60)
        kw.setdefault("socket_host", "127.0.0.1")
        ws = build_weight_sync_service(
            engine,
            ReceiverConfig(
                disk_root=str(disk_root) if disk_root else None,
                **kw,  # type: ignore[arg-type]
            ),
        )
        server = BackgroundServer(
            [
                service(
                    rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2
                ),
                ws,
            ]
        )
        running = server.start()
        # An engine with processes of its own (vllm) starts on the loop that serves it.
        server.call(engine.start(), timeout_s=600)
        channel = sync_channel(running.address)
        r = Rollout(
            server,
            running.address,
            engine,
            ws.servicer,  # type: ignore[arg-type]
            channel,
            rollout_pb2_grpc.RolloutServiceStub(channel),
            weight_sync_pb2_grpc.WeightSyncServiceStub(channel),
        )
        started.append(r)
        return r

    try:
        yield make
    finally:
        for r in started:
            r.channel.close()
            r.server.call(r.weight_sync.close())
            r.server.call(r.engine.close())
            r.server.stop()


def shifted(r: Rollout, delta: float) -> dict[str, torch.Tensor]:
    """The server's own weights plus ``delta`` (tied lm_head left out, as trainers send)."""
    sd = r.engine.model.state_dict()
    return {k: v + delta for k, v in sd.items() if k != "lm_head.weight"}


def publish(
    trainers: Trainers, rollouts: Sequence[Rollout], methods: Sequence[str] = ()
) -> FleetUpdateResult:
    """The coordinator's fleet update of ``rollouts`` from ``trainers`` by ``methods`` (all
    of them, in the trainers' order, when empty); checks that every server took the trainers'
    version."""
    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses, [r.address for r in rollouts], methods=methods, timeout_s=120
        )
    )
    assert result.failed_servers == [], [s.error for s in result.servers]
    version = trainers.version()
    assert result.version == version
    assert [r.version() for r in rollouts] == [version] * len(rollouts)
    return result


def push_messages(
    sd: dict[str, torch.Tensor], version: int, chunk_bytes: int = 4096
) -> list[object]:
    """A PushWeights stream: its header, then the tensors' chunks of ``chunk_bytes``."""
    total = sum(t.numel() * t.element_size() for t in sd.values())
    header = weight_sync_pb2.PushWeightsRequest(
        header=weight_sync_pb2.PushWeightsHeader(
            policy_version=version, tensor_count=len(sd), total_bytes=total
        )
    )
    return [header, *iter_chunk_views(sd, chunk_bytes)]


def push(
    r: Rollout, messages: Iterator[object] | list[object]
) -> weight_sync_pb2.PushWeightsResponse:
    """PushWeights (STREAM) of prepared messages to ``r``."""
    call = r.channel.stream_unary(
        PUSH_WEIGHTS_METHOD,
        request_serializer=encode_push_request,
        response_deserializer=weight_sync_pb2.PushWeightsResponse.FromString,
    )
    return call(iter(messages), timeout=RPC_TIMEOUT)


def exported_state_dict(path) -> dict:
    """The tensors of an exported Hugging Face directory (one file or an index of shards)."""
    out = {}
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def reference_greedy(
    path, prompt: list[int], n: int = 12, device: str = "cpu", model_factory=None
) -> list[int]:
    """Greedy output of an hf engine loaded from the exported directory (or serving the model
    ``model_factory()`` builds, e.g. a base model with an exported adapter)."""

    async def run() -> list[int]:
        from areal_servers.rollout.engine import SamplingConfig

        model = model_factory() if model_factory is not None else None
        engine = HFEngine(
            ModelConfig(source=str(path)),
            RolloutConfig(device=device, dtype="float32"),
            model=model,
        )
        try:
            result = await engine.generate(
                prompt, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            )
        finally:
            await engine.close()
        return result.output_ids

    return asyncio.run(run())
