"""TrainerService in one plain process (no process group) on a real loopback gRPC server:
request-stream validation, path confinement and status, cheaply, without rank processes."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

from areal_grpc.config import OptimizerSettings, TrainerConfig
from areal_grpc.errors import field_violations
from areal_grpc.server import ServerOptions, aio_channel, service, start_server


def traj(n: int, prompt: int = 2, reward: float = 1.0) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        token_ids=[5 + i for i in range(n)],
        logprobs=[0.0] * prompt + [-1.0] * (n - prompt),
        versions=[-1] * prompt + [0] * (n - prompt),
        loss_mask=[False] * prompt + [True] * (n - prompt),
        reward=reward,
        prompt_length=prompt,
    )


def group(*rewards: float, n: int = 6) -> common_pb2.TrajectoryGroup:
    return common_pb2.TrajectoryGroup(trajectories=[traj(n, reward=r) for r in rewards])


def req(**kind) -> trainer_pb2.TrainStepRequest:
    return trainer_pb2.TrainStepRequest(**kind)


def begin(version: int = 0, count: int = 1) -> trainer_pb2.TrainStepRequest:
    return req(begin=trainer_pb2.StepBegin(policy_version=version, group_count=count))


END = trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd())


async def scenario(tmp_path) -> None:
    cfg = TrainerServiceConfig(
        trainer=TrainerConfig(
            fsdp=False, device="cpu", max_tokens_per_mb=16, optimizer=OptimizerSettings(lr=1e-3)
        ),
        distributed=False,
        path_roots=(str(tmp_path),),
    )
    servicer = TrainerService(cfg)
    running = await start_server(
        [service(servicer, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)],
        ServerOptions(host="127.0.0.1", port=0),
    )
    channel = aio_channel(running.address)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)

    async def step(messages):
        out = []
        try:
            async for resp in stub.TrainStep(iter(messages), timeout=60):
                out.append(resp)
            return out
        except grpc.aio.AioRpcError as err:
            return err

    try:
        bad_cases = [
            ([begin(count=1), req(group=group(1.0, 0.0))], "end"),  # no StepEnd
            ([begin(count=2), req(group=group(1.0, 0.0)), END], "begin.group_count"),
            ([req(group=group(1.0)), END], "group"),  # group before StepBegin
            ([begin(count=1), req(group=group(1.0, n=20)), END], "groups[0].trajectories[0]"),
            ([req()], "kind"),
        ]
        for messages, field in bad_cases:
            err = await step(messages)
            assert isinstance(err, grpc.aio.AioRpcError), field
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
            assert field_violations(err)[0][0].startswith(field), field_violations(err)

        # Equal rewards in every group: zero advantages, a finite step that leaves loss 0.
        out = await step([begin(count=2), req(group=group(1.0, 1.0)), req(group=group(0.0)), END])
        assert not isinstance(out, grpc.aio.AioRpcError), out
        stats = out[-1].stats
        assert stats.policy_version == 1 and stats.sequences == 3
        assert stats.loss == 0.0 and math.isfinite(stats.grad_norm)
        assert stats.trained_tokens == 3 * 4
        phases = [r.progress.phase for r in out[:-1]]
        assert phases[0] == trainer_pb2.STEP_PHASE_RECEIVED
        assert phases[-1] == trainer_pb2.STEP_PHASE_UPDATE

        status = await stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest())
        assert (status.rank, status.world_size, status.policy_version, status.busy) == (
            0,
            1,
            1,
            False,
        )
        assert status.model == "builtin:micro"

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ExportModel(trainer_pb2.ExportModelRequest(path="/etc/evil"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(err.value)[0][0] == "path"
        ok = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(tmp_path / "ck")))
        assert ok.policy_version == 1 and (tmp_path / "ck").is_dir()
    finally:
        await channel.close()
        await running.stop(0)
        servicer.close()


def test_single_rank_service_validates_streams_and_paths(tmp_path):
    asyncio.run(scenario(tmp_path))
