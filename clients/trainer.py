"""Typed asyncio client of ``arealgrpc.v1.TrainerService`` (one trainer rank).

The trainer ranks form one SPMD group, so the coordinator makes the same collective calls
(TrainStep, SaveCheckpoint, LoadCheckpoint, ExportModel) on every rank concurrently;
:func:`on_all_ranks` runs such a call everywhere and raises the most telling error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

from areal_grpc.server import aio_channel

__all__ = ["ProgressFn", "TrainerClient", "on_all_ranks"]

T = TypeVar("T")

ProgressFn = Callable[[trainer_pb2.StepProgress], None]

# ABORTED means "another rank refused its part"; the refusing rank's own error says why.
_LEAST_TELLING = (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)


class TrainerClient:
    """Client of one trainer rank."""

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        self.address = address
        self._channel = channel or aio_channel(address)
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self._channel)

    async def train_step(
        self,
        global_step: int,
        policy_version: int,
        groups: Sequence[common_pb2.TrajectoryGroup],
        on_progress: ProgressFn | None = None,
        timeout_s: float | None = None,
    ) -> trainer_pb2.StepStats:
        """Streams this rank's shard (begin, groups, end) and returns the step's statistics."""

        async def requests() -> AsyncIterator[trainer_pb2.TrainStepRequest]:
            yield trainer_pb2.TrainStepRequest(
                begin=trainer_pb2.StepBegin(
                    global_step=global_step,
                    policy_version=policy_version,
                    group_count=len(groups),
                )
            )
            for group in groups:
                yield trainer_pb2.TrainStepRequest(group=group)
            yield trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd())

        stats: trainer_pb2.StepStats | None = None
        async for response in self.stub.TrainStep(requests(), timeout=timeout_s):
            if response.HasField("stats"):
                stats = response.stats
            elif on_progress is not None:
                on_progress(response.progress)
        if stats is None:
            raise RuntimeError(f"trainer {self.address} ended TrainStep without statistics")
        return stats

    async def save_checkpoint(
        self, path: str, global_step: int, timeout_s: float | None = None
    ) -> trainer_pb2.SaveCheckpointResponse:
        """Saves this rank's shard of model, optimizer and scheduler under ``path``."""
        return await self.stub.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path=path, global_step=global_step),
            timeout=timeout_s,
        )

    async def load_checkpoint(
        self, path: str, timeout_s: float | None = None, *, min_policy_version: int = 0
    ) -> trainer_pb2.LoadCheckpointResponse:
        """Restores a checkpoint written by :meth:`save_checkpoint`; the rank goes on from at
        least ``min_policy_version``."""
        return await self.stub.LoadCheckpoint(
            trainer_pb2.LoadCheckpointRequest(path=path, min_policy_version=min_policy_version),
            timeout=timeout_s,
        )

    async def export_model(
        self, path: str, timeout_s: float | None = None
    ) -> trainer_pb2.ExportModelResponse:
        """Writes the full model in Hugging Face format (rank 0 writes the files)."""
        return await self.stub.ExportModel(
            trainer_pb2.ExportModelRequest(path=path), timeout=timeout_s
        )

    async def status(self, timeout_s: float = 30.0) -> trainer_pb2.GetTrainerStatusResponse:
        """Rank, world size, version, step and backend."""
        return await self.stub.GetTrainerStatus(
            trainer_pb2.GetTrainerStatusRequest(), timeout=timeout_s
        )

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()


async def on_all_ranks(
    clients: Sequence[TrainerClient], call: Callable[[int, TrainerClient], Awaitable[T]]
) -> list[T]:
    """Runs ``call(rank, client)`` on every rank concurrently; results in rank order.

    When some ranks fail, every call is still awaited (so no rank is left mid-collective on
    our side), then the most telling error is raised: a rank's own error before the ABORTED
    answers of the ranks it released.
    """
    results = await asyncio.gather(
        *(call(rank, client) for rank, client in enumerate(clients)), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        errors.sort(
            key=lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code() in _LEAST_TELLING
        )
        raise errors[0]
    return list(results)  # type: ignore[arg-type]
