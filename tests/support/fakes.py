"""In-process fakes of the coordinator's collaborators, for its components' unit tests.

The components take their rollout and trainer clients from factories and their health
answers from a callable (see ``Coordinator(rollout_client=, trainer_client=, health=)``);
these stand in for the servers behind them, so requeue, resume and recovery can be tested in
a second instead of through a real mesh. The real-mesh tests (test_faults, test_run,
test_chaos) stay as the integration tests of the same behaviour.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from arealgrpc.v1 import common_pb2, rollout_pb2, trainer_pb2

from areal_grpc.config import RunConfig
from areal_grpc.coordinator.loop import Coordinator
from areal_grpc.coordinator.syncer import SyncOutcome
from areal_grpc.trajectory import make_group

VOCAB = 64
# A unit run takes about a second; one that stalls fails after this.
RUN_TIMEOUT_S = 60.0


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    """What a failed call raises in a real client."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_END = object()


@dataclass
class FakeRollout:
    """One rollout server: answers each task with a group generated at its version."""

    address: str
    version: int = 0
    # Health answer; False also makes status calls fail (the process is unreachable).
    serving: bool = True
    # Takes tasks but never answers them (a hung server whose stream stays open).
    hold: bool = False
    # Task ids received, in order, the version it served when each came, the streams opened.
    received: list[str] = field(default_factory=list)
    received_at: list[int] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)

    def group(self, task: rollout_pb2.EpisodeTask) -> common_pb2.TrajectoryGroup:
        """A valid group for ``task``: rewards differ so the group carries a signal."""
        rewards = [float(i % 2) for i in range(task.group_size)]
        return make_group(task.task_id, rewards, versions=self.version)


class FakeStream:
    """A ``RunEpisodes`` stream of a :class:`FakeRollout`."""

    def __init__(self, server: FakeRollout) -> None:
        self.server = server
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self.aborted = False

    def submit(self, task: rollout_pb2.EpisodeTask) -> None:
        self.server.received.append(task.task_id)
        self.server.received_at.append(self.server.version)
        if self.server.hold:
            return
        self._out.put_nowait(
            rollout_pb2.RunEpisodesResponse(
                task_id=task.task_id,
                outcome=rollout_pb2.EPISODE_OUTCOME_ACCEPTED,
                group=self.server.group(task),
            )
        )

    def abort(self) -> None:
        self.aborted = True
        self._out.put_nowait(rpc_error(grpc.StatusCode.CANCELLED, "aborted by the client"))

    def break_(self) -> None:
        """The connection drops: the reader sees UNAVAILABLE."""
        self._out.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"))

    def __aiter__(self) -> AsyncIterator[rollout_pb2.RunEpisodesResponse]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[rollout_pb2.RunEpisodesResponse]:
        while True:
            item = await self._out.get()
            if isinstance(item, BaseException):
                raise item
            yield item


class FakeRolloutClient:
    """The client side of a :class:`FakeRollout`."""

    def __init__(self, server: FakeRollout) -> None:
        self.server = server
        self.address = server.address

    async def status(self, timeout_s: float = 30.0) -> rollout_pb2.GetRolloutStatusResponse:
        if not self.server.serving:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return rollout_pb2.GetRolloutStatusResponse(
            policy_version=self.server.version, vocab_size=VOCAB
        )

    def episodes(self) -> FakeStream:
        stream = FakeStream(self.server)
        self.server.streams.append(stream)
        return stream

    async def close(self) -> None:
        pass


@dataclass
class FakeRank:
    """One trainer rank; its checkpoints outlive a restart (they are on disk in reality)."""

    address: str
    world_size: int
    version: int = 0
    serving: bool = True
    # How long a TrainStep takes.
    step_s: float = 0.0
    # Steps at which the next TrainStep fails with UNAVAILABLE (each once).
    fail_at_steps: set[int] = field(default_factory=set)
    # (global step, task ids) of every TrainStep, in order.
    trained: list[tuple[int, list[str]]] = field(default_factory=list)
    saved: dict[str, int] = field(default_factory=dict)
    loads: list[tuple[str, int]] = field(default_factory=list)


