"""Typed asyncio client of ``arealgrpc.v1.CoordinatorService`` (for external producers).

An external producer takes a lease, generates against the rollout server the lease names,
and submits the group under the lease::

    client = CoordinatorClient("127.0.0.1:50051")
    lease = await client.acquire("agent-1", group_size=4)
    ...  # generate with areal_clients.rollout.RolloutClient(lease.rollout_address)
    reply = await client.submit([(lease.lease_id, group)])

Tracing: the lease carries a trace context. ``acquire`` makes it the default context of this
asyncio task's ``RolloutClient.generate`` calls and ``submit`` puts it in trajectories that
carry none, so one lease's generation, submission and training step form one trace (see
``areal_grpc.tracing``).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterable

import grpc
from arealgrpc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

from areal_grpc import tracing
from areal_grpc.server import aio_channel

__all__ = ["CoordinatorClient"]

# Trace contexts of leases taken but not yet submitted or released, kept per client; leases
# that expire unused would otherwise pile up in a long-running producer.
_MAX_REMEMBERED_LEASES = 4096


class CoordinatorClient:
    """Client of the coordinator."""

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        self.address = address
        self._channel = channel or aio_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    @functools.cached_property
    def _lease_traces(self) -> dict[str, common_pb2.TraceContext]:
        # lease id -> trace context of leases taken here and not yet submitted or released
        # (made on first use, so every construction path has one).
        return {}

    async def acquire(
        self,
        producer_id: str,
        group_size: int = 1,
        timeout_s: float = 30.0,
        trace_context: common_pb2.TraceContext | None = None,
    ) -> coordinator_pb2.RolloutLease:
        """A lease; raises RESOURCE_EXHAUSTED (with RetryInfo) when capacity is 0.

        The lease's trace continues ``trace_context`` (default: the current span when this
        process traces). Its context becomes the one this asyncio task's Generate calls
        carry (see :func:`areal_grpc.tracing.carry`), and :meth:`submit` puts it in the
        lease's trajectories, so acquire -> generate -> submit is one trace without further
        plumbing.
        """
        reply = await self.stub.AcquireRollout(
            coordinator_pb2.AcquireRolloutRequest(
                producer_id=producer_id,
                group_size=group_size,
                trace_context=tracing.outgoing(trace_context, use_carried=False),
            ),
            timeout=timeout_s,
        )
        lease = reply.lease
        if tracing.is_valid(lease.trace_context):
            if len(self._lease_traces) >= _MAX_REMEMBERED_LEASES:
                # Leases neither submitted nor released here (expired): forget the oldest.
                del self._lease_traces[next(iter(self._lease_traces))]
            self._lease_traces[lease.lease_id] = lease.trace_context
        tracing.carry(lease.trace_context, lease.lease_id)
        return lease

    async def release(self, lease_id: str, timeout_s: float = 30.0) -> None:
        """Gives a lease back unused."""
        self._lease_traces.pop(lease_id, None)
        await self.stub.ReleaseRollout(
            coordinator_pb2.ReleaseRolloutRequest(lease_id=lease_id), timeout=timeout_s
        )

    async def renew(self, lease_id: str, timeout_s: float = 30.0) -> float:
        """Extends a lease by the run's lease time (a heartbeat of a producer still working
        on its group); returns the new deadline in wall-clock seconds. NOT_FOUND when the
        lease is unknown or already expired."""
        reply = await self.stub.RenewRollout(
            coordinator_pb2.RenewRolloutRequest(lease_id=lease_id), timeout=timeout_s
        )
        return reply.deadline.seconds + reply.deadline.nanos / 1e9

    async def submit(
        self,
        groups: Iterable[tuple[str, common_pb2.TrajectoryGroup]],
        timeout_s: float | None = 60.0,
    ) -> coordinator_pb2.SubmitTrajectoriesResponse:
        """Submits ``(lease_id, group)`` pairs on one stream; the reply lists rejections.

        Trajectories sent without a trace context carry their lease's (for leases taken
        with this client), so the submission and the training step join the lease's trace;
        the caller's groups are not modified.
        """

        sent: list[str] = []

        async def requests() -> AsyncIterator[coordinator_pb2.SubmitTrajectoriesRequest]:
            for lease_id, group in groups:
                sent.append(lease_id)
                yield coordinator_pb2.SubmitTrajectoriesRequest(
                    lease_id=lease_id, group=self._with_lease_trace(lease_id, group)
                )

        reply = await self.stub.SubmitTrajectories(requests(), timeout=timeout_s)
        # Every group of a call that succeeded was accepted or rejected: its lease is used up.
        for lease_id in sent:
            self._lease_traces.pop(lease_id, None)
        return reply

    def _with_lease_trace(
        self, lease_id: str, group: common_pb2.TrajectoryGroup
    ) -> common_pb2.TrajectoryGroup:
        lease_trace = self._lease_traces.get(lease_id)
        missing = [
            i for i, t in enumerate(group.trajectories) if not tracing.is_valid(t.trace_context)
        ]
        if lease_trace is None or not missing:
            return group
        out = common_pb2.TrajectoryGroup()
        out.CopyFrom(group)
        for i in missing:
            out.trajectories[i].trace_context.CopyFrom(lease_trace)
        return out

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

    async def scale_rollout_fleet(
        self, servers: int, timeout_s: float = 600.0
    ) -> coordinator_pb2.ScaleRolloutFleetResponse:
        """Starts or stops rollout servers until the run has ``servers`` of them.

        The default deadline is long: each new server starts and loads its model before the
        call returns (it enters rotation once it has received the current weights).
        """
        return await self.stub.ScaleRolloutFleet(
            coordinator_pb2.ScaleRolloutFleetRequest(servers=servers), timeout=timeout_s
        )

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()
