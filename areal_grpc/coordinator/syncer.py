"""Weight-sync orchestration: when new weights go to which rollout servers, and what then.

After each step, and after a restore, :meth:`WeightSyncer.sync` pauses submissions, has every
trainer rank publish to the servers in rotation or joining (the fleet protocol of
``areal_clients.fleet``: pause rollouts -> publish on every rank -> resume), sets the pool's
version, leaves the servers that missed it out of rotation and lets joining ones in.
:meth:`WeightSyncer.join` brings one server back to the run's version between steps.

The update itself is a :data:`WeightSync` callable, so a run can go without a data plane
(``None``: versions follow the trainer, nothing learns) and unit tests can pass a fake.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from areal_grpc.config import WeightSyncConfig
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.rollout_fleet import Endpoint, RolloutFleet
from areal_grpc.coordinator.trainer_group import TrainerGroup
from areal_grpc.server import ChannelCache

__all__ = [
    "SyncOutcome",
    "WeightSync",
    "WeightSyncUnavailable",
    "WeightSyncer",
    "fleet_available",
    "fleet_weight_sync",
]

log = logging.getLogger(__name__)


@dataclass
class SyncOutcome:
    """Result of one fleet weight update."""

    version: int
    # Rollout servers that did not take the update (left out of rotation until level).
    failed: list[str] = field(default_factory=list)
    # Bytes of the update: the published state dict (a LoRA update: its adapters).
    sent_bytes: int = 0
    # Bytes the trainer sent for it, summed over the servers (one that took it from its
    # host's relay adds nothing): across hosts, what left the trainer's host.
    wire_bytes: int = 0


# (trainer addresses, rollout addresses, methods, timeout_s, health_timeout_s) -> the outcome;
# health_timeout_s None: no health checks of servers slow to answer a control call.
WeightSync = Callable[
    [Sequence[str], Sequence[str], Sequence[str], float, float | None], Awaitable[SyncOutcome]
]


class WeightSyncUnavailable(RuntimeError):
    """The fleet weight-sync client (areal_clients.fleet) is not installed."""


def fleet_available() -> bool:
    """True when ``areal_clients.fleet`` (the fleet weight-sync protocol) can be imported."""
    return importlib.util.find_spec("areal_clients.fleet") is not None


async def fleet_weight_sync(
    trainer_addresses: Sequence[str],
    rollout_addresses: Sequence[str],
    methods: Sequence[str],
    timeout_s: float = 600.0,
    health_timeout_s: float | None = None,
    channels: ChannelCache | None = None,
) -> SyncOutcome:
    """One fleet weight update (pause rollouts -> publish on every rank -> resume);
    ``channels`` keeps the update's channels for the next one (None: made for this one)."""
    if not fleet_available():
        raise WeightSyncUnavailable("areal_clients.fleet is not installed")
    from areal_clients.fleet import update_fleet_weights

    result = await update_fleet_weights(
        trainer_addresses,
        rollout_addresses,
        methods=methods,
        timeout_s=timeout_s,
        health_timeout_s=health_timeout_s,
        channels=channels,
    )
    return SyncOutcome(
        int(result.version),
        [str(a) for a in result.failed_servers],
        int(result.total_bytes),
        sum(int(s.sent_bytes) for s in result.servers),
    )


class WeightSyncer:
    """Moves the trainer group's weights to the rollout fleet (see the module doc)."""

    def __init__(
        self,
        cfg: WeightSyncConfig,
        update: WeightSync | None,
        trainers: TrainerGroup,
        fleet: RolloutFleet,
        pool: WorkPool,
        health_timeout_s: float | None = None,
    ) -> None:
        """``health_timeout_s``: a server slow to answer a control call of an update is
        health-checked with it, and given up on when it fails (None: waited for)."""
        self.cfg = cfg
        self.health_timeout_s = health_timeout_s
        self.update = update
        self.trainers = trainers
        self.fleet = fleet
        self.pool = pool
        # The last step's update: its size, and what the trainer sent for it (metrics'
        # sync_bytes and sync_sent_bytes).
        self.last_bytes = 0
        self.last_wire_bytes = 0
        fleet.join = self.join

    async def sync(self) -> int:
        """Pauses submissions, updates every server, bumps the pool's version, resumes.

        The caller holds the trainer group's lock (a step's TrainStep and its sync are one
        unit for the ranks' collectives).
        """
        self.fleet.open.clear()
        try:
            targets = self.fleet.sync_targets()
            if self.update is None:
                # No data plane: the servers keep their weights; versions follow the trainer
                # so the run still progresses (it cannot learn, see the warning at start).
                outcome = SyncOutcome(self.trainers.version)
            else:
                outcome = await self.trainers.watched(
                    self.update(
                        self.trainers.addresses,
                        [e.address for e in targets],
                        list(self.cfg.methods),
                        self.cfg.timeout_s,
                        self.health_timeout_s,
                    )
                )
            self.pool.set_version(outcome.version)
            self.last_bytes = outcome.sent_bytes
            self.last_wire_bytes = outcome.wire_bytes
            self.fleet.level(targets, outcome.failed)
        finally:
            self.fleet.open.set()
        return outcome.version

    async def join(self, ep: Endpoint) -> bool:
        """Brings a joining server to the run's version and into rotation; False on failure."""
        fleet = self.fleet
        async with self.trainers.lock:
            if not ep.joining or fleet.stopping or ep not in fleet.endpoints:
                return True  # a step's sync brought it in already, or the run is ending
            try:
                st = await ep.client.status(timeout_s=5.0)
                if st.policy_version != self.pool.version:
                    if self.update is None:
                        return False
                    # Every rank publishes its current weights, which are the run's version:
                    # the lock keeps us between a step's TrainStep and its sync.
                    # Watched as a step's sync is: a rank that dies during the publish would
                    # otherwise hold the others in their collective until the update's
                    # timeout, with no step to find it out while no server is in rotation.
                    outcome = await self.trainers.watched(
                        self.update(
                            self.trainers.addresses,
                            [ep.address],
                            list(self.cfg.methods),
                            self.cfg.timeout_s,
                            self.health_timeout_s,
                        )
                    )
                    if ep.address in outcome.failed or outcome.version != self.pool.version:
                        return False
            except Exception as exc:
                log.warning("rollout server %s could not rejoin: %s", ep.address, exc)
                if TrainerGroup.is_group_failure(exc):
                    fleet.trainer_group_failed(exc)
                return False
            fleet.open_stream(ep)
            self.pool.notify()
            log.info("rollout server %s serves version %d again", ep.address, self.pool.version)
            return True
