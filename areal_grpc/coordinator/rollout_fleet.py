"""The rollout fleet: the servers the run sends episodes to, their streams and their care.

A submitter sends prompts over one long-lived ``RunEpisodes`` stream per server in rotation
(least-loaded first) while the pool's staleness capacity is positive; one reader per stream
files results into the pool. A server whose stream breaks, whose health check fails, or that
holds a task past ``fault_tolerance.rollout.episode_timeout_s`` leaves rotation
(:meth:`RolloutFleet.take_out`),
its tasks are re-queued, and it is brought back once it serves again, through ``join`` (the
weight-sync orchestration brings it to the run's version). One the run's launcher started is
replaced instead when its process is gone or it stays out of rotation for
``fault_tolerance.rollout.replace_after_s`` (at most ``fault_tolerance.rollout.max_restarts``
times per run). With no server in rotation for ``fault_tolerance.rollout.no_server_timeout_s``
the run fails (:class:`RolloutFleetLost`).

Clients come from ``client_factory`` and health answers from ``health``, so the fleet can run
against in-process fakes in unit tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from areal_clients.rollout import RolloutClient, item_struct
from arealgrpc.v1 import common_pb2, rollout_pb2
from google.protobuf import struct_pb2

from areal_grpc import tracing
from areal_grpc.config import RunConfig
from areal_grpc.coordinator.mesh import FleetLauncher
from areal_grpc.coordinator.pool import Work, WorkPool
from areal_grpc.errors import FieldError, PreconditionError, explain
from areal_grpc.launch import ROLLOUT_SERVICE, HealthCheck, check_health
from areal_grpc.server_config import max_new_tokens

__all__ = [
    "Endpoint",
    "EpisodeSettings",
    "EpisodesFailing",
    "RolloutFleet",
    "RolloutFleetLost",
    "RolloutLike",
    "RolloutReport",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Warnings while no rollout server is in rotation come this often.
NO_SERVER_WARN_EVERY_S = 30.0
# Back-off before restart n (1-based) of a rollout server: 1 s, 2 s, 4 s, ... up to this.
RESTART_BACKOFF_MAX_S = 30.0
# SIGTERM to SIGKILL for a server being replaced: it is dead or has not answered for
# fault_tolerance.rollout.replace_after_s, and its work was re-queued when it left rotation, so
# there is nothing to drain (a frozen process would only use up a longer grace).
REPLACE_GRACE_S = 2.0


class RolloutFleetLost(RuntimeError):
    """No rollout server was in rotation for ``fault_tolerance.rollout.no_server_timeout_s``."""


class EpisodesFailing(RolloutFleetLost):
    """``fault_tolerance.rollout.max_failed_episodes`` episodes in a row failed in the run's
    own code: the run cannot make progress (the same error on every episode would otherwise go
    through the dataset forever, flooding the log). A server or engine that dies fails no
    episode: its stream ends UNAVAILABLE and its tasks are run again elsewhere."""


class StreamLike(Protocol):
    """What the fleet needs of one ``RunEpisodes`` stream (:class:`EpisodeStream` has it)."""

    def submit(self, task: rollout_pb2.EpisodeTask) -> None: ...

    def abort(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[rollout_pb2.RunEpisodesResponse]: ...


class RolloutLike(Protocol):
    """What the fleet needs of one server's client (:class:`RolloutClient` has it)."""

    address: str

    async def status(self, timeout_s: float = ...) -> rollout_pb2.GetRolloutStatusResponse: ...

    def episodes(self) -> StreamLike: ...

    async def close(self) -> None: ...


@dataclass
class RolloutReport:
    """A rollout server's state, for status replies."""

    # "serving" (in rotation), "joining" (being brought to the run's version), "restarting"
    # (being replaced) or "down" (out of rotation).
    state: str
    # The version it was last brought to (-1 unless serving).
    policy_version: int
    # Times the server at this place in the fleet was replaced.
    restarts: int


