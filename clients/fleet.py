"""The fleet weight update, as one operation for the coordinator.

``update_fleet_weights`` runs the fleet's weight update (docs/concepts/architecture.md):

1. pause every rollout server (``PauseGeneration``; in-flight requests end interrupted and
   resume later from their partial output). The call returns without waiting for the decode
   step in progress: that step ends while the weights travel, and the server swaps them in
   only after it;
2. ``PublishWeights`` on every trainer rank at once (the full-parameter gather is collective;
   rank 0 sends, by the method each server negotiated);
3. confirm: each server must report the published version (``GetRolloutStatus``);
4. resume the servers that took the update.

A server whose transfer failed for a passing reason (not a refusal) and that still answers is
retried once in a second ``PublishWeights`` without the others: when one member of a
DISTRIBUTED weight group dies mid-update, the trainer breaks the group off at once and the
survivors get the version in the second round.

A rollout server that fails any step is reported in ``failed_servers`` (with the reason) and
left paused, serving its old weights, for the coordinator to take out of rotation; the others
go on. With ``health_timeout_s``, a pause, confirm or resume call that takes that long is
raced against the server's health check: a server that fails it too (frozen, partitioned) is
given up on then, not after ``control_timeout_s``; one that is merely busy passes it and is
waited for. A trainer failure (a rank unreachable or refusing) fails the whole update with
:class:`FleetUpdateError` after resuming every paused server on its old weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from arealgrpc.v1 import (
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weight_sync_pb2,
)
from google.rpc import status_pb2

from areal_grpc.durations import duration, seconds
from areal_grpc.errors import REFUSALS, UnavailableError, code_of, describe, status_proto_of
from areal_grpc.launch import ROLLOUT_SERVICE, check_health
from areal_grpc.server import ChannelCache

log = logging.getLogger(__name__)

T = TypeVar("T")

METHODS: dict[str, int] = {
    "distributed": weight_sync_pb2.TRANSFER_METHOD_DISTRIBUTED,
    "stream": weight_sync_pb2.TRANSFER_METHOD_STREAM,
    "disk": weight_sync_pb2.TRANSFER_METHOD_DISK,
    "socket": weight_sync_pb2.TRANSFER_METHOD_SOCKET,
    "shared_memory": weight_sync_pb2.TRANSFER_METHOD_SHARED_MEMORY,
}


class FleetUpdateError(RuntimeError):
    """The trainer side of a fleet update failed; no server changed version."""


@dataclass
class ServerUpdate:
    """What happened to one rollout server."""

    address: str
    ok: bool = False
    # A METHODS name, or "" when no transfer happened.
    method: str = ""
    # The failure's code (OK while none) and what failed, e.g. "confirm: UNAVAILABLE: ...".
    code: grpc.StatusCode = grpc.StatusCode.OK
    error: str = ""
    policy_version: int = 0
    sent_bytes: int = 0

    def fail(self, code: grpc.StatusCode, error: str) -> None:
        """Records a failure (``code`` decides whether the update is retried)."""
        self.code = code
        self.error = error

    def fail_with(self, st: status_pb2.Status, step: str = "") -> None:
        """Records the failure ``st`` of ``step`` (e.g. ``"pause: "``)."""
        self.fail(code_of(st), f"{step}{describe(st)}")


@dataclass
class FleetUpdateResult:
    """Outcome of one fleet update."""

    # The version published (the trainer's version after its last step).
    version: int
    # Servers now serving ``version`` and resumed.
    updated_servers: list[str] = field(default_factory=list)
    # Servers that failed (left paused on their old weights): take them out of rotation.
    failed_servers: list[str] = field(default_factory=list)
    # Per server, in the order given.
    servers: list[ServerUpdate] = field(default_factory=list)
    elapsed_s: float = 0.0
    # Bytes of tensor data in the published state dict.
    total_bytes: int = 0
    # Seconds PublishWeights took on trainer rank 0 (gather + transfer + server swap).
    publish_elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every server took the update."""
        return not self.failed_servers


def _method_name(value: int) -> str:
    for name, v in METHODS.items():
        if v == value:
            return name
    return ""


def _error(exc: BaseException) -> str:
    return describe(status_proto_of(exc))


