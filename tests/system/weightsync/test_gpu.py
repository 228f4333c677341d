"""Weight sync on a GPU: a CUDA trainer rank (FSDP2 over nccl) into rollout servers on a GPU.

Runs only where CUDA is available (skipped cleanly elsewhere). On one GPU the trainer and the
servers share the device, where NCCL cannot form a group (it refuses two ranks on one GPU):
the servers must decline the NCCL offer and take the next one. The NCCL broadcast itself needs
a second GPU for the servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
import torch
from areal_clients.fleet import FleetUpdateResult, update_fleet_weights
from arealgrpc.v1 import weight_sync_pb2

from tests.support.weightsync import (
    MakeRollout,
    Trainers,
    distributed_offer,
    exported_state_dict,
    reference_greedy,
    start_trainers,
    stop_trainers,
    tensor_digest,
)

PROMPT = [5, 17, 42, 99, 7]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and -m gpu)"),
]


def _gpu_trainer(tmp_path_factory: pytest.TempPathFactory, *extra: str) -> Iterator[Trainers]:
    t = start_trainers(
        tmp_path_factory.mktemp("gpu-trainer"), ranks=1, device="cuda:0", extra=extra
    )
    yield t
    stop_trainers(t)


@pytest.fixture(scope="module")
def gpu_trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    """One trainer rank on cuda:0; its weights backend defaults to nccl there."""
    yield from _gpu_trainer(tmp_path_factory)


@pytest.fixture(scope="module")
def gpu_trainer_gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    """One trainer rank on cuda:0 that publishes over a gloo weight group."""
    yield from _gpu_trainer(tmp_path_factory, "weight_sync.backend=gloo")


def update(trainers: Trainers, rollouts, *methods: str) -> FleetUpdateResult:
    """One fleet update of ``rollouts`` offering ``methods`` in that order."""
    return asyncio.run(
        update_fleet_weights(
            trainers.addresses, [r.address for r in rollouts], methods=methods, timeout_s=120
        )
    )


def took(result: FleetUpdateResult, method: str) -> None:
    """Every server was updated, by ``method``."""
    assert result.failed_servers == [], [s.error for s in result.servers]
    assert {s.method for s in result.servers} == {method}


def served_on(r, device: str) -> None:
    params = list(r.engine.model.parameters())
    assert params and all(p.device.type == device for p in params)


def check_moved(trainers: Trainers, rollouts, version: int, tag: str) -> None:
    """Every server serves ``version`` with exactly the trainer's exported weights."""
    export = trainers.export(f"export-{tag}-v{version}")
    expected = {k: tensor_digest(v) for k, v in exported_state_dict(export).items()}
    want = reference_greedy(export, PROMPT, device="cuda")
    for r in rollouts:
        assert r.version() == version
        served = r.digests()
        for name, digest in expected.items():
            assert served[name] == digest, name
        served_on(r, "cuda")
        # The exported model, loaded by a fresh engine on the GPU, gives the same greedy tokens.
        assert r.greedy(PROMPT) == want


def test_trainer_rank_trains_on_the_gpu_over_nccl(gpu_trainer: Trainers) -> None:
    from arealgrpc.v1 import trainer_pb2

    before = gpu_trainer.version()
    assert gpu_trainer.train_step() == before + 1
    status = gpu_trainer.stubs[0].GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest())
    assert status.ready and status.backend == weight_sync_pb2.COLLECTIVE_BACKEND_NCCL


@pytest.mark.parametrize("method", ["stream", "disk"])
def test_method_moves_gpu_trainer_weights_into_gpu_servers(
    gpu_trainer: Trainers, make_rollout: MakeRollout, method: str
) -> None:
    version = gpu_trainer.train_step()
    rollouts = [make_rollout(disk_root=gpu_trainer.weights_root, device="cuda") for _ in range(2)]
    took(update(gpu_trainer, rollouts, method), method)
    check_moved(gpu_trainer, rollouts, version, method)


def test_servers_on_the_trainers_gpu_decline_nccl_and_take_the_next_offer(
    gpu_trainer: Trainers, make_rollout: MakeRollout
) -> None:
    rollouts = [make_rollout(device="cuda") for _ in range(2)]
    addresses = [r.address for r in rollouts]
    version = gpu_trainer.train_step()
    # DISTRIBUTED alone: nothing acceptable, and the answer says why.
    only = update(gpu_trainer, rollouts, "distributed")
    assert only.failed_servers == addresses
    for s in only.servers:
        assert "FAILED_PRECONDITION" in s.error and "own GPU" in s.error, s.error
    assert [r.version() for r in rollouts] == [0, 0]  # the old weights still serve
    # DISTRIBUTED, then STREAM: the servers take STREAM.
    took(update(gpu_trainer, rollouts, "distributed", "stream"), "stream")
    check_moved(gpu_trainer, rollouts, version, "declined-nccl")


def test_distributed_gloo_from_a_gpu_trainer_into_gpu_servers(
    gpu_trainer_gloo: Trainers, make_rollout: MakeRollout
) -> None:
    rollouts = [make_rollout(device="cuda") for _ in range(2)]
    for _ in range(2):  # the second update reuses the group
        version = gpu_trainer_gloo.train_step()
        took(update(gpu_trainer_gloo, rollouts, "distributed"), "distributed")
        assert [r.weight_sync.group.params.backend for r in rollouts] == ["gloo", "gloo"]
    check_moved(gpu_trainer_gloo, rollouts, version, "gloo")


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL between processes needs a GPU per rank"
)
def test_distributed_nccl_into_servers_on_another_gpu(
    gpu_trainer: Trainers, make_rollout: MakeRollout
) -> None:
    rollouts = [make_rollout(device="cuda:1") for _ in range(2)]
    version = gpu_trainer.train_step()
    took(update(gpu_trainer, rollouts, "distributed"), "distributed")
    assert [r.weight_sync.group.params.backend for r in rollouts] == ["nccl", "nccl"]
    check_moved(gpu_trainer, rollouts, version, "nccl")


def test_negotiate_names_the_shared_gpu_when_nccl_is_all_that_is_offered(
    make_rollout: MakeRollout,
) -> None:
    from areal_grpc.weight_transfer import cuda_uuid

    r = make_rollout(device="cuda")
    offer = distributed_offer(device_uuid=cuda_uuid("cuda:0"))
    with pytest.raises(grpc.RpcError) as err:
        r.sync.Negotiate(weight_sync_pb2.NegotiateRequest(offers=[offer]), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "offers[0]" in err.value.details() and cuda_uuid("cuda:0") in err.value.details()
    # Another GPU's NCCL offer is accepted.
    offer.distributed.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
    plan = r.sync.Negotiate(weight_sync_pb2.NegotiateRequest(offers=[offer]), timeout=30)
    assert plan.plan.distributed.backend == weight_sync_pb2.COLLECTIVE_BACKEND_NCCL
