"""The trainer group as the coordinator sees it: its ranks' clients, its version, its calls.

Every collective call (TrainStep, SaveCheckpoint, LoadCheckpoint, ExportModel) goes to all
ranks at once and is watched (:meth:`TrainerGroup.watched`): a rank that dies breaks its
peers' collectives at once, one that hangs is caught by its failed health check. Which
failures mean "the group is gone" (:meth:`TrainerGroup.is_group_failure`) is decided here;
what is done about it (restart, restore) is :mod:`areal_grpc.coordinator.recovery`'s.

Clients come from ``client_factory`` and health answers from ``health``, so the group can
run against in-process fakes in unit tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from areal_clients.trainer import TrainerClient, on_all_ranks
from arealgrpc.v1 import common_pb2, trainer_pb2

from areal_grpc.config import TrainerSupervision
from areal_grpc.coordinator.pool import Finished
from areal_grpc.dispatch import balance_ratio, dispatch_groups
from areal_grpc.launch import TRAINER_SERVICE, HealthCheck, check_health

__all__ = [
    "RestartTrainers",
    "TrainerGroup",
    "TrainerGroupFailed",
    "TrainerLike",
    "TrainerRankLost",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Status polls in a row (about a second apart, each after gRPC's own retries) that a restarted
# rank may refuse connections before its group is taken as failed.
GONE_AFTER = 3


class TrainerGroupFailed(RuntimeError):
    """The trainer group failed and could not be restarted (see the message for why)."""


class TrainerRankLost(RuntimeError):
    """A trainer rank stopped answering its health checks during a collective call."""


# (current trainer addresses) -> the addresses of a fresh trainer group, once it serves.
RestartTrainers = Callable[[Sequence[str]], Awaitable[list[str]]]

# Codes of a failed collective trainer call that mean the group itself failed (a rank died,
# hung or lost its process group); the others (bad request, version conflict) are our bugs
# and would only recur after a restart.
_GROUP_FAILURE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
    }
)


class TrainerLike(Protocol):
    """What the group needs of one rank's client (:class:`TrainerClient` has it)."""

    address: str

    async def train_step(
        self,
        global_step: int,
        policy_version: int,
        groups: Sequence[common_pb2.TrajectoryGroup],
        on_progress: Any = None,
        timeout_s: float | None = None,
    ) -> trainer_pb2.StepStats: ...

    async def save_checkpoint(
        self, path: str, global_step: int, timeout_s: float | None = None
    ) -> trainer_pb2.SaveCheckpointResponse: ...

    async def load_checkpoint(
        self, path: str, timeout_s: float | None = None, *, min_policy_version: int = 0
    ) -> trainer_pb2.LoadCheckpointResponse: ...

    async def export_model(
        self, path: str, timeout_s: float | None = None
    ) -> trainer_pb2.ExportModelResponse: ...

    async def status(self, timeout_s: float = 30.0) -> trainer_pb2.GetTrainerStatusResponse: ...

    async def close(self) -> None: ...


