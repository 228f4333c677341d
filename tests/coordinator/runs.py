"""Helpers shared by the coordinator tests: small run configs, what a run trained, processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from areal_grpc.config import RunConfig, load_config
from areal_grpc.coordinator.metrics import read_jsonl

ECHO_PROMPTS = 36  # one epoch of the built-in "echo" task


def small_run(tmp_path: Path, *overrides: str) -> RunConfig:
    """A small run over the built-in echo task: batch 2 x 2, no eval, export or plot."""
    return load_config(
        None,
        [
            "data.task=echo",
            "staleness.batch_size=2",
            "staleness.group_size=2",
            "staleness.max_staleness=1",
            "eval.every_steps=0",
            "checkpoint.export_hf=false",
            "output.plot=false",
            "output.progress_bar=false",
            f"output.dir={tmp_path / 'run'}",
            f"weight_sync.disk_root={tmp_path / 'weights'}",
            *overrides,
        ],
    )


def trained_groups(out: Path) -> list[dict[str, Any]]:
    """Every group the run in ``out`` trained (batches.jsonl), in order."""
    return [g for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]


def alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a zombie not yet reaped counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def mesh_children(out: Path) -> list[dict]:
    """The children listed in ``out/mesh.json`` (read again while the file is rewritten)."""
    while True:
        try:
            return json.loads((out / "mesh.json").read_text())["children"]
        except ValueError:
            time.sleep(0.1)