@dataclass
class Endpoint:
    """One rollout server as the fleet sees it."""

    address: str
    client: RolloutLike
    stream: StreamLike | None = None
    reader: asyncio.Task[None] | None = None
    healthy: bool = False
    # Added mid-run; enters rotation once it serves the run's version.
    joining: bool = False
    # Being replaced by a fresh server (see RolloutFleet._replace).
    restarting: bool = False
    # Times the server at this place in the fleet was replaced (carried to the replacement).
    restarts: int = 0
    # The task bringing it back into rotation (see RolloutFleet.bring_back).
    reconnect: asyncio.Task[None] | None = None

    @property
    def in_rotation(self) -> bool:
        """Takes episodes: healthy, with an open stream."""
        return self.healthy and self.stream is not None

    def cut(self) -> None:
        """Aborts its stream, if any (its reader sees the stream is gone and files nothing)."""
        if self.stream is not None:
            self.stream.abort()
            self.stream = None


@dataclass(frozen=True)
class EpisodeSettings:
    """What every episode task of the run carries (the evaluator sends the same)."""

    workflow: str
    workflow_params: struct_pb2.Struct
    sampling: common_pb2.SamplingParams
    group_size: int

    @classmethod
    def of(cls, cfg: RunConfig) -> EpisodeSettings:
        """The run's settings from its config."""
        params = struct_pb2.Struct()
        params.update({"reward_fn": cfg.rollout.reward, "chat_template": cfg.rollout.chat_template})
        if cfg.rollout.system_prompt is not None:
            params.update({"system_prompt": cfg.rollout.system_prompt})
        sampling = common_pb2.SamplingParams(
            temperature=cfg.rollout.sampling.temperature,
            top_p=cfg.rollout.sampling.top_p,
            top_k=cfg.rollout.sampling.top_k,
            max_new_tokens=max_new_tokens(cfg),
        )
        return cls(cfg.rollout.workflow, params, sampling, cfg.staleness.group_size)


# (the endpoint) -> whether it now serves the run's version (then it is in rotation).
JoinFn = Callable[[Endpoint], Awaitable[bool]]


