"""Staleness admission: how many more rollouts may start without exceeding the allowed lag.

AReaL's rule, exact. With policy version ``V``, concurrency limit ``C``, consumer batch size
``B`` (in prompts, one rollout = one prompt) and maximum staleness ``eta``::

    capacity = min(C - running, (eta + V + 1) * B - (accepted + running))

A caller starts a rollout only while ``capacity > 0``; the value may be negative (after a
restart, or when the limits shrink). ``rejected`` and ``enqueued`` never enter the formula, so
a rejection frees its budget.

The rule bounds staleness when the trainer consumes rollouts in submission order: a rollout
submitted at version ``v`` is the ``r``-th non-rejected rollout with
``r < (eta + v + 1) * B``, so it lands in a batch trained at version ``<= v + eta``. When batches
are assembled from whatever finished first, a slow rollout can fall behind; the coordinator
then checks :meth:`StalenessManager.is_stale` and discards it with :meth:`on_dropped`, which
frees its budget (otherwise admission would stall for good).

Beyond AReaL: counters never go negative (an impossible transition raises
:class:`StalenessStateError` instead of corrupting the budget), :meth:`try_submit` checks and
claims capacity in one atomic step, and :meth:`state_dict` / :meth:`load_state_dict` carry the
counters across a restart (AReaL only approximates them with :meth:`on_version_recovered`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from areal_grpc.errors import FieldError, PreconditionError

__all__ = ["RolloutStats", "StalenessManager", "StalenessStateError"]

_COUNTERS = ("enqueued", "running", "accepted", "rejected")


class StalenessStateError(PreconditionError):
    """A counter transition that cannot happen (e.g. accepting with nothing running)."""


@dataclass(frozen=True)
class RolloutStats:
    """A snapshot of the four rollout counters."""

    enqueued: int = 0
    running: int = 0
    accepted: int = 0
    rejected: int = 0


class StalenessManager:
    """Thread-safe rollout counters and AReaL's staleness capacity rule.

    ``version`` is either an int (change it with :meth:`set_version`) or a zero-argument
    callable read each time capacity is computed (e.g. the coordinator's current version); it
    runs under the manager's lock, so it must not call back into the manager.
    ``max_concurrent_rollouts`` defaults to ``consumer_batch_size``, as in AReaL.
    """

    def __init__(
        self,
        consumer_batch_size: int,
        max_staleness: int,
        max_concurrent_rollouts: int | None = None,
        version: int | Callable[[], int] = 0,
    ) -> None:
        if consumer_batch_size < 1:
            raise FieldError("consumer_batch_size", f"must be >= 1, got {consumer_batch_size}")
        if max_staleness < 0:
            raise FieldError("max_staleness", f"must be >= 0, got {max_staleness}")
        if max_concurrent_rollouts is not None and max_concurrent_rollouts < 1:
            raise FieldError(
                "max_concurrent_rollouts", f"must be >= 1 when set, got {max_concurrent_rollouts}"
            )
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self.max_concurrent_rollouts = (
            consumer_batch_size if max_concurrent_rollouts is None else max_concurrent_rollouts
        )
        self._version: int | Callable[[], int] = version
        self._lock = threading.Lock()
        self._enqueued = 0
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    # -- version -----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The current policy version (read from the provider when it is a callable)."""
        v = self._version
        return int(v() if callable(v) else v)

    def set_version(self, version: int) -> None:
        """Sets the version to a fixed int (replacing a callable provider)."""
        if version < 0:
            raise FieldError("version", f"must be >= 0, got {version}")
        with self._lock:
            self._version = int(version)

    # -- the rule ----------------------------------------------------------------------------

    @property
    def pending_limit(self) -> int:
        """How many prompts may wait in the queue: ``(eta + 1) * B``."""
        return (self.max_staleness + 1) * self.consumer_batch_size

    def _capacity_locked(self) -> int:
        concurrency = self.max_concurrent_rollouts - self._running
        staleness = (self.max_staleness + self.version + 1) * self.consumer_batch_size - (
            self._accepted + self._running
        )
        return min(concurrency, staleness)

    def capacity(self) -> int:
        """How many more rollouts may start now (may be zero or negative)."""
        with self._lock:
            return self._capacity_locked()

    def is_stale(self, submit_version: int, version: int | None = None) -> bool:
        """Whether a rollout submitted at ``submit_version`` is more than eta versions behind.

        ``version`` is the version it would be trained at (default: the current version).
        """
        current = self.version if version is None else version
        return current - submit_version > self.max_staleness

    # -- transitions -------------------------------------------------------------------------

    def _require(self, name: str, event: str) -> None:
        if getattr(self, f"_{name}") <= 0:
            raise StalenessStateError(f"{event}: no {name} rollout to move (counter is 0)")

    def on_enqueued(self, n: int = 1) -> None:
        """``n`` prompts were put in the pending queue."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            self._enqueued += n

    def on_dequeued(self) -> None:
        """A queued prompt left the queue without being submitted (e.g. cancelled)."""
        with self._lock:
            self._require("enqueued", "on_dequeued")
            self._enqueued -= 1

    def on_submitted(self) -> None:
        """A queued prompt was handed to a rollout server: enqueued -> running."""
        with self._lock:
            self._require("enqueued", "on_submitted")
            self._enqueued -= 1
            self._running += 1

    def try_submit(self, from_queue: bool = True) -> bool:
        """Claims one unit of capacity atomically; False (and no change) when capacity <= 0.

        ``from_queue=True`` moves a queued prompt to running; ``False`` starts one directly
        (e.g. a lease for an external producer that never sat in our queue).
        """
        with self._lock:
            if self._capacity_locked() <= 0:
                return False
            if from_queue:
                self._require("enqueued", "try_submit")
                self._enqueued -= 1
            self._running += 1
            return True

    def on_accepted(self) -> None:
        """A rollout finished and is kept for training: running -> accepted."""
        with self._lock:
            self._require("running", "on_accepted")
            self._running -= 1
            self._accepted += 1

    def on_rejected(self) -> None:
        """A rollout failed, returned nothing, was filtered out or its lease expired."""
        with self._lock:
            self._require("running", "on_rejected")
            self._running -= 1
            self._rejected += 1

    def on_dropped(self) -> None:
        """An accepted rollout was discarded before training (too stale): accepted -> rejected."""
        with self._lock:
            self._require("accepted", "on_dropped")
            self._accepted -= 1
            self._rejected += 1

    def on_version_recovered(self, version: int) -> None:
        """AReaL's resume rule: ``accepted = version * B``, so capacity is ``(eta+1)*B - running``.

        Use it when only the version survived a restart; :meth:`load_state_dict` is exact.
        """
        if version < 0:
            raise FieldError("version", f"must be >= 0, got {version}")
        with self._lock:
            self._accepted = version * self.consumer_batch_size

    def on_version_jump(self, versions: int) -> None:
        """The version moved by ``versions`` without training: counts that many batches as
        accepted, so the jump frees no capacity (AReaL's recovery defect inflated it)."""
        with self._lock:
            self._accepted = max(0, self._accepted + versions * self.consumer_batch_size)

    # -- snapshots and checkpoints -------------------------------------------------------------

    def stats(self) -> RolloutStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return RolloutStats(self._enqueued, self._running, self._accepted, self._rejected)

    def state_dict(self) -> dict[str, int]:
        """The counters, for a checkpoint (plain ints: JSON-safe)."""
        return asdict(self.stats())

    def load_state_dict(self, state: Mapping[str, int], requeue_running: bool = True) -> None:
        """Restores counters saved by :meth:`state_dict`.

        With ``requeue_running`` (the default) rollouts that were in flight at the checkpoint
        count as queued again, because the coordinator re-queues that work on resume and will
        submit it afresh; counting it as running too would shrink the budget twice.
        """
        missing = [k for k in _COUNTERS if k not in state]
        if missing:
            raise FieldError(missing[0], "missing from staleness state")
        unknown = sorted(set(state) - set(_COUNTERS))
        if unknown:
            raise FieldError(unknown[0], "unknown key in staleness state")
        values: dict[str, int] = {}
        for k in _COUNTERS:
            v = state[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise FieldError(k, f"must be a non-negative int, got {v!r}")
            values[k] = v
        with self._lock:
            self._enqueued = values["enqueued"]
            self._running = values["running"]
            self._accepted = values["accepted"]
            self._rejected = values["rejected"]
            if requeue_running:
                self._enqueued += self._running
                self._running = 0
