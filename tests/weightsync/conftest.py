"""Real parts for the weight-sync tests: trainer rank processes and in-process rollout servers.

* ``trainers``: two ``areal-trainer`` processes (FSDP2 over gloo on loopback, builtin:micro)
  shared by the whole directory, publishing DISK versions under ``weights_root``;
  ``start_trainers`` starts other such groups (on a GPU, say).
* ``make_rollout``: a rollout server on loopback (real HFEngine + RolloutService +
  WeightSyncService) on a background event loop, stopped at the end of the test.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
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

from areal_grpc.config import LoraSettings, ModelConfig, RolloutConfig
from areal_grpc.model import load_tokenizer
from areal_grpc.ports import free_port
from areal_grpc.server import BackgroundServer, service, sync_channel

MODEL = "builtin:micro"
RPC_TIMEOUT = 120.0


def nccl_offer(**params: Any) -> weight_sync_pb2.TransferOption:
    """A DISTRIBUTED offer over NCCL; ``params`` override the DistributedParams defaults (a
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


@pytest.fixture(scope="session")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    t = start_trainers(tmp_path_factory.mktemp("trainers"))
    yield t
    stop_trainers(t)


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


@pytest.fixture
def make_rollout() -> Iterator[MakeRollout]:
    started: list[Rollout] = []

    def make(
        disk_root: str | Path | None = None,
        device: str = "cpu",
        lora: LoraSettings | None = None,
        engine: InferenceEngine | None = None,
        **kw: object,
    ) -> Rollout:
        if engine is None:
            engine = HFEngine(
                ModelConfig(source=MODEL, lora=lora or LoraSettings()), RolloutConfig(device=device)
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

    yield make
    for r in started:
        r.channel.close()
        r.server.call(r.weight_sync.close())
        r.server.call(r.engine.close())
        r.server.stop()


__all__ = [
    "MODEL",
    "RPC_TIMEOUT",
    "Rollout",
    "Trainers",
    "start_trainers",
    "stop_trainers",
    "tensor_digest",
    "weight_sync_pb2",
]