class FakeTrainerClient:
    """The client side of a :class:`FakeRank`."""

    def __init__(self, rank: FakeRank) -> None:
        self.rank = rank
        self.address = rank.address

    def _check(self) -> None:
        if not self.rank.serving:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")

    async def train_step(
        self,
        global_step: int,
        policy_version: int,
        groups: Sequence[common_pb2.TrajectoryGroup],
        on_progress: Any = None,
        timeout_s: float | None = None,
    ) -> trainer_pb2.StepStats:
        self._check()
        if global_step in self.rank.fail_at_steps:
            self.rank.fail_at_steps.discard(global_step)
            self.rank.serving = False  # the rank died in the step
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "rank died")
        await asyncio.sleep(self.rank.step_s)
        self.rank.trained.append((global_step, [g.task_id for g in groups]))
        self.rank.version = policy_version + 1
        tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
        return trainer_pb2.StepStats(
            policy_version=self.rank.version, trained_tokens=tokens, loss=0.5
        )

    async def save_checkpoint(
        self, path: str, global_step: int, timeout_s: float | None = None
    ) -> trainer_pb2.SaveCheckpointResponse:
        self._check()
        self.rank.saved[path] = self.rank.version
        return trainer_pb2.SaveCheckpointResponse()

    async def load_checkpoint(
        self, path: str, timeout_s: float | None = None, *, min_policy_version: int = 0
    ) -> trainer_pb2.LoadCheckpointResponse:
        self._check()
        self.rank.loads.append((path, min_policy_version))
        self.rank.version = max(self.rank.saved[path], min_policy_version)
        return trainer_pb2.LoadCheckpointResponse(policy_version=self.rank.version)

    async def export_model(
        self, path: str, timeout_s: float | None = None
    ) -> trainer_pb2.ExportModelResponse:
        self._check()
        return trainer_pb2.ExportModelResponse()

    async def status(self, timeout_s: float = 30.0) -> trainer_pb2.GetTrainerStatusResponse:
        self._check()
        return trainer_pb2.GetTrainerStatusResponse(
            policy_version=self.rank.version, ready=True, world_size=self.rank.world_size
        )

    async def close(self) -> None:
        pass


class FakeMesh:
    """Rollout servers and trainer ranks in this process, and the weight sync between them."""

    def __init__(self, rollouts: int = 2, ranks: int = 1) -> None:
        self.rollouts = {f"rollout-{i}": FakeRollout(f"rollout-{i}") for i in range(rollouts)}
        self.ranks = {f"trainer-{i}": FakeRank(f"trainer-{i}", ranks) for i in range(ranks)}
        self.syncs: list[tuple[list[str], int]] = []
        self.restarts = 0
        self._next = itertools.count()

    def rollout_client(self, address: str) -> FakeRolloutClient:
        return FakeRolloutClient(self.rollouts[address])

    def trainer_client(self, address: str) -> FakeTrainerClient:
        return FakeTrainerClient(self.ranks[address])

    async def health(self, address: str, service: str, timeout_s: float) -> str:
        node = self.rollouts.get(address) or self.ranks[address]
        return "SERVING" if node.serving else "UNREACHABLE"

    async def weight_sync(
        self,
        trainers: Sequence[str],
        rollouts: Sequence[str],
        methods: Sequence[str],
        timeout_s: float,
        health_timeout_s: float | None,
    ) -> SyncOutcome:
        """Every live server takes the ranks' version (the fleet protocol's outcome)."""
        versions = {self.ranks[a].version for a in trainers}
        assert len(versions) == 1, versions
        version = versions.pop()
        failed = [a for a in rollouts if not self.rollouts[a].serving]
        for a in rollouts:
            if a not in failed:
                self.rollouts[a].version = version
        self.syncs.append((list(rollouts), version))
        return SyncOutcome(version, failed)

    async def restart_trainers(self, addresses: Sequence[str]) -> list[str]:
        """The launcher's restart: every rank comes back serving (checkpoints kept)."""
        self.restarts += 1
        for a in addresses:
            self.ranks[a].serving = True
        return list(addresses)

    def coordinator(self, cfg: RunConfig, **kwargs: Any) -> Coordinator:
        """A coordinator over this mesh."""
        return Coordinator(
            cfg,
            list(self.rollouts),
            list(self.ranks),
            Path(cfg.output.dir),
            weight_sync=self.weight_sync,
            restart_trainers=self.restart_trainers,
            rollout_client=self.rollout_client,
            trainer_client=self.trainer_client,
            health=self.health,
            **kwargs,
        )

    def run(self, cfg: RunConfig, resume: bool = False, **kwargs: Any) -> Any:
        """Runs a coordinator over this mesh to its end: (result, its pool's statistics).

        Bounded (a run that stops making progress fails the test in a minute, not at the
        suite's timeout).
        """

        async def scenario() -> Any:
            coord = self.coordinator(cfg, **kwargs)
            try:
                result = await asyncio.wait_for(coord.run(resume=resume), RUN_TIMEOUT_S)
                return result, coord.pool.stats
            finally:
                await coord.close()

        return asyncio.run(scenario())

    def trained_task_ids(self) -> list[str]:
        """Task ids rank 0 trained, in order (a recovery's redone steps replace the old)."""
        by_step: dict[int, list[str]] = {}
        for step, ids in next(iter(self.ranks.values())).trained:
            by_step[step] = ids
        return [t for step in sorted(by_step) for t in by_step[step]]
