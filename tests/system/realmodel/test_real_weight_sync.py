"""Weight updates of the real model (134.5M parameters, tied embeddings) through each method.

A real trainer service (one plain rank, in-process, real gRPC) takes a GRPO step on the real
model, then PublishWeights pushes the new version to a real rollout server (in-process, real
gRPC) by STREAM, DISK and DISTRIBUTED (gloo) in turn. After each, every tensor the rollout
engine serves is bit-identical to the trainer's, including the tied lm_head.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from areal_servers.trainer.publish.base import PublisherConfig
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from arealgrpc.v1 import weight_sync_pb2 as wpb

from areal_grpc.config import ModelConfig, OptimizerSettings, TrainerConfig

TIMEOUT = 300.0
# The ``serve`` fixture (tests/system/realmodel/conftest.py): (trainer service, model dir,
# weights root) -> Served.
Serve = Callable[[TrainerService, str, Path], Any]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()).hexdigest()


class Mesh:
    def __init__(self, model_dir: str, root: Path, serve: Serve) -> None:
        torch.set_num_threads(1)
        self.trainer = TrainerService(
            TrainerServiceConfig(
                trainer=TrainerConfig(
                    fsdp=False, device="cpu", optimizer=OptimizerSettings(lr=1e-4)
                ),
                model=ModelConfig(source=model_dir),
                distributed=False,
                path_roots=(str(root),),
                weights=PublisherConfig(disk_root=str(root / "weights"), timeout_s=TIMEOUT),
            )
        )
        self.trainer.wait_ready(TIMEOUT)
        self.served = serve(self.trainer, model_dir, root / "weights")
        self.engine = self.served.rollout_engine
        self.rollout_address = self.served.rollout_address
        trainer_address = self.served.trainer_address
        self.channels = [grpc.insecure_channel(trainer_address)]
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channels[0])

    def step(self) -> int:
        """One GRPO step on two sampled-looking sequences; returns the new version."""
        version = self.trainer.engine.version  # type: ignore[union-attr]
        group = common_pb2.TrajectoryGroup(task_id="t", group_id="t")
        for reward, tail in ((1.0, [33, 34, 2]), (0.0, [35, 36, 37])):
            ids = [1, 9690, 198, 21350, 2, 198, 1, 520, 9531, 198, *tail]
            group.trajectories.append(
                common_pb2.Trajectory(
                    token_ids=ids,
                    logprobs=[0.0] * 10 + [-1.0] * 3,
                    versions=[-1] * 10 + [version] * 3,
                    loss_mask=[False] * 10 + [True] * 3,
                    reward=reward,
                    prompt_length=10,
                    task_id="t",
                    group_id="t",
                )
            )
        messages = [
            trainer_pb2.TrainStepRequest(
                begin=trainer_pb2.StepBegin(policy_version=version, group_count=1)
            ),
            trainer_pb2.TrainStepRequest(group=group),
            trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()),
        ]
        *_, last = self.stub.TrainStep(iter(messages), timeout=TIMEOUT)
        return int(last.stats.policy_version)

    def publish(self, method: int) -> trainer_pb2.PublishWeightsResponse:
        return self.stub.PublishWeights(
            trainer_pb2.PublishWeightsRequest(
                rollout_addresses=[self.rollout_address], methods=[method]
            ),
            timeout=TIMEOUT,
        )

    def close(self) -> None:
        for c in self.channels:
            c.close()
        self.served.close()
        self.trainer.close()


@pytest.fixture(scope="module")
def mesh(
    real_model_dir: str, tmp_path_factory: pytest.TempPathFactory, serve: Serve
) -> Iterator[Mesh]:
    m = Mesh(real_model_dir, tmp_path_factory.mktemp("real-sync"), serve)
    yield m
    m.close()


@pytest.mark.parametrize(
    "method",
    [wpb.TRANSFER_METHOD_STREAM, wpb.TRANSFER_METHOD_DISK, wpb.TRANSFER_METHOD_DISTRIBUTED],
    ids=["stream", "disk", "distributed"],
)
def test_a_real_model_update_is_bit_exact_on_the_rollout_side(mesh: Mesh, method: int) -> None:
    version = mesh.step()
    reply = mesh.publish(method)
    [target] = reply.results
    assert target.status.code == 0, target.status
    assert target.method == method and target.policy_version == version
    trained = mesh.trainer.engine.full_state_dict()  # type: ignore[union-attr]
    served = mesh.engine.model.state_dict()
    assert set(served) == set(trained)
    assert {k: digest(v) for k, v in served.items()} == {k: digest(v) for k, v in trained.items()}
    # The served model still ties its output layer to its embeddings.
    model = mesh.engine.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert mesh.engine.status().version == version
