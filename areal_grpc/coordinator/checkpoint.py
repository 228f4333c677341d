"""Recovery checkpoints of a run: ``<root>/step-NNNNNN/{trainer/, coordinator.json}`` + ``latest``.

A step's checkpoint is committed in order: the trainer ranks write their shards (each rank's
SaveCheckpoint is atomic), then the coordinator state is written to a temporary file and
renamed, then ``latest`` is rewritten the same way. A crash at any point leaves ``latest``
naming the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CheckpointStore"]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointStore:
    """Step checkpoints under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def step_dir(self, step: int) -> Path:
        """Directory of the checkpoint taken after ``step`` steps."""
        return self.root / f"step-{step:06d}"

    def commit(self, step: int, state: Mapping[str, Any]) -> Path:
        """Writes the coordinator state of ``step`` and makes it the latest checkpoint."""
        d = self.step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        _write_atomic(d / "coordinator.json", json.dumps(state))
        _write_atomic(self.root / "latest", f"{step}\n")
        return d

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """(step, coordinator state) of the latest committed checkpoint, or None."""
        marker = self.root / "latest"
        if not marker.is_file():
            return None
        step = int(marker.read_text().strip())
        state = json.loads((self.step_dir(step) / "coordinator.json").read_text())
        return step, state