async def _each(
    addresses: Sequence[str], fn: Callable[[str], Awaitable[T]]
) -> list[T | BaseException]:
    return list(await asyncio.gather(*(fn(a) for a in addresses), return_exceptions=True))


async def _answer_or_stall(call: Awaitable[T], address: str, health_timeout_s: float | None) -> T:
    """Awaits a control call; with ``health_timeout_s``, each time that passes without an
    answer the server's health is checked, and a server that fails that check too is given
    up on (UnavailableError) rather than waited for until the call's own deadline."""
    task = asyncio.ensure_future(call)
    if health_timeout_s is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=health_timeout_s)
            if done:
                return task.result()
            state = await check_health(address, ROLLOUT_SERVICE, health_timeout_s)
            if task.done():
                return task.result()
            if state != "SERVING":
                raise UnavailableError(
                    f"no answer after {health_timeout_s:g} s and the health check failed "
                    f"({state}): the server is not responding"
                )
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def update_fleet_weights(
    trainer_addresses: Sequence[str],
    rollout_addresses: Sequence[str],
    *,
    methods: Sequence[str] = (),
    timeout_s: float = 600.0,
    bucket_bytes: int = 0,
    control_timeout_s: float = 30.0,
    health_timeout_s: float | None = None,
    channels: ChannelCache | None = None,
) -> FleetUpdateResult:
    """Pause all rollout servers, publish from every trainer rank, confirm, resume.

    ``methods`` is the preference order offered to each server (empty: the trainer's order for
    its device); ``bucket_bytes`` 0 uses the trainer's default. Pause, status and resume
    calls each get ``control_timeout_s``, but never more than ``timeout_s``: a server that
    stalls gets the update's own deadline; with ``health_timeout_s`` one that also fails a
    health check is given up on sooner (see the module doc).
    ``channels``: where the calls take their channels, kept for the next update (None: made
    for this one and closed after it).
    Raises ValueError for bad arguments and :class:`FleetUpdateError` when a trainer rank
    fails (after resuming the paused servers on their old weights).
    """
    start = time.monotonic()
    control_timeout_s = min(control_timeout_s, timeout_s)
    if not trainer_addresses:
        raise ValueError("trainer_addresses must not be empty")
    if len(set(rollout_addresses)) != len(rollout_addresses):
        raise ValueError("rollout_addresses lists a server twice")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods must be a subset of {sorted(METHODS)}: {unknown}")
    servers = {a: ServerUpdate(a) for a in rollout_addresses}
    kept = channels if channels is not None else ChannelCache()
    kept.prune()
    try:
        rollout = {a: rollout_pb2_grpc.RolloutServiceStub(kept.get(a)) for a in rollout_addresses}

        def control(a: str, call: Awaitable[T]) -> Awaitable[T]:
            return _answer_or_stall(call, a, health_timeout_s)

        # 1. pause
        async def pause(a: str) -> rollout_pb2.PauseGenerationResponse:
            return await control(
                a,
                # Not waiting for the decode step in progress: it ends while the trainer
                # gathers and sends, and the server swaps only after it.
                rollout[a].PauseGeneration(
                    rollout_pb2.PauseGenerationRequest(return_immediately=True),
                    timeout=control_timeout_s,
                ),
            )

        async def resume(a: str) -> rollout_pb2.ResumeGenerationResponse:
            return await control(
                a,
                rollout[a].ResumeGeneration(
                    rollout_pb2.ResumeGenerationRequest(), timeout=control_timeout_s
                ),
            )

        paused: list[str] = []
        for a, reply in zip(rollout_addresses, await _each(rollout_addresses, pause), strict=True):
            if isinstance(reply, BaseException):
                servers[a].fail_with(status_proto_of(reply), "pause: ")
            else:
                servers[a].policy_version = reply.policy_version
                paused.append(a)

        # 2. publish on every rank at once, to the servers that paused
        async def publish_to(
            targets: list[str], first: bool = True
        ) -> list[trainer_pb2.PublishWeightsResponse]:
            request = trainer_pb2.PublishWeightsRequest(
                rollout_addresses=targets,
                methods=[METHODS[m] for m in methods],
                bucket_bytes=bucket_bytes,
                timeout=duration(timeout_s),
            )

            async def publish(a: str) -> trainer_pb2.PublishWeightsResponse:
                stub = trainer_pb2_grpc.TrainerServiceStub(kept.get(a))
                return await stub.PublishWeights(request, timeout=timeout_s + control_timeout_s)

            replies = await _each(trainer_addresses, publish)
            bad = [
                f"{a}: {_error(r)}"
                for a, r in zip(trainer_addresses, replies, strict=True)
                if isinstance(r, BaseException)
            ]
            if bad and not first:
                # Servers of the first round may already serve the new version: only the
                # retried ones fail.
                for a in targets:
                    servers[a].fail(
                        grpc.StatusCode.UNAVAILABLE,
                        f"retry: PublishWeights failed: {'; '.join(bad)}",
                    )
                return []
            if bad:
                await _each(paused, resume)
                raise FleetUpdateError(
                    f"PublishWeights failed on trainer rank(s): {'; '.join(bad)}"
                )
            ranks = [r for r in replies if not isinstance(r, BaseException)]
            lead = next((r for r in ranks if r.results), ranks[0])
            for res in lead.results:
                s = servers.get(res.address)
                if s is None or res.address not in targets:
                    continue
                s.method = _method_name(res.method)
                s.sent_bytes = res.sent_bytes
                s.policy_version = res.policy_version
                if res.status.code:
                    s.fail_with(res.status)
                else:  # a server retried after failing the first round
                    s.code, s.error = grpc.StatusCode.OK, ""
            for a in targets:
                if not any(res.address == a for res in lead.results) and not servers[a].error:
                    servers[a].fail(grpc.StatusCode.INTERNAL, "no result from the trainer")
            return [lead, *ranks]

        lead, *ranks = await publish_to(paused)
        version = ranks[0].policy_version
        publish_elapsed = seconds(lead.elapsed)

        async def status(a: str) -> rollout_pb2.GetRolloutStatusResponse:
            return await control(
                a,
                rollout[a].GetRolloutStatus(
                    rollout_pb2.GetRolloutStatusRequest(), timeout=control_timeout_s
                ),
            )

        # 2b. a transfer that failed for a passing reason (typically a weight group that broke
        # because another member died) is retried once, without the servers that no longer
        # answer: those are found dead here instead of failing the others until a timeout.
        failed = [a for a in paused if servers[a].error and servers[a].code not in REFUSALS]
        retry = []
        for a, st in zip(failed, await _each(failed, status), strict=True):
            if isinstance(st, BaseException):
                servers[a].error += f"; then unreachable: {_error(st)}"
            elif st.policy_version < version:
                retry.append(a)
        if retry:
            log.warning(
                "retrying the weight update of %s: %s", retry, [servers[a].error for a in retry]
            )
            again = await publish_to(retry, first=False)
            publish_elapsed += seconds(again[0].elapsed) if again else 0.0

        # 3. confirm the version each server now serves
        candidates = [a for a in paused if not servers[a].error]

        for a, st in zip(candidates, await _each(candidates, status), strict=True):
            if isinstance(st, BaseException):
                servers[a].fail_with(status_proto_of(st), "confirm: ")
            elif st.policy_version != version:
                servers[a].fail(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"confirm: serves version {st.policy_version}, expected {version}",
                )
            else:
                servers[a].policy_version = st.policy_version

        # 4. resume the servers that took the update
        good = [a for a in candidates if not servers[a].error]
        for a, r in zip(good, await _each(good, resume), strict=True):
            if isinstance(r, BaseException):
                servers[a].fail_with(status_proto_of(r), "resume: ")
            else:
                servers[a].ok = True
        result = FleetUpdateResult(
            version=version,
            updated_servers=[a for a in rollout_addresses if servers[a].ok],
            failed_servers=[a for a in rollout_addresses if not servers[a].ok],
            servers=[servers[a] for a in rollout_addresses],
            elapsed_s=time.monotonic() - start,
            total_bytes=ranks[0].total_bytes,
            publish_elapsed_s=publish_elapsed,
        )
        for s in result.servers:
            if not s.ok:
                log.warning("weight update of %s failed: %s", s.address, s.error)
        return result
    finally:
        if channels is None:
            await kept.aclose()


__all__ = [
    "METHODS",
    "FleetUpdateError",
    "FleetUpdateResult",
    "ServerUpdate",
    "update_fleet_weights",
]
