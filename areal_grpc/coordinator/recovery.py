"""Checkpoints of a run, and what they are for: resuming it, and recovering its trainer group.

A checkpoint is the trainer ranks' shards first, then the coordinator's state (the work
pool and loader position), whose commit makes it count. :meth:`Recovery.resume` continues an
interrupted run from the latest one; :meth:`Recovery.recover` restarts a failed trainer group
and brings the whole run back to it (see there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from areal_grpc import tracing
from areal_grpc.coordinator.checkpoint import CheckpointStore
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.rollout_fleet import RolloutFleet
from areal_grpc.coordinator.run_log import RunLog
from areal_grpc.coordinator.syncer import WeightSyncer
from areal_grpc.coordinator.trainer_group import TrainerGroup, TrainerGroupFailed
from areal_grpc.errors import explain

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


class Recovery:
    """Saves checkpoints; resumes a run and recovers its trainer group from them."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        trainers: TrainerGroup,
        fleet: RolloutFleet,
        syncer: WeightSyncer,
        pool: WorkPool,
        run_log: RunLog,
        max_restarts: int,
        every_steps: int,
    ) -> None:
        self.store = store
        self.trainers = trainers
        self.fleet = fleet
        self.syncer = syncer
        self.pool = pool
        self.run_log = run_log
        self.max_restarts = max_restarts
        self.every_steps = every_steps
        # Times the trainer group was restarted in this run.
        self.restarts = 0

    async def save(self, step: int) -> None:
        """Trainer shards first, then the coordinator state (the commit point)."""
        trainer_dir = str(self.store.step_dir(step) / "trainer")
        async with self.trainers.lock:
            with tracing.span("coordinator.checkpoint", attributes={"areal.step": step}):
                await self.trainers.save_checkpoint(trainer_dir, step)
        self.store.commit(step, self.pool.state_dict())

    async def _restore(self, step: int, state: dict[str, Any], min_version: int) -> None:
        """Loads checkpoint ``step`` on every rank (going on from at least ``min_version``)
        and the coordinator state into the pool."""
        trainer_dir = str(self.store.step_dir(step) / "trainer")
        version = await self.trainers.load_checkpoint(trainer_dir, min_version)
        self.pool.reset_to(state, version)

    async def resume(self) -> bool:
        """Continues from the latest checkpoint, if there is one (False: start fresh)."""
        latest = self.store.latest()
        if latest is None:
            log.info("no checkpoint under %s: starting fresh", self.store.root)
            return False
        step, state = latest
        # Attached rollout servers may still serve what the interrupted run trained later.
        await self._restore(step, state, max(await self.fleet.served_versions(), default=0) + 1)
        # Bring the rollout servers to the restored weights before any rollout starts.
        await self.syncer.sync()
        log.info(
            "resumed from step %d: version %d, %d re-queued, %d buffered",
            step,
            self.pool.version,
            len(self.pool.pending),
            len(self.pool.buffer),
        )
        return True

    async def guarded(self, fn: Callable[[], Awaitable[None]]) -> bool:
        """Runs ``fn``; False when the trainer group failed in it and was recovered instead.

        After a recovery the run is back at the latest checkpoint's step: the steps after it
        are redone with the same prompts.
        """
        try:
            await fn()
            return True
        except Exception as exc:
            if not TrainerGroup.is_group_failure(exc):
                raise
            await self.recover(exc)
            return False

    async def recover(self, cause: BaseException) -> None:
        """Restarts the trainer group and restores the latest checkpoint (trainers and pool).

        Rollouts stop first (every episode stream is cut) because the pool is replaced by the
        checkpoint's: the work done since then is dropped and its prompts come out of the
        restored queue and loader again, so each is still trained exactly once. The ranks
        continue from a version above any the rollout servers have served, and every server
        gets the restored weights under it before rollouts resume. A failure during the
        restart itself (a new rank dying, the group not forming in time) leads to another
        restart, while ``fault_tolerance.trainer.max_restarts`` allows.
        """
        failed_at = self.pool.global_step
        # This recovery answers a failure reported by a server's rejoin too.
        self.fleet.clear_trainer_failure()
        while True:
            if self.restarts >= self.max_restarts:
                raise TrainerGroupFailed(
                    f"the trainer group failed at step {failed_at} after {self.restarts} "
                    f"restart(s) (fault_tolerance.trainer.max_restarts={self.max_restarts}): "
                    f"{explain(cause)}"
                ) from cause
            latest = self.store.latest()
            if latest is None:
                raise TrainerGroupFailed(
                    f"the trainer group failed at step {failed_at} before the first checkpoint "
                    f"(checkpoint.every_steps={self.every_steps}): nothing to restore from: "
                    f"{explain(cause)}"
                ) from cause
            step, state = latest
            self.restarts += 1
            self.run_log.result.trainer_restarts = self.restarts
            log.error(
                "trainer group failed at step %d (%s); restart %d/%d from the checkpoint of "
                "step %d",
                failed_at,
                explain(cause),
                self.restarts,
                self.max_restarts,
                step,
            )
            try:
                await self._restart_at(step, state, failed_at, cause)
                return
            except Exception as exc:
                if self.fleet.stopping:
                    raise
                # The old group is gone and the new one is not whole: start over.
                log.error("trainer group restart %d failed: %s", self.restarts, explain(exc))
                cause = exc

    async def _restart_at(
        self, step: int, state: dict[str, Any], failed_at: int, cause: BaseException
    ) -> None:
        """One attempt: a fresh group, restored to checkpoint ``step``, every server level."""
        started = time.monotonic()
        self.fleet.open.clear()
        # The readers see their streams are no longer the servers' and file nothing more.
        self.fleet.cut_streams()
        async with self.trainers.lock:
            addresses = await self.trainers.restart()
            # Every version so far came from the trainers, so none served is above the
            # highest we have seen; the servers are asked as well, to be sure.
            seen = [self.trainers.version, self.pool.version, *await self.fleet.served_versions()]
            await self._restore(step, state, max(seen) + 1)
            # Records of the steps after the checkpoint go: they are redone.
            self.run_log.rewind(step)
            self.run_log.log(
                "recovery",
                step,
                {
                    "failed_at_step": failed_at,
                    "restarts": self.restarts,
                    "version": self.trainers.version,
                    "trainer_addresses": addresses,
                    "cause": explain(cause),
                },
            )
            # Level every server with the restored weights (this reopens submissions).
            await self.syncer.sync()
        self.fleet.reopen_streams()
        self.pool.notify()
        log.warning(
            "trainer group restarted at %s in %.1f s: back at step %d, version %d",
            addresses,
            time.monotonic() - started,
            step,
            self.trainers.version,
        )
