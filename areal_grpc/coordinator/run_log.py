"""What a run records: its result summary and its metrics files, kept in step with each other.

A trainer-group recovery rewinds both to the checkpoint's step (:meth:`RunLog.rewind`): the
steps after it are redone, so their records go.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arealgrpc.v1 import trainer_pb2

from areal_grpc.coordinator.metrics import MetricsWriter, plot_curves
from areal_grpc.coordinator.pool import Finished

__all__ = ["RunLog", "RunResult", "batch_lags"]


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


class RunLog:
    """The run's :class:`RunResult` and its metrics writer (JSONL, TensorBoard, PNG)."""

    def __init__(self, out_dir: Path, tensorboard: bool) -> None:
        self.out_dir = out_dir
        self.tensorboard = tensorboard
        self.result = RunResult()
        self.metrics: MetricsWriter | None = None
        # The step the run started from (the rewards list is indexed from it).
        self.first_step = 0

    def open(self, keep_until: int | None = None) -> None:
        """Opens the metrics files, keeping the records up to ``keep_until`` (a resume)."""
        self.metrics = MetricsWriter(self.out_dir, self.tensorboard, keep_until=keep_until)

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
        }

    def rewind(self, step: int) -> None:
        """Drops what was recorded after ``step`` (a recovery redoes those steps)."""
        assert self.metrics is not None, "RunLog.open() first"
        self.metrics.close()
        self.metrics = MetricsWriter(self.out_dir, self.tensorboard, keep_until=step)
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
        if plot:
            png = plot_curves(self.metrics.metrics_path, self.out_dir / "curves.png")
            self.result.plot_path = str(png) if png else None
