"""The coordinator's training loop (asynchronous GRPO in AReaL's shape, over gRPC).

Per run::

    connect -> (resume) -> [rollout streams run in the background] -> eval@0 ->
    for each step: wait for B fresh groups (oldest first) -> dispatch by tokens over the
                   trainer ranks -> TrainStep on all ranks -> pause submissions ->
                   fleet weight sync (version V+1 everywhere) -> version bump -> resume ->
                   metrics -> eval every k steps -> checkpoint every k steps
    -> final eval -> HF export -> plot

The loop only orders the phases; each is a component's call:

- :mod:`~areal_grpc.coordinator.rollout_fleet` (``RolloutFleet``): the rollout servers, their
  episode streams, submission while the staleness capacity allows, the watchdog, bringing
  servers back and replacing dead ones. With ``max_staleness = 0`` capacity is exactly one
  batch per version: synchronous training.
- :mod:`~areal_grpc.coordinator.pool` (``WorkPool``): queue, leases, buffer, staleness rule.
- :mod:`~areal_grpc.coordinator.trainer_group` (``TrainerGroup``): FFD dispatch and the
  watched collective calls on every rank.
- :mod:`~areal_grpc.coordinator.syncer` (``WeightSyncer``): new weights to the fleet.
- :mod:`~areal_grpc.coordinator.recovery` (``Recovery``): checkpoints, resume, and a failed
  trainer group's restart from the latest checkpoint.
- :mod:`~areal_grpc.coordinator.evaluator` and :mod:`~areal_grpc.coordinator.run_log`:
  held-out accuracy, and the run's result and metrics files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from areal_clients.rollout import RolloutClient
from areal_clients.trainer import TrainerClient
from arealgrpc.v1 import trainer_pb2

from areal_grpc import tracing
from areal_grpc.config import EXTERNAL_TASK, RunConfig
from areal_grpc.coordinator.checkpoint import CheckpointStore
from areal_grpc.coordinator.dataloader import PromptLoader, load_items
from areal_grpc.coordinator.evaluator import Evaluator
from areal_grpc.coordinator.mesh import FleetLauncher
from areal_grpc.coordinator.pool import Finished, WorkPool
from areal_grpc.coordinator.recovery import Recovery
from areal_grpc.coordinator.rollout_fleet import (
    EpisodeSettings,
    RolloutFleet,
    RolloutFleetLost,
    RolloutLike,
    RolloutReport,
)
from areal_grpc.coordinator.rollouts import RolloutLog
from areal_grpc.coordinator.run_log import (
    RunLog,
    RunResult,
    SignalWatch,
    batch_lags,
    groups_with_signal,
    zero_signal_steps,
)
from areal_grpc.coordinator.syncer import (
    SyncOutcome,
    WeightSync,
    WeightSyncer,
    WeightSyncUnavailable,
    fleet_available,
    fleet_weight_sync,
)
from areal_grpc.coordinator.trainer_group import (
    RestartTrainers,
    TrainerGroup,
    TrainerGroupFailed,
    TrainerLike,
    TrainerRankLost,
)
from areal_grpc.launch import HealthCheck, check_health

__all__ = [
    "Coordinator",
    "RestartTrainers",
    "RolloutFleetLost",
    "RolloutReport",
    "RunResult",
    "SyncOutcome",
    "TrainerGroupFailed",
    "TrainerRankLost",
    "WeightSync",
    "WeightSyncUnavailable",
    "fleet_available",
    "fleet_weight_sync",
]

log = logging.getLogger(__name__)


class Coordinator:
    """Runs the loop over a mesh given by addresses (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        rollout_addresses: Sequence[str],
        trainer_addresses: Sequence[str],
        out_dir: Path,
        *,
        weight_sync: WeightSync | None = fleet_weight_sync,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        restart_trainers: RestartTrainers | None = None,
        launcher: FleetLauncher | None = None,
        rollout_replaced: Callable[[str, str | None], None] | None = None,
        rollout_client: Callable[[str], RolloutLike] = RolloutClient,
        trainer_client: Callable[[str], TrainerLike] = TrainerClient,
        health: HealthCheck = check_health,
    ) -> None:
        """``restart_trainers`` replaces a failed trainer group (the local launcher's restart);
        None (attach mode) waits for the same addresses to come back, restarted by their own
        supervisor (e.g. torchrun), for up to ``fault_tolerance.trainer.restart_timeout_s``.

        ``launcher`` replaces rollout servers it started that die (None, attach mode: a
        server is waited for until it serves again); ``rollout_replaced(old, new)`` is called
        after a server was replaced (``new`` None: it is gone for good).

        ``rollout_client``, ``trainer_client`` and ``health`` are where the components get
        their clients and health answers (unit tests pass in-process fakes).
        """
        self.cfg = cfg
        self.out_dir = out_dir
        self.on_step = on_step
        s = cfg.staleness
        # data.task=external: no prompts of its own, only the groups producers submit.
        self.loader = (
            None
            if cfg.data.task == EXTERNAL_TASK
            else PromptLoader(load_items(cfg, "train"), cfg.data.shuffle, cfg.model.seed)
        )
        self.pool = WorkPool(
            s.batch_size,
            s.max_staleness,
            cfg.rollout.max_concurrent_rollouts,
            self.loader,
            lease_ttl_s=s.lease_ttl_s,
            seed=cfg.model.seed,
            # The run's dynamic sampling covers the groups producers submit too.
            drop_uniform_external=cfg.rollout.workflow_params.get("accept") == "nonuniform",
        )
        episode = EpisodeSettings.of(cfg)
        self.fleet = RolloutFleet(
            cfg,
            self.pool,
            rollout_addresses,
            episode,
            launcher=launcher,
            on_replaced=rollout_replaced,
            client_factory=rollout_client,
            health=health,
        )
        self.trainers = TrainerGroup(
            cfg.fault_tolerance.trainer,
            trainer_addresses,
            restart=restart_trainers,
            client_factory=trainer_client,
            health=health,
            # auto is on for every model the trainer builds but a few (see prefix_tree): the
            # balance is what matters here, not exactness.
            share_prefixes=cfg.trainer.prefix_sharing != "off",
        )
        self.syncer = WeightSyncer(
            cfg.weight_sync,
            weight_sync,
            self.trainers,
            self.fleet,
            self.pool,
            # The fleet's own liveness rule (rollout_fleet._watch), applied within an update.
            health_timeout_s=cfg.fault_tolerance.rollout.health_timeout_s
            if cfg.fault_tolerance.rollout.health_interval_s > 0
            else None,
        )
        self.run_log = RunLog(
            out_dir,
            cfg.output.tensorboard,
            RolloutLog(
                out_dir,
                cfg.output.rollouts_per_step,
                cfg.output.rollouts_max_mb,
                ppo=cfg.trainer.ppo,
                model_source=cfg.model.source,
            ),
            wandb=cfg if cfg.output.wandb else None,
        )
        self.signal = SignalWatch(
            external=self.loader is None, every=zero_signal_steps(cfg.total_steps)
        )
        self.fleet.on_restart = self._rollout_restarted
        checkpoint_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"
        self.recovery = Recovery(
            CheckpointStore(checkpoint_dir.resolve()),
            trainers=self.trainers,
            fleet=self.fleet,
            syncer=self.syncer,
            pool=self.pool,
            run_log=self.run_log,
            max_restarts=cfg.fault_tolerance.trainer.max_restarts,
            every_steps=cfg.checkpoint.every_steps,
        )
        eval_items = [] if self.loader is None else load_items(cfg, "eval")[: cfg.eval.max_prompts]
        self.evaluator = Evaluator(
            eval_items,
            workflow=episode.workflow,
            workflow_params=episode.workflow_params,
            sampling=episode.sampling,
            episode_timeout_s=cfg.fault_tolerance.rollout.episode_timeout_s,
        )

    # -- what the service and the entry point ask ----------------------------------------------

    @property
    def result(self) -> RunResult:
        """What the run did so far."""
        return self.run_log.result

    @property
    def trainer_version(self) -> int:
        """The trainer ranks' policy version."""
        return self.trainers.version

    @property
    def rollout_restarts(self) -> int:
        """Rollout servers replaced in this run."""
        return self.fleet.restarts

    @property
    def trainer_restarts(self) -> int:
        """Times the trainer group was restarted in this run."""
        return self.recovery.restarts

    async def add_rollout_server(self, address: str) -> None:
        """Adds a rollout server mid-run; it enters rotation once it serves the run's version."""
        await self.fleet.add(address)

    async def remove_rollout_server(self, address: str) -> int:
        """Takes a rollout server out of the mesh; returns how many tasks were re-queued."""
        return await self.fleet.remove(address)

    def rollout_report(self, address: str) -> RolloutReport | None:
        """State, version and restart count of a rollout server; None if unknown."""
        return self.fleet.report(address)

    # -- the run -------------------------------------------------------------------------------

    async def run(self, resume: bool = False, progress: Any = None) -> RunResult:
        """Runs ``total_steps`` steps (from the checkpoint when ``resume``); see module doc."""
        cfg = self.cfg
        started = time.monotonic()
        latest = self.recovery.store.latest() if resume else None
        self.run_log.open(keep_until=latest[0] if latest else None)
        if self.syncer.update is None:
            log.warning(
                "weight sync is off: rollout servers keep their initial weights (no learning)"
            )
        try:
            await self._connect()
            resumed = await self.recovery.resume() if resume else False
            if not resumed:
                self.pool.start_at(self.trainers.version)
            self.run_log.first_step = self.pool.global_step
            # The first batch's rollouts share the servers with the first evaluation (same
            # weights: nothing trains or syncs until the evaluation is done) instead of
            # waiting for it.
            self.fleet.start()
            if cfg.eval.every_steps > 0 and not resumed:
                await self._evaluate(self.pool.global_step)
            if progress is not None:
                progress.start(self.pool.global_step, cfg.total_steps)
            while True:
                while self.pool.global_step < cfg.total_steps:
                    await self.recovery.guarded(lambda: self._one_step(progress))
                step = self.pool.global_step
                if cfg.eval.every_steps > 0 and self.run_log.last_eval_step != step:
                    await self._evaluate(step)
                await self.fleet.stop()
                if cfg.checkpoint.export_hf and not await self.recovery.guarded(self._export):
                    # The group failed in the export and is back at the latest checkpoint:
                    # the steps after it are redone first.
                    self.fleet.start(restart=True)
                    continue
                break
        finally:
            await self.fleet.stop()
            if progress is not None:
                progress.stop()
            self.run_log.close(plot=cfg.output.plot)
        r = self.result
        r.steps, r.version = self.pool.global_step, self.pool.version
        r.rollout_restarts = self.fleet.restarts
        r.wall_s = time.monotonic() - started
        return r

    async def _one_step(self, progress: Any) -> None:
        """Waits for a batch, trains it, syncs the weights, records, evaluates, checkpoints."""
        cfg = self.cfg
        step = self.pool.global_step
        t0 = time.monotonic()
        # Without weight sync every sample comes from the initial weights: the staleness bound
        # cannot hold, so it is not enforced (dropping would re-queue the same prompts forever).
        train_version = self.trainers.version if self.syncer.update is not None else -1
        batch = await self.fleet.unless_lost(
            self.pool.wait_batch(cfg.staleness.batch_size, train_version)
        )
        t_wait = time.monotonic() - t0
        version_before = self.pool.version
        lags = batch_lags(batch, version_before)
        async with self.trainers.lock:
            stats = await self._train(step, batch, max(lags, default=0))
            t_train = time.monotonic() - t0 - t_wait
            with tracing.span(
                "coordinator.weight_sync",
                attributes={"areal.step": step, tracing.POLICY_VERSION: stats.policy_version},
            ):
                version = await self.syncer.sync()
        t_sync = time.monotonic() - t0 - t_wait - t_train
        self.pool.global_step = step + 1
        reward = self.run_log.batch(step, version_before, batch)
        warning = self.signal.step(step + 1, stats, batch)
        if warning is not None:
            log.warning(warning)
        st = self.pool.staleness.stats()
        record = {
            "version": version,
            "reward_mean": reward,
            # Groups whose rewards differ: the ones GRPO learns from.
            "signal_groups": groups_with_signal(batch),
            **RunLog.step_record(stats, lags),
            "dispatch_balance": self.trainers.last_balance,
            "step_s": time.monotonic() - t0,
            "wait_s": t_wait,
            "train_s": t_train,
            "sync_s": t_sync,
            "sync_bytes": self.syncer.last_bytes,
            "sync_sent_bytes": self.syncer.last_wire_bytes,
            "running": st.running,
            "accepted": st.accepted,
            "rejected": st.rejected,
            "requeued": self.pool.stats.requeued,
            "dropped_stale": self.pool.stats.dropped_stale,
            "buffered": len(self.pool.buffer),
            "trainer_restarts": self.recovery.restarts,
            "rollout_restarts": self.fleet.restarts,
        }
        k = cfg.eval.every_steps
        if k > 0 and (step + 1) % k == 0:
            record["eval_accuracy"] = await self._evaluate(step + 1)
        full = self.run_log.log("train", step + 1, record)
        c = cfg.checkpoint.every_steps
        if c > 0 and (step + 1) % c == 0:
            await self.recovery.save(step + 1)
        if progress is not None:
            progress.update(full)
        if self.on_step is not None:
            self.on_step(full)

    # -- the phases ----------------------------------------------------------------------------

    async def _connect(self) -> None:
        """Reads the servers' vocabulary size and versions; the trainer ranks must agree."""
        served = await self.fleet.connect()
        await self.trainers.read_version()
        log.info(
            "mesh: %d rollout server(s) at version(s) %s, %d trainer rank(s) at %d",
            len(served),
            sorted(set(served)),
            len(self.trainers.clients),
            self.trainers.version,
        )

    async def _train(
        self, step: int, batch: Sequence[Finished], staleness: int
    ) -> trainer_pb2.StepStats:
        """TrainStep of ``batch`` on every rank, traced with links to the groups' traces."""
        trained = [t.trace_context for f in batch for t in f.group.trajectories[:1]]
        with tracing.span(
            "coordinator.train_step",
            attributes={
                "areal.step": step,
                tracing.POLICY_VERSION: self.pool.version,
                tracing.STALENESS: staleness,
            },
            links=trained,
        ) as span:
            stats = await self.trainers.train_step(step, batch)
            span.set_attribute(tracing.TOKENS, stats.trained_tokens)
        return stats

    async def _evaluate(self, step: int) -> float:
        """Greedy accuracy on the eval split through the healthy servers, recorded."""
        started = time.monotonic()
        live = [e.client for e in self.fleet.endpoints if e.healthy]
        ev = await self.evaluator.evaluate(live, self.pool.global_step)  # type: ignore[arg-type]
        values: dict[str, Any] = {"eval_prompts": ev.prompts}
        if ev.by_kind:
            values["accuracy_by_kind"] = ev.by_kind
        values.update(version=self.pool.version, eval_s=time.monotonic() - started)
        self.run_log.eval(step, ev.accuracy, values)
        return ev.accuracy

    async def _export(self) -> None:
        """The trained model in Hugging Face format under ``<output.dir>/model``."""
        export = str((self.out_dir / "model").resolve())
        await self.trainers.export(export)
        self.result.export_path = export

    def _rollout_restarted(self, record: dict[str, Any]) -> None:
        self.result.rollout_restarts = self.fleet.restarts
        if self.run_log.metrics is not None:
            self.run_log.log("rollout_restart", self.pool.global_step, record)

    async def quiesce(self, timeout_s: float = 10.0) -> None:
        """Waits (bounded) until no rollout server is decoding for us any more."""
        await self.fleet.quiesce(timeout_s)

    async def close(self) -> None:
        """Stops the rollouts, waits for the servers to go idle, closes every channel."""
        await self.fleet.close()
        await self.trainers.close()
