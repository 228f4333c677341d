"""Typed asyncio client of ``areal.v1.CoordinatorService`` (for external producers).

An external producer takes a lease, generates against the rollout server the lease names,
and submits the group under the lease::

    client = CoordinatorClient("127.0.0.1:50051")
    lease = await client.acquire("agent-1", group_size=4)
    ...  # generate with areal_clients.rollout.RolloutClient(lease.rollout_address)
    reply = await client.submit([(lease.lease_id, group)])
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import grpc
from areal.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

from areal_grpc.server import aio_channel

__all__ = ["CoordinatorClient"]


class CoordinatorClient:
    """Client of the coordinator."""

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        self.address = address
        self._channel = channel or aio_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    async def acquire(
        self, producer_id: str, group_size: int = 1, timeout_s: float = 30.0
    ) -> coordinator_pb2.RolloutLease:
        """A lease; raises RESOURCE_EXHAUSTED (with RetryInfo) when capacity is 0."""
        reply = await self.stub.AcquireRollout(
            coordinator_pb2.AcquireRolloutRequest(producer_id=producer_id, group_size=group_size),
            timeout=timeout_s,
        )
        return reply.lease

    async def release(self, lease_id: str, timeout_s: float = 30.0) -> None:
        """Gives a lease back unused."""
        await self.stub.ReleaseRollout(
            coordinator_pb2.ReleaseRolloutRequest(lease_id=lease_id), timeout=timeout_s
        )

    async def submit(
        self,
        groups: Iterable[tuple[str, common_pb2.TrajectoryGroup]],
        timeout_s: float | None = 60.0,
    ) -> coordinator_pb2.SubmitTrajectoriesResponse:
        """Submits ``(lease_id, group)`` pairs on one stream; the reply lists rejections."""

        async def requests() -> AsyncIterator[coordinator_pb2.SubmitTrajectoriesRequest]:
            for lease_id, group in groups:
                yield coordinator_pb2.SubmitTrajectoriesRequest(lease_id=lease_id, group=group)

        return await self.stub.SubmitTrajectories(requests(), timeout=timeout_s)

    def watch_version(self) -> AsyncIterator[coordinator_pb2.WatchVersionResponse]:
        """The current version at once, then every change (cancel the iteration to stop)."""
        return self.stub.WatchVersion(coordinator_pb2.WatchVersionRequest())

    async def status(self, timeout_s: float = 30.0) -> coordinator_pb2.GetCoordinatorStatusResponse:
        """Version, step, staleness counters and workers."""
        return await self.stub.GetCoordinatorStatus(
            coordinator_pb2.GetCoordinatorStatusRequest(), timeout=timeout_s
        )

    async def register_worker(
        self,
        role: coordinator_pb2.WorkerRole,
        address: str,
        worker_id: str = "",
        timeout_s: float = 30.0,
    ) -> coordinator_pb2.RegisterWorkerResponse:
        """Adds a rollout server or trainer rank to the mesh."""
        return await self.stub.RegisterWorker(
            coordinator_pb2.RegisterWorkerRequest(role=role, address=address, worker_id=worker_id),
            timeout=timeout_s,
        )

    async def deregister_worker(
        self, worker_id: str, timeout_s: float = 30.0
    ) -> coordinator_pb2.DeregisterWorkerResponse:
        """Removes a worker; its in-flight work is re-queued."""
        return await self.stub.DeregisterWorker(
            coordinator_pb2.DeregisterWorkerRequest(worker_id=worker_id), timeout=timeout_s
        )

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()