class RolloutFleet:
    """The run's rollout servers: rotation, submission, supervision (see the module doc)."""

    def __init__(
        self,
        cfg: RunConfig,
        pool: WorkPool,
        addresses: Sequence[str],
        episode: EpisodeSettings,
        *,
        launcher: FleetLauncher | None = None,
        on_replaced: Callable[[str, str | None], None] | None = None,
        client_factory: Callable[[str], RolloutLike] = RolloutClient,
        health: HealthCheck = check_health,
    ) -> None:
        """``launcher`` replaces servers it started that die (None, attach mode: a server is
        waited for until it serves again); ``on_replaced(old, new)`` is called after a server
        was replaced (``new`` None: it is gone for good), e.g. to rewrite mesh.json."""
        self.cfg = cfg.fault_tolerance.rollout
        self.pool = pool
        self.episode = episode
        self.launcher = launcher
        self.on_replaced = on_replaced
        self._client = client_factory
        self._health = health
        self.endpoints = [Endpoint(a, client_factory(a)) for a in addresses]
        # Brings a server back to the run's version; set by the coordinator (the weight-sync
        # orchestration owns how).
        self.join: JoinFn | None = None
        # Called with a record when a server was replaced (the run's metrics).
        self.on_restart: Callable[[dict[str, Any]], None] | None = None
        # Submissions pause while weights are synced (AReaL: rollout.pause() before the
        # update, resume() after the version bump).
        self.open = asyncio.Event()
        self.stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self.restarts = 0
        # Servers replaced for good (restarts spent): address -> restarts, for status.
        self.lost: dict[str, int] = {}
        # Set (with the error) when the run cannot go on: no server for too long.
        self._fatal = asyncio.Event()
        self._fatal_error: BaseException | None = None
        # Set (with the error) when the trainer group failed while bringing a server back:
        # the step waiting for rollouts raises it, so that the group is recovered (with no
        # server in rotation no step reaches the ranks to find out otherwise).
        self._trainers_failed = asyncio.Event()
        self._trainers_error: BaseException | None = None
        # Episodes that failed since the last accepted one (see max_failed_episodes).
        self.failed_in_a_row = 0

    # -- membership --------------------------------------------------------------------------

    async def connect(self) -> list[int]:
        """Reads the servers' vocabulary size into the pool (all must agree); their versions."""
        statuses = await asyncio.gather(*(e.client.status() for e in self.endpoints))
        vocab = {s.vocab_size for s in statuses}
        if len(vocab) != 1:
            raise RuntimeError(f"rollout servers disagree on the vocabulary size: {vocab}")
        self.pool.vocab_size = vocab.pop()
        for e in self.endpoints:
            e.healthy = True
        return [s.policy_version for s in statuses]

    def find(self, address: str) -> Endpoint | None:
        """The endpoint at ``address``, if it is in the fleet."""
        return next((e for e in self.endpoints if e.address == address), None)

    async def add(self, address: str) -> None:
        """Adds a server mid-run; it enters rotation once it serves the run's version."""
        if self.find(address) is not None:
            raise PreconditionError(f"rollout server {address} is already in the mesh")
        client = self._client(address)
        try:
            st = await client.status(timeout_s=5.0)
        except grpc.aio.AioRpcError as exc:
            await client.close()
            raise PreconditionError(
                f"rollout server {address} is unreachable: {exc.code().name}"
            ) from exc
        if self.pool.vocab_size is not None and st.vocab_size != self.pool.vocab_size:
            await client.close()
            raise FieldError(
                "address", f"server vocabulary {st.vocab_size} != the run's {self.pool.vocab_size}"
            )
        ep = Endpoint(address, client, joining=True)
        self.endpoints.append(ep)
        if self._tasks and not self.stopping:
            # Brought to the run's version now (not at the next step: with no server in
            # rotation there might be no next step); retried until it works.
            self.bring_back(ep, delay_s=0.0)

    async def remove(self, address: str) -> int:
        """Takes a server out of the mesh; returns how many tasks were re-queued."""
        ep = self.find(address)
        if ep is None:
            return 0
        self.endpoints.remove(ep)
        ep.healthy = False
        ep.cut()
        requeued = sum(self.pool.requeue(t) for t in self.pool.running_on(address))
        await ep.client.close()
        return requeued

    def report(self, address: str) -> RolloutReport | None:
        """State, version and restart count of a server; None if unknown."""
        ep = self.find(address)
        if ep is None:
            if address in self.lost:
                return RolloutReport("down", -1, self.lost[address])
            return None
        if ep.in_rotation:
            return RolloutReport("serving", self.pool.version, ep.restarts)
        state = "restarting" if ep.restarting else "joining" if ep.joining else "down"
        return RolloutReport(state, -1, ep.restarts)

    def in_rotation(self) -> list[Endpoint]:
        """The servers taking episodes now."""
        return [e for e in self.endpoints if e.in_rotation]

    def sync_targets(self) -> list[Endpoint]:
        """The servers a weight update goes to: in rotation, or being brought to the version."""
        return [e for e in self.endpoints if e.healthy or e.joining]

    async def served_versions(self) -> list[int]:
        """Versions the reachable servers serve now."""
        replies = await asyncio.gather(
            *(e.client.status(timeout_s=5.0) for e in self.endpoints), return_exceptions=True
        )
        return [r.policy_version for r in replies if not isinstance(r, BaseException)]

    # -- streams -----------------------------------------------------------------------------

    def episode_task(self, work: Work, server: str) -> rollout_pb2.EpisodeTask:
        """The task that sends ``work`` to ``server``, opening the task's trace."""
        assert work.item is not None
        # The root of the task's trace: the rollout server's episode span and, through the
        # trajectories, the training step's link all hang off it.
        with tracing.span(
            "coordinator.submit",
            attributes={
                tracing.TASK_ID: work.task_id,
                tracing.POLICY_VERSION: self.pool.version,
                tracing.ROLLOUT_SERVER: server,
            },
        ):
            trace_context = tracing.to_proto()
        e = self.episode
        return rollout_pb2.EpisodeTask(
            task_id=work.task_id,
            data=item_struct(work.item),
            workflow=e.workflow,
            workflow_params=e.workflow_params,
            group_size=e.group_size,
            sampling=e.sampling,
            trace_context=trace_context,
        )

    def open_stream(self, ep: Endpoint) -> None:
        """Puts ``ep`` into rotation with a fresh episode stream and its reader."""
        ep.joining = False
        ep.stream = ep.client.episodes()
        ep.healthy = True
        ep.reader = asyncio.create_task(self._read(ep, ep.stream))

    def cut_streams(self) -> None:
        """Cuts every stream (the readers file nothing more); the servers stay healthy."""
        for ep in self.endpoints:
            ep.cut()

    def reopen_streams(self) -> None:
        """Reopens the stream of every healthy server without one."""
        if self.stopping:
            return
        for ep in self.endpoints:
            if ep.healthy and ep.stream is None:
                self.open_stream(ep)

    def level(self, targets: Sequence[Endpoint], failed: Sequence[str]) -> None:
        """After a weight update of ``targets``: those in ``failed`` leave rotation, joining
        ones that took it enter it."""
        for ep in targets:
            if ep.address in failed:
                log.warning("rollout server %s missed version %d", ep.address, self.pool.version)
                # A joining server's own retry loop is running already.
                if not ep.joining:
                    self.take_out(ep)
            elif ep.joining and not self.stopping:
                self.open_stream(ep)

    async def _read(self, ep: Endpoint, stream: StreamLike) -> None:
        """Files one server's results into the pool; on a broken stream re-queues its work."""
        try:
            async for res in stream:
                if ep.stream is not stream:
                    # Taken out of rotation meanwhile: its tasks went back to the queue (and
                    # maybe to another server), so what is still buffered here is not ours.
                    break
                if res.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED:
                    self.failed_in_a_row = 0
                    self.pool.finish(res.task_id, res.group, ep.address)
                elif res.outcome == rollout_pb2.EPISODE_OUTCOME_CANCELLED:
                    self.pool.requeue(res.task_id, ep.address)
                else:
                    if res.outcome == rollout_pb2.EPISODE_OUTCOME_FAILED:
                        log.warning(
                            "episode %s failed on %s: %s", res.task_id, ep.address, res.reason
                        )
                        self.episode_failed(ep.address, res.reason)
                    self.pool.reject(res.task_id, res.reason or "rejected", ep.address)
        except grpc.aio.AioRpcError as exc:
            if not self.stopping:
                log.warning("rollout server %s: stream broke: %s", ep.address, exc.code().name)
        if self.stopping:
            return
        # The stream is gone: its tasks will never report.
        if ep.stream is stream:
            self.take_out(ep)

    def episode_failed(self, address: str, reason: str) -> None:
        """Counts a failed episode; at ``max_failed_episodes`` in a row the run stops with
        :class:`EpisodesFailing`, naming the last error."""
        self.failed_in_a_row += 1
        if self.failed_in_a_row >= self.cfg.max_failed_episodes and not self._fatal.is_set():
            self._fatal_error = EpisodesFailing(
                f"{self.failed_in_a_row} episodes in a row failed in the run's own code (its "
                "workflow, reward or dataset items: rollout.workflow, rollout.reward, data) and "
                f"none was accepted; the last, on {address}: {reason} (the rollout server's log "
                "has the traceback)"
            )
            self._fatal.set()

    def take_out(self, ep: Endpoint) -> None:
        """Leaves a server out of rotation, re-queues its tasks, and tries to bring it back."""
        ep.healthy = False
        ep.cut()
        for task_id in self.pool.running_on(ep.address):
            self.pool.requeue(task_id, ep.address)
        if ep in self.endpoints and not self.stopping:
            self.bring_back(ep)

    # -- the background tasks ----------------------------------------------------------------

    def start(self, restart: bool = False) -> None:
        """Opens a stream to every server in rotation; starts the submitter and the watchdog."""
        self.stopping = False
        for ep in self.endpoints:
            if ep.healthy and ep.stream is None:
                self.open_stream(ep)
            elif restart and not ep.healthy:
                # Its retry loop ended with the rollouts that stopped.
                self.bring_back(ep)
        self.open.set()
        self._tasks.append(asyncio.create_task(self._submit_loop()))
        self._tasks.append(asyncio.create_task(self._watch()))

    async def stop(self) -> None:
        """Ends the background tasks and the episode streams (in-flight work is cancelled)."""
        self.stopping = True
        self.open.set()
        self.cut_streams()
        tasks = [t for t in self._tasks if not t.done()]
        tasks += [ep.reader for ep in self.endpoints if ep.reader is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        for ep in self.endpoints:
            ep.reader = None

    async def _submit_loop(self) -> None:
        """Sends prompts to the least-loaded server in rotation while capacity allows."""
        while not self.stopping:
            await self.open.wait()
            if self._fatal.is_set():
                # The run is ending (unless_lost raises in its step): nothing more to send,
                # which also lets an evaluation in progress finish on idle servers.
                return
            live = self.in_rotation()
            if not live:
                await self.pool.wait_change(0.5)
                continue
            load = Counter(w.producer for w in self.pool.running.values())
            lowest = min(load[e.address] for e in live)
            candidates = [e for e in live if load[e.address] == lowest]
            target = candidates[self.pool.rng.randrange(len(candidates))]
            work = self.pool.claim(target.address)
            if work is None:
                await self.pool.wait_change(1.0)
                continue
            assert target.stream is not None
            target.stream.submit(self.episode_task(work, target.address))

    async def _watch(self) -> None:
        """Takes stalled servers out of rotation so their work moves elsewhere.

        A server that stops answering (hung, frozen, partitioned) does not break its stream,
        so without this its tasks would wait forever. Stalled means: a task of ours ran past
        ``fault_tolerance.rollout.episode_timeout_s``, or its health check failed or did not
        answer within ``fault_tolerance.rollout.health_timeout_s`` (every
        ``fault_tolerance.rollout.health_interval_s``; 0: no checks).
        """
        r = self.cfg
        tick = min(1.0, r.health_interval_s) if r.health_interval_s > 0 else 1.0
        last_check = time.monotonic()
        # (when the fleet was first seen with no server in rotation, when that was last said)
        empty: tuple[float, float] | None = None
        while not self.stopping:
            await asyncio.sleep(tick)
            # While a weight sync or a recovery runs, the servers are paused on purpose.
            if not self.open.is_set():
                empty = None
                continue
            empty = self._check_left(empty)
            for ep in self.in_rotation():
                overdue = self.pool.overdue_on(ep.address, r.episode_timeout_s)
                if overdue:
                    log.warning(
                        "rollout server %s held %d task(s) past "
                        "fault_tolerance.rollout.episode_timeout_s=%g (e.g. %s): taking it out "
                        "of rotation, its work is re-queued",
                        ep.address,
                        len(overdue),
                        r.episode_timeout_s,
                        overdue[0],
                    )
                    self.take_out(ep)
            if r.health_interval_s <= 0 or time.monotonic() - last_check < r.health_interval_s:
                continue
            last_check = time.monotonic()
            live = self.in_rotation()
            states = await asyncio.gather(
                *(self._health(e.address, ROLLOUT_SERVICE, r.health_timeout_s) for e in live)
            )
            for ep, state in zip(live, states, strict=True):
                # Re-checked: the answer took a while, and the server may have been taken out
                # (or a sync may have started) meanwhile.
                if state != "SERVING" and ep in self.in_rotation() and self.open.is_set():
                    log.warning(
                        "rollout server %s failed its health check (%s): taking it out of "
                        "rotation, its work is re-queued",
                        ep.address,
                        state,
                    )
                    self.take_out(ep)

    def _check_left(self, empty: tuple[float, float] | None) -> tuple[float, float] | None:
        """Warns while no server is in rotation; fails the run after the timeout.

        ``empty``: (since when no server was in rotation, when that was last logged), None
        while one is; returns the new value. Without this a run whose servers are all gone
        would wait for a batch forever.
        """
        if self.in_rotation():
            if empty is not None:
                log.info("a rollout server is in rotation again")
            return None
        timeout_s = self.cfg.no_server_timeout_s
        now = time.monotonic()
        since, said = empty if empty is not None else (now, -math.inf)
        elapsed = now - since
        if now - said >= NO_SERVER_WARN_EVERY_S:
            said = now
            waiting = [
                f"{e.address} ({'restarting' if e.restarting else 'down'})" for e in self.endpoints
            ]
            log.warning(
                "no rollout server in rotation for %.0f s (%s); the run fails after "
                "fault_tolerance.rollout.no_server_timeout_s=%g",
                elapsed,
                ", ".join(waiting) or "none left in the mesh",
                timeout_s,
            )
        if elapsed >= timeout_s and not self._fatal.is_set():
            self._fatal_error = RolloutFleetLost(
                f"no rollout server was in rotation for {elapsed:.0f} s "
                f"(fault_tolerance.rollout.no_server_timeout_s={timeout_s:g}; {self.restarts} "
                f"of fault_tolerance.rollout.max_restarts={self.cfg.max_restarts} restart(s) "
                "used; out: "
                f"{[*sorted(self.lost), *(e.address for e in self.endpoints)]})"
            )
            self._fatal.set()
        return since, said

    def trainer_group_failed(self, error: BaseException) -> None:
        """The trainer group failed outside a step (see :meth:`unless_lost`)."""
        self._trainers_error = error
        self._trainers_failed.set()

    def clear_trainer_failure(self) -> None:
        """Forgets a reported trainer group failure (a recovery is under way)."""
        self._trainers_error = None
        self._trainers_failed.clear()

    async def unless_lost(self, call: Awaitable[T]) -> T:
        """Awaits ``call``, unless the fleet is lost meanwhile (then raises
        :class:`RolloutFleetLost`) or the trainer group failed while bringing a server back
        (then raises that failure, for the caller's recovery)."""
        task = asyncio.ensure_future(call)
        fatal = asyncio.ensure_future(self._fatal.wait())
        trainers = asyncio.ensure_future(self._trainers_failed.wait())
        try:
            await asyncio.wait({task, fatal, trainers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, fatal, trainers):
                # Cancelled until it is done: asyncio.wait_for before Python 3.12 may swallow
                # a cancel that arrives as its inner wait completes (the pool's wait_change,
                # whose event fires on every result), and the call would then run on forever.
                while not t.done():
                    t.cancel()
                    await asyncio.wait({t}, timeout=1.0)
        if task.done() and not task.cancelled():
            return task.result()
        if self._fatal_error is not None and self._fatal.is_set():
            raise self._fatal_error
        error = self._trainers_error
        assert error is not None
        self.clear_trainer_failure()
        raise error

    # -- bringing servers back ---------------------------------------------------------------

    def bring_back(self, ep: Endpoint, delay_s: float = 1.0) -> None:
        """Starts :meth:`_reconnect` for ``ep`` unless one runs already (one per server, or
        two could each replace it)."""
        if ep.reconnect is None or ep.reconnect.done():
            ep.reconnect = asyncio.create_task(self._reconnect(ep, delay_s))
            self._tasks.append(ep.reconnect)

    async def _reconnect(self, ep: Endpoint, delay_s: float = 1.0) -> None:
        """Waits until ``ep`` serves again, then brings it back (retrying every second).

        A server the launcher started is replaced instead (:meth:`_replace`) once its process
        is gone, or when it has not come back within ``fault_tolerance.rollout.replace_after_s``.
        """
        down_since = time.monotonic()
        spent_logged = False
        while not self.stopping and ep in self.endpoints:
            await asyncio.sleep(delay_s)
            delay_s = 1.0
            state = await self._health(ep.address, ROLLOUT_SERVICE, 2.0)
            if state == "SERVING":
                log.info("rollout server %s is back; bringing it to the run's version", ep.address)
                ep.joining = True
                if self.join is not None and await self.join(ep):
                    return
            fleet = self.launcher
            if fleet is None or not fleet.owns(ep.address):
                continue  # not ours to restart: its owner may bring it back
            gone = not await asyncio.to_thread(fleet.alive, ep.address)
            replace_after_s = self.cfg.replace_after_s
            if not gone and time.monotonic() - down_since < replace_after_s:
                continue
            if gone:
                cause = "its process is gone"
            else:
                cause = f"out of rotation for {replace_after_s:g} s (health {state})"
            if self.restarts < self.cfg.max_restarts:
                await self._replace(ep, fleet, cause)
                return
            if not spent_logged:
                spent_logged = True
                log.error(
                    "rollout server %s is down (%s) and fault_tolerance.rollout.max_restarts=%d "
                    "restart(s) are spent: the run goes on without it",
                    ep.address,
                    cause,
                    self.cfg.max_restarts,
                )
            if gone:
                # Nothing left to wait for: reap it and leave the mesh.
                await self._retire(ep, fleet)
                return

    async def _retire(self, ep: Endpoint, fleet: FleetLauncher, stop: bool = True) -> None:
        """Takes a dead server of the launcher out of the mesh, stopping (reaping) it unless
        ``stop`` is False (stopped already)."""
        if ep in self.endpoints:
            self.endpoints.remove(ep)
        self.lost[ep.address] = ep.restarts
        if stop:
            try:
                await asyncio.to_thread(fleet.stop_rollout_server, ep.address)
            except Exception as exc:
                log.warning("stopping rollout server %s: %s", ep.address, explain(exc))
        await ep.client.close()
        if self.on_replaced is not None:
            self.on_replaced(ep.address, None)

    async def _replace(self, ep: Endpoint, fleet: FleetLauncher, cause: str) -> None:
        """Stops a dead or stuck server and starts a fresh one in its place.

        The replacement joins like :meth:`add`'s: it is brought to the run's version before
        it takes work. Starts are retried with back-off while
        ``fault_tolerance.rollout.max_restarts`` (counted over the run) allows; then the
        server is retired.
        """
        old = ep.address
        max_restarts = self.cfg.max_restarts
        ep.restarting = True
        ep.joining = False
        # Its tasks were re-queued when it left rotation (take_out).
        try:
            await asyncio.to_thread(fleet.stop_rollout_server, old, REPLACE_GRACE_S)
        except Exception as exc:
            log.warning("stopping rollout server %s: %s", old, explain(exc))
        new: str | None = None
        while new is None and self.restarts < max_restarts:
            if self.stopping or ep not in self.endpoints:
                return
            self.restarts += 1
            n = self.restarts
            log.warning(
                "rollout server %s died (%s): restart %d/%d (fault_tolerance.rollout.max_restarts)",
                old,
                cause,
                n,
                max_restarts,
            )
            await asyncio.sleep(min(2.0 ** (n - 1), RESTART_BACKOFF_MAX_S))
            try:
                new = await asyncio.to_thread(fleet.start_rollout_server)
            except Exception as exc:
                cause = f"restart failed: {explain(exc)}"
                log.warning("rollout server %s: %s", old, cause)
        if new is None:
            log.error(
                "rollout server %s is gone and fault_tolerance.rollout.max_restarts=%d "
                "restart(s) are spent: the run goes on without it",
                old,
                max_restarts,
            )
            await self._retire(ep, fleet, stop=False)
            return
        if self.stopping or ep not in self.endpoints:
            # Removed (or the run ended) meanwhile: the new server is not wanted.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(fleet.stop_rollout_server, new)
            return
        fresh = Endpoint(new, self._client(new), joining=True, restarts=ep.restarts + 1)
        self.endpoints[self.endpoints.index(ep)] = fresh
        await ep.client.close()
        log.warning("rollout server %s restarted as %s; it joins at the run's version", old, new)
        if self.on_restart is not None:
            self.on_restart(
                {
                    "old_address": old,
                    "new_address": new,
                    "cause": cause,
                    "restarts": self.restarts,
                    "server_restarts": fresh.restarts,
                }
            )
        if self.on_replaced is not None:
            self.on_replaced(old, new)
        self.bring_back(fresh, delay_s=0.0)

    # -- the end -----------------------------------------------------------------------------

    async def quiesce(self, timeout_s: float = 10.0) -> None:
        """Waits (bounded) until no server is decoding for us any more.

        Our streams are cancelled by then; a server stopped while it is still winding
        cancelled requests down can trip over its own decode loop, so the launcher waits for
        the servers to go idle before it sends SIGTERM.
        """
        deadline = time.monotonic() + timeout_s

        async def idle(ep: Endpoint) -> None:
            while time.monotonic() < deadline:
                try:
                    st = await ep.client.status(timeout_s=2.0)
                except grpc.aio.AioRpcError:
                    return  # gone already: nothing to wait for
                if st.running_requests == 0 and st.running_episodes == 0:
                    return
                await asyncio.sleep(0.05)

        await asyncio.gather(*(idle(e) for e in self.endpoints))

    async def close(self) -> None:
        """Stops the rollouts, waits for the servers to go idle, closes every channel."""
        await self.stop()
        await self.quiesce()
        await asyncio.gather(*(e.client.close() for e in self.endpoints))
