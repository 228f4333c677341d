"""What the run trained on, as samples you can read: ``<output.dir>/rollouts/step-<s>.jsonl``.

Each step writes the trajectories of its batch's first ``output.rollouts_per_step`` groups,
one JSON object per trajectory: the step (numbered as in ``batches.jsonl``, from 0), the
trainer's version, the group's task and producer, the sample's index, its reward and finish
reason, the prompt and completion token ids, and each completion token's policy version and
behaviour log-probability. The directory is bounded by ``output.rollouts_max_mb``. Token ids,
not text: the coordinator holds no tokenizer (it imports neither torch nor transformers);
``python -m areal_grpc.inspect <output.dir>`` decodes them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arealgrpc.v1 import common_pb2

from areal_grpc.coordinator.pool import Finished
from areal_grpc.inspect import ROLLOUTS_DIR

__all__ = ["RolloutLog", "rollout_records"]

log = logging.getLogger(__name__)


def _finish(reason: int) -> str:
    name = common_pb2.FinishReason.Name(reason)
    return name.removeprefix("FINISH_REASON_").lower()


def rollout_records(step: int, version: int, batch: Sequence[Finished]) -> list[dict[str, Any]]:
    """One record per trajectory of ``batch`` (see the module docstring)."""
    out = []
    for f in batch:
        for i, t in enumerate(f.group.trajectories):
            n = t.prompt_length
            out.append(
                {
                    "step": step,
                    "version": version,
                    "task_id": f.work.task_id,
                    "producer": f.work.producer,
                    "sample": i,
                    "reward": t.reward,
                    "finish_reason": _finish(t.finish_reason),
                    "prompt_ids": list(t.token_ids[:n]),
                    "completion_ids": list(t.token_ids[n:]),
                    "versions": list(t.versions[n:]),
                    "logprobs": [round(x, 6) for x in t.logprobs[n:]],
                }
            )
    return out


class RolloutLog:
    """Writes each step's samples under ``<out_dir>/rollouts``, within a size bound."""

    def __init__(self, out_dir: Path, groups_per_step: int, max_mb: float) -> None:
        self.dir = out_dir / ROLLOUTS_DIR
        self.groups_per_step = groups_per_step
        self.max_bytes = int(max_mb * (1 << 20))
        self._full = False
        # Bytes under dir, counted from disk once (a resumed run's files count too), then kept
        # up to date here instead of re-reading every file's size at every step.
        self._used: int | None = None

    def _files(self) -> list[Path]:
        return sorted(self.dir.glob("step-*.jsonl")) if self.dir.is_dir() else []

    def forget_after(self, keep_until: int) -> None:
        """Drops the files of steps from ``keep_until`` on (a resume or recovery redoes them)."""
        for path in self._files():
            if int(path.stem.removeprefix("step-")) >= keep_until:
                path.unlink()
        self._used = None

    def write(self, step: int, version: int, batch: Sequence[Finished]) -> None:
        """Writes step ``step``'s samples (nothing once the directory is full)."""
        if self.groups_per_step <= 0 or self._full:
            return
        records = rollout_records(step, version, batch[: self.groups_per_step])
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        if self._used is None:
            self._used = sum(p.stat().st_size for p in self._files())
        used = self._used
        if used + len(data) > self.max_bytes:
            self._full = True
            log.warning(
                "%s holds %.1f MiB (output.rollouts_max_mb): no more samples are written",
                self.dir,
                used / (1 << 20),
            )
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"step-{step:06d}.jsonl").write_bytes(data)
        self._used = used + len(data)
