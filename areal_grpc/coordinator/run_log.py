"""What a run records: its result summary and its metrics files, kept in step with each other.

A trainer-group recovery rewinds both to the checkpoint's step (:meth:`RunLog.rewind`): the
steps after it are redone, so their records go.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arealgrpc.v1 import trainer_pb2

from areal_grpc.coordinator.metrics import MetricsWriter, plot_curves, start_wandb
from areal_grpc.coordinator.pool import Finished
from areal_grpc.coordinator.rollouts import RolloutLog

if TYPE_CHECKING:
    from areal_grpc.config import RunConfig

__all__ = [
    "RunLog",
    "RunResult",
    "SignalWatch",
    "batch_lags",
    "groups_with_signal",
    "zero_signal_steps",
]

# Steps in a row with no learning signal before the run says so (and every this many after),
# or a fiftieth of the run if that is more: a long run's first steps often have no success
# at all (the quick start's: about 1 right sample in 256) and it learns anyway.
ZERO_SIGNAL_STEPS = 3
ZERO_SIGNAL_SHARE = 50


def zero_signal_steps(total_steps: int) -> int:
    """How many steps in a row without a signal a run of ``total_steps`` reports."""
    return max(ZERO_SIGNAL_STEPS, total_steps // ZERO_SIGNAL_SHARE)


# Advantages this small are zero: what a group of equal rewards leaves after its centring
# (exactly 0.0 in float arithmetic; the bound only absorbs summation rounding).
_ZERO_ADVANTAGE = 1e-6


@dataclass
class RunResult:
    """What a run did."""

    steps: int = 0
    version: int = 0
    first_reward: float | None = None
    last_reward: float | None = None
    first_eval: float | None = None
    last_eval: float | None = None
    wall_s: float = 0.0
    export_path: str | None = None
    plot_path: str | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    # Times the trainer group was restarted from a checkpoint during the run.
    trainer_restarts: int = 0
    # Rollout servers replaced during the run.
    rollout_restarts: int = 0


def _trained_versions(batch: Sequence[Finished]) -> Iterator[int]:
    """The version that generated each trained (loss-masked) token of ``batch``."""
    for f in batch:
        for t in f.group.trajectories:
            for v, m in zip(t.versions, t.loss_mask, strict=False):
                if m:
                    yield v


def batch_lags(batch: Sequence[Finished], version: int) -> list[int]:
    """Staleness of every trained token of ``batch`` when trained by weights ``version``."""
    return [version - v for v in _trained_versions(batch)]


def groups_with_signal(batch: Sequence[Finished]) -> int:
    """Groups of ``batch`` whose rewards are not all equal (the others' advantages are 0
    under GRPO's group centring)."""
    return sum(len({t.reward for t in f.group.trajectories}) > 1 for f in batch)


def zero_advantage(stats: trainer_pb2.StepStats, batch: Sequence[Finished]) -> bool:
    """Whether every trained token of the step had advantage 0 (its gradient came from no
    reward). The trainer's advantage statistics say so exactly when it sends them; else a
    batch whose every group has equal rewards."""
    extra = stats.extra
    if "advantage_mean" in extra and "advantage_std" in extra:
        return (
            abs(extra["advantage_mean"]) < _ZERO_ADVANTAGE
            and extra["advantage_std"] < _ZERO_ADVANTAGE
        )
    return groups_with_signal(batch) == 0


# The trainer's measure of the train/rollout log-prob gap (StepStats.extra): mean and max of
# |trainer's log-prob - the engine's| over the trained tokens the trained weights sampled, a
# KL estimate between the two, and how many tokens that was.
LOGP_GAP_KEYS = ("logp_gap_mean", "logp_gap_max", "logp_gap_kl", "logp_gap_tokens")
# Prefix sharing (trainer.prefix_sharing): the tokens the trainer computed / the rows'
# tokens unshared, over the step's micro-batches.
SHARING_KEYS = ("prefix_sharing_ratio",)


class SignalWatch:
    """Counts steps in a row whose every advantage was 0, and words the warning a run
    prints when there have been ``every`` of them (and every as many after; see
    :func:`zero_signal_steps`): nothing is being learned, and which settings give groups a
    signal."""

    def __init__(self, external: bool, every: int = ZERO_SIGNAL_STEPS) -> None:
        # Whether the run's groups come from external producers (leases, gateway sessions).
        self.external = external
        self.every = every
        self.streak = 0
        self.first = 0
        # The lowest and highest rewards seen so far (a batch at the top of a run that has
        # seen others is a solved task, not a missing signal).
        self.low: float | None = None
        self.high: float | None = None

    def step(
        self, step: int, stats: trainer_pb2.StepStats, batch: Sequence[Finished]
    ) -> str | None:
        """Records step ``step`` (1-based); the warning line when one is due, else None."""
        rewards = [t.reward for f in batch for t in f.group.trajectories]
        if rewards:
            self.low = min(rewards) if self.low is None else min(self.low, *rewards)
            self.high = max(rewards) if self.high is None else max(self.high, *rewards)
        if not zero_advantage(stats, batch):
            self.streak = 0
            return None
        if self.streak == 0:
            self.first = step
        self.streak += 1
        if self.streak % self.every:
            return None
        return self.message(step, batch)

    def message(self, step: int, batch: Sequence[Finished]) -> str:
        """One line: what happened, why, and what helps."""
        sizes = [len(f.group.trajectories) for f in batch]
        line = (
            f"no learning signal in steps {self.first}-{step} ({self.streak} in a row): the "
            "reward was constant within every group, so every advantage was 0 and nothing "
            "was learned."
        )
        values = {t.reward for f in batch for t in f.group.trajectories}
        if len(values) == 1 and self.low is not None and self.high is not None:
            (value,) = values
            if self.low < self.high == value:
                # Every sample scored the best this run has seen: there is nothing to fix.
                return line + (
                    f" Every sample got {value:g}, the highest reward of the run: the task "
                    "looks solved for these prompts (stop the run, or give it harder ones)."
                )
        singles = sum(n == 1 for n in sizes)
        if singles:
            line += (
                f" {singles} of {len(sizes)} groups had one sample (a lease or gateway session "
                "opened with group_size 1): a group of one is centred on itself and never has "
                "an advantage."
            )
        if self.external:
            return line + (
                " What helps: more samples per session (the group_size producers lease with), "
                "a reward with partial credit, or dropping groups whose rewards are all equal "
                "(rollout.workflow_params.accept=nonuniform, so producers send new ones)."
            )
        return line + (
            " What helps: more samples per prompt (staleness.group_size), a higher "
            "rollout.sampling.temperature, a reward with partial credit, or dynamic sampling "
            "(rollout.workflow_params.accept=nonuniform, the dapo preset) so that such groups "
            "are replaced by new prompts."
        )


class RunLog:
    """The run's :class:`RunResult` and its metrics writer (JSONL, TensorBoard, W&B, PNG)."""

    def __init__(
        self,
        out_dir: Path,
        tensorboard: bool,
        rollouts: RolloutLog | None = None,
        wandb: RunConfig | None = None,
    ) -> None:
        """``wandb``: the run's config, when its metrics go to W&B (output.wandb)."""
        self.out_dir = out_dir
        self.tensorboard = tensorboard
        self.wandb_config = wandb
        # One W&B run for the whole process: a rewind goes on in it (started by open()).
        self.wandb_run: Any = None
        # The samples each step trained on (None: none written).
        self.rollouts = rollouts
        self.result = RunResult()
        self.metrics: MetricsWriter | None = None
        # The step the run started from (the rewards list is indexed from it).
        self.first_step = 0

    def open(self, keep_until: int | None = None) -> None:
        """Opens the metrics files, keeping the records up to ``keep_until`` (a resume)."""
        if self.wandb_config is not None and self.wandb_run is None:
            self.wandb_run = start_wandb(self.wandb_config, self.out_dir)
        self.metrics = self._writer(keep_until)
        if self.rollouts is not None and keep_until is not None:
            self.rollouts.forget_after(keep_until)

    def _writer(self, keep_until: int | None) -> MetricsWriter:
        return MetricsWriter(
            self.out_dir, self.tensorboard, keep_until=keep_until, wandb_run=self.wandb_run
        )

    def log(self, kind: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Writes one record; returns it as written."""
        assert self.metrics is not None, "RunLog.open() first"
        return self.metrics.log(kind, step, values)

    def eval(self, step: int, accuracy: float, values: dict[str, Any]) -> None:
        """Records an evaluation."""
        self.log("eval", step, {"accuracy": accuracy, **values})
        r = self.result
        r.evals.append((step, accuracy))
        if r.first_eval is None:
            r.first_eval = accuracy
        r.last_eval = accuracy

    @property
    def last_eval_step(self) -> int:
        """The step of the latest evaluation (-1 if none)."""
        return self.result.evals[-1][0] if self.result.evals else -1

    def batch(self, step: int, version: int, batch: Sequence[Finished]) -> float:
        """Records what step ``step`` trained (one line per group); returns the mean reward."""
        assert self.metrics is not None, "RunLog.open() first"
        self.metrics.log_batch(
            step,
            version,
            [
                {
                    "task_id": f.work.task_id,
                    "seq": f.work.seq,
                    "epoch": f.work.epoch,
                    "item_id": (f.work.item or {}).get("id"),
                    "head_version": f.head_version,
                    # Which rollout server (or external producer) made the group.
                    "producer": f.work.producer,
                    "min_version": min(_trained_versions([f]), default=None),
                }
                for f in batch
            ],
        )
        if self.rollouts is not None:
            # The samples also go to the trackers that are on (TensorBoard, W&B).
            self.metrics.log_samples(step, self.rollouts.write(step, version, batch))
        rewards = [t.reward for f in batch for t in f.group.trajectories]
        reward = sum(rewards) / len(rewards)
        r = self.result
        r.rewards.append(reward)
        if r.first_reward is None:
            r.first_reward = reward
        r.last_reward = reward
        return reward

    @staticmethod
    def step_record(stats: trainer_pb2.StepStats, lags: Sequence[int]) -> dict[str, Any]:
        """The trainer's statistics of a step and its staleness, as a metrics record."""
        return {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "entropy": stats.entropy,
            "clip_fraction": stats.clip_fraction,
            "importance_weight_mean": stats.importance_weight_mean,
            "learning_rate": stats.learning_rate,
            "trained_tokens": stats.trained_tokens,
            "sequences": stats.sequences,
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness_max": max(lags) if lags else 0,
            # The train/rollout log-prob gap on the step's fresh tokens, when measured.
            **{k: stats.extra[k] for k in LOGP_GAP_KEYS + SHARING_KEYS if k in stats.extra},
        }

    def rewind(self, step: int) -> None:
        """Drops what was recorded after ``step`` (a recovery redoes those steps)."""
        assert self.metrics is not None, "RunLog.open() first"
        self.metrics.close()
        self.metrics = self._writer(step)
        if self.rollouts is not None:
            self.rollouts.forget_after(step)
        r = self.result
        r.rewards = r.rewards[: max(0, step - self.first_step)]
        r.last_reward = r.rewards[-1] if r.rewards else None
        if not r.rewards:
            r.first_reward = None
        r.evals = [(s, a) for s, a in r.evals if s <= step]
        r.last_eval = r.evals[-1][1] if r.evals else None

    def close(self, plot: bool) -> None:
        """Closes the files; draws the curves when ``plot``."""
        if self.metrics is None:
            return
        self.metrics.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if plot:
            png = plot_curves(self.metrics.metrics_path, self.out_dir / "curves.png")
            self.result.plot_path = str(png) if png else None
