"""The coordinator's work pool: what is queued, running, finished and leased, in one place.

Everything runs on one asyncio event loop (the loop's tasks and the CoordinatorService
handlers share it), and no method awaits between reading and changing state, so each method
is one atomic step. The staleness counters always agree with the pool:
``enqueued == len(pending)``, ``running == len(running) + len(leases)``.

Life of a prompt: the loader hands it out when capacity allows (``enqueued``), it is claimed
for a rollout server (``running``), its group comes back (``accepted``, into the buffer) or is
rejected, and a batch takes it from the buffer oldest first (by admission ticket). Work is
never lost: a cancelled task, a dead server or a group that became too stale to train is
re-queued, and a checkpoint holds the queue, the in-flight work (re-queued on resume) and the
finished groups themselves.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from arealgrpc.v1 import common_pb2

from areal_grpc.coordinator.dataloader import PromptLoader
from areal_grpc.errors import FieldError
from areal_grpc.prefixes import prefix_nodes
from areal_grpc.staleness import StalenessManager
from areal_grpc.trajectory import validate_group

__all__ = ["Finished", "Lease", "NoCapacity", "Work", "WorkPool", "head_version"]

log = logging.getLogger(__name__)

STATE_FORMAT = 1


class NoCapacity(RuntimeError):
    """No rollout may start now (staleness or concurrency bound); retry later."""


@dataclass
class Work:
    """A unit of rollout work: one prompt (dataset) or one lease (external)."""

    ticket: int  # admission order; batches take the smallest tickets first
    task_id: str
    seq: int = -1  # position in the dataloader (-1: external)
    epoch: int = 0
    item: dict[str, Any] | None = None
    producer: str = ""  # rollout server address or "external:<producer_id>"
    submit_version: int = 0
    claimed_at: float = 0.0  # time.monotonic() of the last claim (episode deadlines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form for checkpoints."""
        return {
            "ticket": self.ticket,
            "task_id": self.task_id,
            "seq": self.seq,
            "epoch": self.epoch,
            "item": self.item,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Work:
        """Inverse of :meth:`to_dict`."""
        return cls(
            ticket=int(d["ticket"]),
            task_id=str(d["task_id"]),
            seq=int(d["seq"]),
            epoch=int(d["epoch"]),
            item=d.get("item"),
        )


@dataclass
class Finished:
    """An accepted group waiting in the buffer."""

    work: Work
    group: common_pb2.TrajectoryGroup
    head_version: int  # version of the earliest first generated token of the group
    tokens: int

    @cached_property
    def prefix_nodes(self) -> int:
        """Its tokens with each prefix its members share counted once (what a trainer that
        shares prefixes computes)."""
        return prefix_nodes([t.token_ids for t in self.group.trajectories])


@dataclass
class Lease:
    """A lease held by an external producer."""

    work: Work
    producer_id: str
    group_size: int
    version: int
    deadline: float  # time.monotonic()
    wall_deadline: float  # time.time(), for the wire
    rollout_address: str = ""  # the server the producer was told to use


def head_version(group: common_pb2.TrajectoryGroup) -> int:
    """The lowest version of a first generated (loss-mask) token over the group's members.

    AReaL bounds "head off-policyness": staleness is measured at the first generated token.
    A group with no generated token reports a very large version (nothing to be stale).
    """
    heads = []
    for traj in group.trajectories:
        for trained, version in zip(traj.loss_mask, traj.versions, strict=False):
            if trained:
                heads.append(int(version))
                break
    return min(heads) if heads else 1 << 62


def _group_tokens(group: common_pb2.TrajectoryGroup) -> int:
    return sum(len(t.token_ids) for t in group.trajectories)


@dataclass
class PoolStats:
    """Counts beyond the staleness counters, for metrics and status."""

    requeued: int = 0
    dropped_stale: int = 0
    rejected_reasons: Counter[str] = field(default_factory=Counter)


class WorkPool:
    """Queue, running work, leases and the buffer of finished groups, with the staleness rule."""

    def __init__(
        self,
        batch_size: int,
        max_staleness: int,
        max_concurrent_rollouts: int | None = None,
        loader: PromptLoader | None = None,
        *,
        lease_ttl_s: float = 60.0,
        vocab_size: int | None = None,
        seed: int = 0,
        drop_uniform_external: bool = False,
    ) -> None:
        """``drop_uniform_external``: dynamic sampling for external groups (leases, gateway
        sessions): a submitted group whose rewards are all equal is rejected (it has no
        advantage to learn from) and its slot freed for another, as the rollout servers'
        ``nonuniform`` accept filter does for the run's own prompts."""
        # The version provider reads the pool's version, so capacity follows version bumps.
        self.staleness = StalenessManager(
            batch_size, max_staleness, max_concurrent_rollouts, version=lambda: self.version
        )
        self.loader = loader
        self.lease_ttl_s = lease_ttl_s
        self.drop_uniform_external = drop_uniform_external
        self.vocab_size = vocab_size
        self.version = 0
        self.global_step = 0
        self.pending: list[Work] = []  # sorted by ticket
        self.running: dict[str, Work] = {}
        self.leases: dict[str, Lease] = {}
        self.buffer: list[Finished] = []  # sorted by ticket
        self.stats = PoolStats()
        # Tie-breaks among equally loaded servers; saved so a resumed run breaks ties alike.
        self.rng = random.Random(seed)
        self._next_ticket = 0
        self._changed = asyncio.Event()
        # producer_id -> until when a refused producer's retry is waited for.
        self._demand: dict[str, float] = {}
        # A refused producer is told to retry after 0.5 s; hold its slot a few retries long.
        self.demand_hold_s = 2.0

    # -- change notification -----------------------------------------------------------------

    def notify(self) -> None:
        """Wakes every task waiting in :meth:`wait_change`."""
        # One event per change: set, then replaced, so later waiters wait for the next one.
        # (asyncio.Condition would need its lock, which sync callers cannot take.)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_change(self, timeout_s: float | None = None) -> None:
        """Waits until the pool changes (or ``timeout_s`` passes)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def set_version(self, version: int) -> None:
        """A new policy version is live; capacity grows by one batch per version."""
        self.version = version
        self.notify()

    def start_at(self, version: int) -> None:
        """A fresh run begins at ``version`` (trainers attached from an earlier run may be at
        V > 0): capacity counts batches from here, as at version 0, instead of admitting
        ``(V + eta + 1) * B`` rollouts at once."""
        # Added, not set: external producers may have been accepted before the run started.
        self.staleness.on_version_jump(version - self.version)
        self.set_version(version)

    # -- dataset work ------------------------------------------------------------------------

    def _ticket(self) -> int:
        self._next_ticket += 1
        return self._next_ticket - 1

    def capacity(self) -> int:
        """Rollouts that may start now (AReaL's rule)."""
        return self.staleness.capacity()

    def claim(self, producer: str) -> Work | None:
        """The next prompt for ``producer`` when capacity allows, else None.

        Re-queued work goes first (oldest ticket first), then the loader's next prompt.
        """
        # Slots asked for by refused external producers are left for them (see acquire).
        if self.staleness.capacity() - self.external_demand() <= 0:
            return None
        if not self.pending:
            if self.loader is None:
                return None
            prompt = self.loader.next()
            work = Work(
                ticket=self._ticket(),
                task_id=f"p{prompt.seq}",
                seq=prompt.seq,
                epoch=prompt.epoch,
                item=prompt.item,
            )
            self.pending.append(work)
            self.staleness.on_enqueued()
        if not self.staleness.try_submit(from_queue=True):
            return None
        work = self.pending.pop(0)
        work.producer = producer
        work.submit_version = self.version
        work.claimed_at = time.monotonic()
        self.running[work.task_id] = work
        return work

    def _pop_running(self, task_id: str, producer: str | None) -> Work | None:
        """Removes and returns ``task_id`` from the running work if it runs on ``producer``.

        A task taken away from a server (re-queued, maybe claimed by another one since) keeps
        its id, so a late report of the old server must not settle the new claim.
        """
        work = self.running.get(task_id)
        if work is None:
            return None
        if producer is not None and work.producer != producer:
            log.info(
                "ignoring a late report of %s from %s (now %s)",
                task_id,
                producer,
                work.producer or "queued",
            )
            return None
        return self.running.pop(task_id)

    def finish(
        self, task_id: str, group: common_pb2.TrajectoryGroup, producer: str | None = None
    ) -> bool:
        """A rollout server's group for ``task_id`` was accepted; False if the task is unknown.

        With ``producer``, only a task running on that producer is settled (see
        :meth:`_pop_running`); the others are ignored and False is returned.
        """
        work = self._pop_running(task_id, producer)
        if work is None:
            return False
        self.staleness.on_accepted()
        self._buffer_add(Finished(work, group, head_version(group), _group_tokens(group)))
        self.notify()
        return True

    def reject(self, task_id: str, reason: str, producer: str | None = None) -> bool:
        """The task ended without a usable group (rejected by the workflow or its filter)."""
        work = self._pop_running(task_id, producer)
        if work is None:
            return False
        self.staleness.on_rejected()
        self.stats.rejected_reasons[reason.split(":")[0][:60]] += 1
        self.notify()
        return True

    def requeue(self, task_id: str, producer: str | None = None) -> bool:
        """Puts a running task back in the queue (its server failed or cancelled it)."""
        work = self._pop_running(task_id, producer)
        if work is None:
            return False
        # The counters have no running -> enqueued move: count it as a rejection (frees the
        # slot) and a new enqueue.
        self.staleness.on_rejected()
        self._pending_add(work)
        self.stats.requeued += 1
        self.notify()
        return True

    def running_on(self, producer: str) -> list[str]:
        """Task ids running on ``producer``."""
        return [tid for tid, w in self.running.items() if w.producer == producer]

    def overdue_on(self, producer: str, timeout_s: float, now: float | None = None) -> list[str]:
        """Task ids running on ``producer`` for longer than ``timeout_s`` since their claim."""
        now = time.monotonic() if now is None else now
        return [
            tid
            for tid, w in self.running.items()
            if w.producer == producer and now - w.claimed_at > timeout_s
        ]

    def _pending_add(self, work: Work) -> None:
        work.producer = ""
        bisect.insort(self.pending, work, key=lambda w: w.ticket)
        self.staleness.on_enqueued()

    def _buffer_add(self, finished: Finished) -> None:
        bisect.insort(self.buffer, finished, key=lambda f: f.work.ticket)

    # -- batches -----------------------------------------------------------------------------

    def drop_stale(self, train_version: int) -> int:
        """Removes buffered groups more than eta versions behind ``train_version`` (< 0: none).

        Dataset prompts go back to the queue (trained later with fresh samples), so every
        prompt is still trained once; external groups cannot be regenerated and are dropped.
        """
        if train_version < 0:
            return 0
        keep: list[Finished] = []
        dropped = 0
        for f in self.buffer:
            if self.staleness.is_stale(f.head_version, train_version):
                self.staleness.on_dropped()
                dropped += 1
                if f.work.item is not None:
                    self._pending_add(f.work)
                    self.stats.requeued += 1
            else:
                keep.append(f)
        if dropped:
            self.buffer = keep
            self.stats.dropped_stale += dropped
            self.notify()
        return dropped

    def take_batch(self, size: int, train_version: int) -> list[Finished] | None:
        """The ``size`` oldest fresh groups, or None while fewer are ready."""
        self.drop_stale(train_version)
        if len(self.buffer) < size:
            return None
        batch, self.buffer = self.buffer[:size], self.buffer[size:]
        self.notify()
        return batch

    async def wait_batch(self, size: int, train_version: int) -> list[Finished]:
        """Waits for :meth:`take_batch` to return a batch."""
        while True:
            batch = self.take_batch(size, train_version)
            if batch is not None:
                return batch
            # The timeout re-checks now and then in case a wake-up was missed.
            await self.wait_change(1.0)

    # -- external producers ------------------------------------------------------------------

    def expire_leases(self, now: float | None = None) -> int:
        """Ends expired leases; each frees its capacity."""
        now = time.monotonic() if now is None else now
        expired = [lid for lid, lease in self.leases.items() if lease.deadline <= now]
        for lid in expired:
            del self.leases[lid]
            self.staleness.on_rejected()
            self.stats.rejected_reasons["lease expired"] += 1
        if expired:
            self.notify()
        return len(expired)

    def acquire(self, producer_id: str, group_size: int, ttl_s: float | None = None) -> Lease:
        """A lease, or :class:`NoCapacity`."""
        if group_size < 1:
            raise FieldError("group_size", f"must be >= 1, got {group_size}")
        self.expire_leases()
        if not self.staleness.try_submit(from_queue=False):
            # Remember the refusal: the dataset submitter leaves the next free slot to this
            # producer for a while, or a busy run would never let an external producer in.
            self._demand[producer_id] = time.monotonic() + self.demand_hold_s
            raise NoCapacity(
                f"no rollout capacity at version {self.version} (running "
                f"{self.staleness.stats().running}, eta {self.staleness.max_staleness})"
            )
        self._demand.pop(producer_id, None)
        lease_id = f"lease-{uuid.uuid4().hex[:16]}"
        ttl = self.lease_ttl_s if ttl_s is None else ttl_s
        work = Work(
            ticket=self._ticket(),
            task_id=lease_id,
            producer=f"external:{producer_id}",
            submit_version=self.version,
        )
        lease = Lease(
            work=work,
            producer_id=producer_id,
            group_size=group_size,
            version=self.version,
            deadline=time.monotonic() + ttl,
            wall_deadline=time.time() + ttl,
        )
        self.leases[lease_id] = lease
        return lease

    def external_demand(self, now: float | None = None) -> int:
        """Refused external producers still expected to retry (their slots are held back)."""
        if not self._demand:
            return 0
        now = time.monotonic() if now is None else now
        for pid in [p for p, until in self._demand.items() if until <= now]:
            del self._demand[pid]
        return len(self._demand)

    def renew(self, lease_id: str, now: float | None = None) -> Lease:
        """Extends a live lease to ``lease_ttl_s`` from now (a producer's heartbeat).

        FieldError when the lease is unknown, used up or already expired: a lease that ran
        out has given its capacity back (maybe to another producer), so it cannot come back.
        """
        self.expire_leases(now)
        lease = self.leases.get(lease_id)
        if lease is None:
            raise FieldError("lease_id", f"unknown or expired lease {lease_id!r}")
        mono = time.monotonic() if now is None else now
        # Never shortened: a lease taken with a longer ttl_s keeps its deadline.
        if mono + self.lease_ttl_s > lease.deadline:
            lease.wall_deadline += mono + self.lease_ttl_s - lease.deadline
            lease.deadline = mono + self.lease_ttl_s
        return lease

    def release(self, lease_id: str) -> None:
        """Gives a lease back; FieldError when it is unknown (or already expired)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise FieldError("lease_id", f"unknown or expired lease {lease_id!r}")
        self.staleness.on_rejected()
        self.notify()

    def submit(self, lease_id: str, group: common_pb2.TrajectoryGroup, where: str) -> str | None:
        """Takes an external group under its lease; returns None when accepted, else the reason.

        Raises :class:`FieldError` (naming the field under ``where``) for a malformed group;
        the lease then stays valid so the producer can submit a corrected group.
        """
        self.expire_leases()
        lease = self.leases.get(lease_id)
        if lease is None:
            return f"lease_id: unknown or expired lease {lease_id!r}"
        validate_group(group, f"{where}.group", self.vocab_size)
        if group.task_id and group.task_id != lease_id:
            raise FieldError(f"{where}.group.task_id", f"{group.task_id!r} differs from lease_id")
        for i, traj in enumerate(group.trajectories):
            if traj.task_id and traj.task_id != lease_id:
                raise FieldError(
                    f"{where}.group.trajectories[{i}].task_id",
                    f"{traj.task_id!r} differs from lease_id {lease_id!r}",
                )
        del self.leases[lease_id]
        head = head_version(group)
        if self.staleness.is_stale(head):
            self.staleness.on_rejected()
            self.stats.rejected_reasons["stale submission"] += 1
            self.notify()
            return (
                f"group.trajectories: first generated token is version {head}, more than "
                f"max_staleness={self.staleness.max_staleness} versions behind the current "
                f"version {self.version}"
            )
        rewards = {t.reward for t in group.trajectories}
        if self.drop_uniform_external and len(rewards) == 1:
            self.staleness.on_rejected()
            self.stats.rejected_reasons["uniform rewards"] += 1
            self.notify()
            return (
                f"group.trajectories: every reward is {rewards.pop():g}, so every advantage "
                "is 0; dynamic sampling (rollout.workflow_params.accept=nonuniform) trains "
                "only groups whose rewards differ: send another"
            )
        self.staleness.on_accepted()
        self._buffer_add(Finished(lease.work, group, head, _group_tokens(group)))
        self.notify()
        return None

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A consistent, JSON-safe snapshot (taken in one step: nothing awaits in between)."""
        inflight = sorted(
            (w for w in self.running.values() if w.item is not None), key=lambda w: w.ticket
        )
        rng_state = self.rng.getstate()
        return {
            "format": STATE_FORMAT,
            "version": self.version,
            "global_step": self.global_step,
            "staleness": self.staleness.state_dict(),
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "next_ticket": self._next_ticket,
            "pending": [w.to_dict() for w in self.pending],
            "inflight": [w.to_dict() for w in inflight],
            # Leases die with the process: their producers must take new ones.
            "inflight_external": len(self.running) - len(inflight) + len(self.leases),
            "buffer": [
                {
                    "work": f.work.to_dict(),
                    "group": base64.b64encode(f.group.SerializeToString()).decode("ascii"),
                }
                for f in self.buffer
            ],
            "rng": [rng_state[0], list(rng_state[1]), rng_state[2]],
            "requeued": self.stats.requeued,
            "dropped_stale": self.stats.dropped_stale,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`: in-flight work is re-queued ahead of new prompts."""
        if state.get("format") != STATE_FORMAT:
            raise FieldError("format", f"unsupported coordinator state {state.get('format')!r}")
        if self.running or self.leases or self.buffer or self.pending:
            raise RuntimeError("load_state_dict needs an idle, empty pool")
        self.version = int(state["version"])
        self.global_step = int(state["global_step"])
        if self.loader is not None and state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])
        self._next_ticket = int(state["next_ticket"])
        pending = [Work.from_dict(d) for d in state["pending"]]
        pending += [Work.from_dict(d) for d in state["inflight"]]
        self.pending = sorted(pending, key=lambda w: w.ticket)
        self.buffer = []
        for entry in state["buffer"]:
            group = common_pb2.TrajectoryGroup()
            group.ParseFromString(base64.b64decode(entry["group"]))
            work = Work.from_dict(entry["work"])
            self._buffer_add(Finished(work, group, head_version(group), _group_tokens(group)))
        counters = dict(state["staleness"])
        # Exact counters: nothing runs now; the re-queued work is what is enqueued, and the
        # in-flight external work is gone (rejected), which frees its budget.
        counters["rejected"] = int(counters["rejected"]) + int(state["inflight_external"])
        counters["running"] = 0
        counters["enqueued"] = len(self.pending)
        self.staleness.load_state_dict(counters, requeue_running=False)
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.stats.requeued = int(state.get("requeued", 0))
        self.stats.dropped_stale = int(state.get("dropped_stale", 0))
        self.notify()

    def reset_to(self, state: Mapping[str, Any], version: int | None = None) -> None:
        """Replaces everything with a checkpoint's state, mid-run (a trainer group restart).

        Whatever happened after the checkpoint is forgotten: running work, leases, the queue
        and the buffer are dropped, and the restored queue and loader hand the same prompts
        out again, so each is still trained once. ``version`` is the version training goes on
        from when it differs from the checkpoint's (rollout servers refuse older weights);
        ``accepted`` moves by the same number of batches, so the staleness capacity is the
        checkpoint's, not inflated by the jump (AReaL's recovery bug #1345).
        """
        self.running.clear()
        self.leases.clear()
        self.pending = []
        self.buffer = []
        self._demand.clear()
        self.load_state_dict(state)
        if version is not None and version != self.version:
            self.staleness.on_version_jump(version - self.version)
            self.version = version
            self.notify()
