"""``CoordinatorService``: leases, external submissions, version watch, status, workers.

Served in-process by ``python -m areal_grpc.coordinator`` (sharing the run's
:class:`~areal_grpc.coordinator.pool.WorkPool`, so external groups are trained like any
other) and on its own by ``areal-coordinator``.

Errors: a malformed request is INVALID_ARGUMENT naming the field (``google.rpc.BadRequest``);
no capacity is RESOURCE_EXHAUSTED with ``google.rpc.RetryInfo``; an unknown lease or worker is
NOT_FOUND. A submission under an expired lease, or whose first generated token is more than
eta versions behind, is not an error of the call: it is listed in the reply's rejections with
the reason, and the other groups of the stream are still taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from arealgrpc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from google.protobuf import timestamp_pb2

from areal_grpc import tracing
from areal_grpc.coordinator.mesh import FleetLauncher
from areal_grpc.coordinator.pool import NoCapacity, WorkPool
from areal_grpc.errors import (
    FieldError,
    PreconditionError,
    abort_for,
    abort_with,
    resource_exhausted,
    status,
)
from areal_grpc.server import Service, service

__all__ = ["CoordinatorServicer", "Worker", "WorkerHooks"]

log = logging.getLogger(__name__)

# How long a producer refused for capacity should wait: capacity comes back when groups
# finish or a step bumps the version, both on the scale of a second here.
RETRY_AFTER_S = 0.5
# ScaleRolloutFleet's upper bound: a typo must not start thousands of servers.
MAX_FLEET = 64


@dataclass
class Worker:
    """A worker in the mesh."""

    worker_id: str
    role: int
    address: str
    healthy: bool = True
    policy_version: int = 0
    # arealgrpc.v1.RolloutServerState of a rollout server (set by the run's refresh hook).
    state: int = coordinator_pb2.ROLLOUT_SERVER_STATE_UNSPECIFIED
    # Times the run replaced this rollout server after it died.
    restarts: int = 0

    def to_proto(self) -> coordinator_pb2.WorkerInfo:
        """As ``arealgrpc.v1.WorkerInfo``."""
        return coordinator_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,  # type: ignore[arg-type]
            address=self.address,
            healthy=self.healthy,
            policy_version=self.policy_version,
            rollout_state=self.state,  # type: ignore[arg-type]
            restarts=self.restarts,
        )


@dataclass
class WorkerHooks:
    """What the run does when workers join or leave (absent on a standalone coordinator)."""

    # Called before a worker is listed; raise FieldError/PreconditionError to refuse it.
    add: Callable[[Worker], Awaitable[None]] | None = None
    # Called when a worker leaves; returns how many of its tasks were re-queued.
    remove: Callable[[Worker], Awaitable[int]] | None = None
    # Updates a worker's health and version from what the run knows (before status replies).
    refresh: Callable[[Worker], None] | None = None
    # Starts and stops rollout servers for ScaleRolloutFleet (None: the run cannot).
    fleet: FleetLauncher | None = None
    # Called after the fleet changed (e.g. to rewrite mesh.json).
    fleet_changed: Callable[[], None] | None = None
    # Rollout servers the run replaced after they died, over all servers.
    rollout_restarts: Callable[[], int] | None = None


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """The handlers of ``arealgrpc.v1.CoordinatorService`` over a work pool."""

    def __init__(
        self,
        pool: WorkPool,
        *,
        hooks: WorkerHooks | None = None,
        sweep_interval_s: float = 0.2,
    ) -> None:
        self.pool = pool
        self.hooks = hooks or WorkerHooks()
        self.workers: dict[str, Worker] = {}
        self._ids = itertools.count()
        self._sweep_interval_s = sweep_interval_s
        self._sweeper: asyncio.Task[None] | None = None
        # One ScaleRolloutFleet at a time: each decides from the fleet the last one left.
        self._scale_lock = asyncio.Lock()
        # lease id -> the lease's trace context, parent of its submission's span.
        self._lease_traces: dict[str, common_pb2.TraceContext] = {}

    # -- background --------------------------------------------------------------------------

    def as_service(self) -> Service:
        """This servicer as a :class:`~areal_grpc.server.Service` for ``start_server``."""
        return service(
            self, coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, coordinator_pb2
        )

    def start(self) -> None:
        """Starts the lease sweeper (expired leases free capacity without waiting for a call)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def stop(self) -> None:
        """Stops the sweeper."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval_s)
            self.pool.expire_leases()

    # -- workers -----------------------------------------------------------------------------

    def add_local_worker(self, role: int, address: str, worker_id: str) -> Worker:
        """Lists a worker the run started itself (no hooks)."""
        worker = Worker(worker_id, role, address)
        self.workers[worker_id] = worker
        return worker

    def _rollout_address(self) -> str:
        rollouts = [
            w
            for w in self.workers.values()
            if w.role == coordinator_pb2.WORKER_ROLE_ROLLOUT and w.healthy
        ]
        if not rollouts:
            return ""
        # Least leased first, so external producers spread over the servers.
        load = Counter(lease.rollout_address for lease in self.pool.leases.values())
        return min(rollouts, key=lambda w: (load[w.address], w.worker_id)).address

    # -- RPCs --------------------------------------------------------------------------------

    async def AcquireRollout(
        self, request: coordinator_pb2.AcquireRolloutRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.AcquireRolloutResponse:
        """A lease, or RESOURCE_EXHAUSTED with RetryInfo."""
        try:
            if request.group_size < 1:
                raise FieldError("group_size", f"must be >= 1, got {request.group_size}")
            address = self._rollout_address()
            lease = self.pool.acquire(request.producer_id, request.group_size)
            lease.rollout_address = address
        except NoCapacity as exc:
            await abort_with(context, resource_exhausted(str(exc), RETRY_AFTER_S))
        except Exception as exc:
            await abort_for(context, exc)
        # The root of the lease's trace (or a child of the producer's span): the producer
        # hands this context on to Generate and to its trajectories, so generation,
        # submission and the training step join it. Refused calls get no lease span.
        with tracing.span(
            "coordinator.lease",
            parent=request.trace_context,
            attributes={
                tracing.TASK_ID: lease.work.task_id,
                tracing.POLICY_VERSION: lease.version,
                tracing.PRODUCER_ID: request.producer_id,
                tracing.ROLLOUT_SERVER: address,
            },
        ):
            # Untraced here: the producer's own context (if any) goes on unchanged.
            trace_context = tracing.to_proto() if tracing.enabled() else request.trace_context
        if tracing.is_valid(trace_context):
            if len(self._lease_traces) > 2 * len(self.pool.leases) + 64:
                # Leases that expired or were released never reach a submission: forget them.
                live = self.pool.leases
                self._lease_traces = {k: v for k, v in self._lease_traces.items() if k in live}
            self._lease_traces[lease.work.task_id] = trace_context
        deadline = timestamp_pb2.Timestamp()
        deadline.FromNanoseconds(int(lease.wall_deadline * 1e9))
        return coordinator_pb2.AcquireRolloutResponse(
            lease=coordinator_pb2.RolloutLease(
                lease_id=lease.work.task_id,
                policy_version=lease.version,
                deadline=deadline,
                group_size=lease.group_size,
                rollout_address=address,
                trace_context=trace_context if tracing.is_valid(trace_context) else None,
            )
        )

    async def ReleaseRollout(
        self, request: coordinator_pb2.ReleaseRolloutRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ReleaseRolloutResponse:
        """Gives a lease back; NOT_FOUND when unknown or expired."""
        try:
            self.pool.release(request.lease_id)
        except FieldError as exc:
            await abort_with(context, status(grpc.StatusCode.NOT_FOUND, str(exc)))
        return coordinator_pb2.ReleaseRolloutResponse()

    async def RenewRollout(
        self, request: coordinator_pb2.RenewRolloutRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RenewRolloutResponse:
        """Extends a lease by the lease time from now; NOT_FOUND when unknown or expired."""
        try:
            lease = self.pool.renew(request.lease_id)
        except FieldError as exc:
            await abort_with(context, status(grpc.StatusCode.NOT_FOUND, str(exc)))
        deadline = timestamp_pb2.Timestamp()
        deadline.FromNanoseconds(int(lease.wall_deadline * 1e9))
        return coordinator_pb2.RenewRolloutResponse(deadline=deadline)

    async def SubmitTrajectories(
        self,
        request_iterator: AsyncIterator[coordinator_pb2.SubmitTrajectoriesRequest],
        context: grpc.aio.ServicerContext,
    ) -> coordinator_pb2.SubmitTrajectoriesResponse:
        """Takes each group under its lease; a malformed one ends the call with INVALID_ARGUMENT.

        Groups taken before a malformed one stay taken (they are in the training buffer),
        and the malformed group's lease stays valid for a corrected submission.
        """
        reply = coordinator_pb2.SubmitTrajectoriesResponse()
        index = 0
        try:
            async for req in request_iterator:
                where = f"requests[{index}]"
                index += 1
                if not req.lease_id:
                    raise FieldError(f"{where}.lease_id", "must not be empty")
                reason = self._submit_traced(req, where)
                if reason is None:
                    reply.accepted_groups += 1
                else:
                    reply.rejections.add(lease_id=req.lease_id, reason=reason)
        except FieldError as exc:
            taken = f" ({reply.accepted_groups} earlier group(s) of this call were accepted)"
            err = FieldError(exc.field, exc.description + taken)
            await abort_for(context, err)
        return reply

    def _submit_traced(
        self, req: coordinator_pb2.SubmitTrajectoriesRequest, where: str
    ) -> str | None:
        """``pool.submit`` under a span in the lease's trace; None when accepted, else why.

        One stream may carry groups of many leases, so each group gets its own span, parented
        by the context its trajectories carry (the lease's, when the producer passed it on).
        """
        lease = self.pool.leases.get(req.lease_id)
        # The producer's context wins (it may have opened spans of its own under the lease).
        carried = next(
            (t.trace_context for t in req.group.trajectories if tracing.is_valid(t.trace_context)),
            self._lease_traces.get(req.lease_id),
        )
        attributes = {
            tracing.TASK_ID: req.lease_id,
            tracing.POLICY_VERSION: self.pool.version,
            tracing.TOKENS: sum(len(t.token_ids) for t in req.group.trajectories),
        }
        if lease is not None:
            attributes[tracing.PRODUCER_ID] = lease.producer_id
        with tracing.span("coordinator.submit_group", parent=carried, attributes=attributes) as sp:
            if tracing.enabled():
                # Trajectories sent without a context get this span's, so the training step
                # that consumes them still links into the lease's trace.
                here = tracing.to_proto()
                for traj in req.group.trajectories:
                    if not tracing.is_valid(traj.trace_context):
                        traj.trace_context.CopyFrom(here)
            reason = self.pool.submit(req.lease_id, req.group, where)
            # Accepted or rejected, the lease is used up (a malformed group raised above and
            # keeps it).
            self._lease_traces.pop(req.lease_id, None)
            sp.set_attribute("areal.outcome", "accepted" if reason is None else "rejected")
            if reason is not None:
                sp.set_attribute("areal.reason", reason)
            return reason

    async def WatchVersion(
        self, request: coordinator_pb2.WatchVersionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.WatchVersionResponse]:
        """The current version now, then every change, until the caller cancels."""
        last = None
        while True:
            current = (self.pool.version, self.pool.global_step)
            if current != last:
                last = current
                yield coordinator_pb2.WatchVersionResponse(
                    policy_version=current[0], global_step=current[1]
                )
            await self.pool.wait_change(5.0)

    async def GetCoordinatorStatus(
        self,
        request: coordinator_pb2.GetCoordinatorStatusRequest,
        context: grpc.aio.ServicerContext,
    ) -> coordinator_pb2.GetCoordinatorStatusResponse:
        """Version, step, counters, capacity, workers (with rollout servers' states) and the
        run's rollout server restarts."""
        self.pool.expire_leases()
        if self.hooks.refresh is not None:
            for worker in self.workers.values():
                self.hooks.refresh(worker)
        st = self.pool.staleness.stats()
        return coordinator_pb2.GetCoordinatorStatusResponse(
            policy_version=self.pool.version,
            global_step=self.pool.global_step,
            running=st.running,
            accepted=st.accepted,
            rejected=st.rejected,
            capacity=self.pool.capacity(),
            max_staleness=self.pool.staleness.max_staleness,
            batch_size=self.pool.staleness.consumer_batch_size,
            workers=[w.to_proto() for w in self.workers.values()],
            rollout_restarts=self.hooks.rollout_restarts() if self.hooks.rollout_restarts else 0,
        )

    async def RegisterWorker(
        self, request: coordinator_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterWorkerResponse:
        """Adds a worker (the run brings a rollout server to the current version first)."""
        try:
            if request.role not in (
                coordinator_pb2.WORKER_ROLE_ROLLOUT,
                coordinator_pb2.WORKER_ROLE_TRAINER,
            ):
                raise FieldError("role", "must be WORKER_ROLE_ROLLOUT or WORKER_ROLE_TRAINER")
            host, sep, port = request.address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise FieldError("address", f"must be host:port, got {request.address!r}")
            if any(w.address == request.address for w in self.workers.values()):
                raise PreconditionError(f"a worker at {request.address} is already registered")
            worker_id = request.worker_id or f"worker-{next(self._ids)}"
            if worker_id in self.workers:
                raise PreconditionError(f"worker_id {worker_id!r} is taken")
            worker = Worker(worker_id, request.role, request.address)
            if self.hooks.add is not None:
                await self.hooks.add(worker)
            worker.policy_version = self.pool.version
            self.workers[worker_id] = worker
        except Exception as exc:
            await abort_for(context, exc)
        return coordinator_pb2.RegisterWorkerResponse(
            worker_id=worker_id, policy_version=self.pool.version
        )

    async def DeregisterWorker(
        self, request: coordinator_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DeregisterWorkerResponse:
        """Removes a worker; its in-flight tasks are re-queued."""
        worker = self.workers.get(request.worker_id)
        if worker is None:
            await abort_with(
                context,
                status(grpc.StatusCode.NOT_FOUND, f"worker_id: unknown {request.worker_id!r}"),
            )
        requeued = 0
        try:
            if self.hooks.remove is not None:
                requeued = await self.hooks.remove(worker)
        except Exception as exc:
            await abort_for(context, exc)
        del self.workers[request.worker_id]
        return coordinator_pb2.DeregisterWorkerResponse(requeued_tasks=requeued)

    async def ScaleRolloutFleet(
        self, request: coordinator_pb2.ScaleRolloutFleetRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ScaleRolloutFleetResponse:
        """Starts or stops rollout servers until there are ``servers`` of them."""
        reply = coordinator_pb2.ScaleRolloutFleetResponse()
        try:
            if not 1 <= request.servers <= MAX_FLEET:
                raise FieldError("servers", f"must be in 1-{MAX_FLEET}, got {request.servers}")
            fleet = self.hooks.fleet
            if fleet is None or self.hooks.add is None or self.hooks.remove is None:
                raise PreconditionError(
                    "this coordinator has no launcher that can start rollout servers "
                    "(launcher.mode=attach or a standalone coordinator): start a server "
                    "yourself and call RegisterWorker"
                )
            async with self._scale_lock:
                await self._scale(fleet, request.servers, reply)
        except Exception as exc:
            await abort_for(context, exc)
        finally:
            if self.hooks.fleet_changed is not None and (reply.added or reply.removed):
                self.hooks.fleet_changed()
        reply.servers = len(self._rollout_workers())
        reply.policy_version = self.pool.version
        return reply

    def _rollout_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == coordinator_pb2.WORKER_ROLE_ROLLOUT]

    async def _scale(
        self,
        fleet: FleetLauncher,
        target: int,
        reply: coordinator_pb2.ScaleRolloutFleetResponse,
    ) -> None:
        assert self.hooks.add is not None and self.hooks.remove is not None
        while len(self._rollout_workers()) < target:
            address = await asyncio.to_thread(fleet.start_rollout_server)
            worker_id = next(
                f"rollout-{i}" for i in itertools.count() if f"rollout-{i}" not in self.workers
            )
            worker = Worker(worker_id, coordinator_pb2.WORKER_ROLE_ROLLOUT, address)
            try:
                await self.hooks.add(worker)
            except BaseException:
                await asyncio.to_thread(fleet.stop_rollout_server, address)
                raise
            if self.hooks.refresh is not None:
                self.hooks.refresh(worker)  # not healthy (in rotation) until it has the weights
            # Admitted at this version: the run syncs it to this version (or a newer one)
            # before its first episode.
            worker.policy_version = self.pool.version
            self.workers[worker_id] = worker
            reply.added.append(worker.to_proto())
        # Newest first: servers started last have the least work in flight to re-queue.
        removable = [w for w in self._rollout_workers() if fleet.owns(w.address)]
        excess = len(self._rollout_workers()) - target
        if excess > len(removable):
            raise PreconditionError(
                f"servers: only {len(removable)} rollout server(s) were started by this run's "
                f"launcher and can be stopped; DeregisterWorker the others"
            )
        for worker in reversed(removable[len(removable) - excess :] if excess > 0 else []):
            reply.requeued_tasks += await self.hooks.remove(worker)
            del self.workers[worker.worker_id]
            worker.healthy = False
            reply.removed.append(worker.to_proto())
            await asyncio.to_thread(fleet.stop_rollout_server, worker.address)