class TrainerGroup:
    """The ranks of one SPMD trainer group, called together and watched while they work."""

    def __init__(
        self,
        cfg: TrainerSupervision,
        addresses: Sequence[str],
        *,
        restart: RestartTrainers | None = None,
        client_factory: Callable[[str], TrainerLike] = TrainerClient,
        health: HealthCheck = check_health,
        share_prefixes: bool = False,
    ) -> None:
        """``restart`` replaces a failed group (the local launcher's restart); None (attach
        mode) waits for the same addresses to come back, restarted by their own supervisor.
        ``share_prefixes``: the ranks compute each prefix a group shares once, so a group's
        load is its trie's nodes, not its tokens."""
        self.cfg = cfg
        self.share_prefixes = share_prefixes
        self._restart = restart
        self._client = client_factory
        self._health = health
        self.clients: list[TrainerLike] = [client_factory(a) for a in addresses]
        # The ranks' policy version (read from them at the start of a run).
        self.version = 0
        # Collective calls must reach every rank in the same order, or the ranks'
        # collectives would pair up wrongly: one at a time, and a step's TrainStep + weight
        # sync as one unit (callers hold it across both).
        self.lock = asyncio.Lock()
        # Dispatch balance of the last step (max rank tokens / mean), for the metrics.
        self.last_balance = 1.0

    @property
    def addresses(self) -> list[str]:
        """The ranks' addresses, in rank order."""
        return [c.address for c in self.clients]

    async def statuses(self) -> list[trainer_pb2.GetTrainerStatusResponse]:
        """Every rank's status (raises if one does not answer)."""
        return list(await asyncio.gather(*(c.status() for c in self.clients)))

    async def read_version(self) -> int:
        """Reads the ranks' version into :attr:`version`; they must agree."""
        versions = {s.policy_version for s in await self.statuses()}
        if len(versions) != 1:
            raise RuntimeError(f"trainer ranks disagree on the policy version: {versions}")
        self.version = versions.pop()
        return self.version

    async def train_step(self, step: int, batch: Sequence[Finished]) -> trainer_pb2.StepStats:
        """Dispatches ``batch`` over the ranks by what each group computes and runs
        TrainStep on all."""
        counts = [f.prefix_nodes if self.share_prefixes else f.tokens for f in batch]
        plan = dispatch_groups(counts, len(self.clients))
        version = self.version
        stats = await self.watched(
            on_all_ranks(
                self.clients,  # type: ignore[arg-type]
                lambda rank, client: client.train_step(
                    step,
                    version,
                    [batch[i].group for i in plan[rank]],
                    timeout_s=self.cfg.call_timeout_s,
                ),
            )
        )
        self.last_balance = balance_ratio(counts, plan)
        self.version = stats[0].policy_version
        return stats[0]

    async def save_checkpoint(self, path: str, step: int) -> None:
        """Every rank saves its shard under ``path`` (hold :attr:`lock`)."""
        await self.watched(
            on_all_ranks(
                self.clients,  # type: ignore[arg-type]
                lambda rank, c: c.save_checkpoint(path, step, timeout_s=self.cfg.call_timeout_s),
            )
        )

    async def load_checkpoint(self, path: str, min_version: int) -> int:
        """Every rank restores ``path`` and goes on from at least ``min_version``; the version.

        Rollout servers refuse weights that are not newer than theirs, and they may serve
        versions trained after the checkpoint: hence the floor.
        """
        replies = await on_all_ranks(
            self.clients,  # type: ignore[arg-type]
            lambda rank, c: c.load_checkpoint(
                path, timeout_s=self.cfg.call_timeout_s, min_policy_version=min_version
            ),
        )
        versions = {r.policy_version for r in replies}
        if len(versions) != 1:
            raise RuntimeError(f"trainer ranks restored different versions: {versions}")
        self.version = versions.pop()
        return self.version

    async def export(self, path: str) -> None:
        """Rank 0 writes the full model in Hugging Face format under ``path``."""
        async with self.lock:
            await self.watched(
                on_all_ranks(
                    self.clients,  # type: ignore[arg-type]
                    lambda rank, c: c.export_model(path, timeout_s=self.cfg.call_timeout_s),
                )
            )

    async def watched(self, call: Awaitable[T]) -> T:
        """Awaits a collective call while checking that every rank stays alive.

        A rank that dies fails the call at once (its peers' collectives break), but one that
        hangs holds it until the call's deadline: a failed health check ends the call early
        with :class:`TrainerRankLost`.
        """
        task = asyncio.ensure_future(call)
        t = self.cfg
        if t.health_interval_s <= 0:
            return await task
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=t.health_interval_s)
                if done:
                    return task.result()
                ranks = self.addresses
                states = await asyncio.gather(
                    *(self._health(a, TRAINER_SERVICE, t.health_timeout_s) for a in ranks)
                )
                lost = [a for a, st in zip(ranks, states, strict=True) if st != "SERVING"]
                if lost and not task.done():
                    raise TrainerRankLost(
                        f"trainer rank(s) {lost} failed their health check during a collective "
                        f"call (fault_tolerance.trainer.health_timeout_s={t.health_timeout_s:g})"
                    )
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    @staticmethod
    def is_group_failure(exc: BaseException) -> bool:
        """Whether ``exc`` (out of a collective call or a weight sync) means the group failed."""
        if isinstance(exc, TrainerRankLost):
            return True
        if isinstance(exc, grpc.aio.AioRpcError):
            return exc.code() in _GROUP_FAILURE_CODES
        try:
            from areal_clients.fleet import FleetUpdateError
        except ImportError:
            return False
        # Raised only when a trainer rank failed its PublishWeights (rollout servers that
        # fail are reported, not raised).
        return isinstance(exc, FleetUpdateError)

    async def restart(self) -> list[str]:
        """Replaces the group's clients with a fresh group's and waits until it is whole.

        With a restart callback the launcher starts new ranks (maybe at new addresses);
        without one (attach mode) the same addresses are waited for.
        """
        old = self.clients
        await asyncio.gather(*(c.close() for c in old), return_exceptions=True)
        addresses = [c.address for c in old]
        if self._restart is not None:
            addresses = list(await self._restart(addresses))
        self.clients = [self._client(a) for a in addresses]
        await self._await_whole()
        return addresses

    async def _await_whole(self) -> None:
        """Waits until every rank serves, has joined a working group, and is idle.

        Under attach mode the ranks are restarted by their own supervisor; a rank of the old
        group still answers, but reports its broken group (or is stuck in a collective). A
        rank our launcher restarted was listening when the restart returned: one that refuses
        connections ``GONE_AFTER`` polls in a row has died, and the group never forms without
        it, so that fails the group at once instead of at
        ``fault_tolerance.trainer.restart_timeout_s``.
        """
        timeout_s = self.cfg.restart_timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = ""
        refused = [0] * len(self.clients)
        while True:
            replies = await asyncio.gather(
                *(c.status(timeout_s=5.0) for c in self.clients), return_exceptions=True
            )
            problems = []
            for i, (c, r) in enumerate(zip(self.clients, replies, strict=True)):
                refused[i] = (
                    refused[i] + 1
                    if isinstance(r, grpc.aio.AioRpcError)
                    and r.code() == grpc.StatusCode.UNAVAILABLE
                    else 0
                )
                if self._restart is not None and refused[i] >= GONE_AFTER:
                    raise TrainerGroupFailed(
                        f"trainer rank {c.address} refused connections {GONE_AFTER} times in "
                        f"a row after its restart: its process is gone"
                    )
                if isinstance(r, BaseException):
                    problems.append(f"{c.address} unreachable")
                    # A fresh channel tries at once; the old one's reconnect back-off grows
                    # to minutes while the rank is down.
                    await c.close()
                    self.clients[i] = self._client(c.address)
                elif r.broken_reason:
                    problems.append(f"{c.address} broken")
                elif not r.ready or r.busy or r.world_size != len(self.clients):
                    problems.append(f"{c.address} not ready")
            if not problems:
                return
            if time.monotonic() > deadline:
                raise TrainerGroupFailed(
                    "the trainer group did not come back within "
                    f"fault_tolerance.trainer.restart_timeout_s={timeout_s:g} "
                    f"({', '.join(problems)}); under attach mode restart every rank (e.g. "
                    "torchrun --max-restarts)"
                )
            if ", ".join(problems) != waiting:
                waiting = ", ".join(problems)
                log.info("waiting for the trainer group: %s", waiting)
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        """Closes every rank's channel."""
        await asyncio.gather(*(c.close() for c in self.clients))
