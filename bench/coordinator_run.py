"""``python -m areal_grpc.coordinator`` as the benchmarks run it, in one place."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def metrics_records(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` so far (a line cut by a stop is left out)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def interrupt(proc: subprocess.Popen[bytes]) -> None:
    """Asks the coordinator for its clean stop (SIGINT to its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)


@contextlib.contextmanager
def coordinator(
    args: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    grace_s: float = 120.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """The coordinator with ``args``, in a process group of its own, logging to ``log_path``.

    Still running when the block ends (an error, Ctrl-C): it is interrupted, and killed with
    its group if it has not stopped after ``grace_s``, so a benchmark never leaves a mesh
    behind or hangs on one.
    """
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_grpc.coordinator", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                interrupt(proc)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def watch(
    proc: subprocess.Popen[bytes], metrics: Path, every_s: float = 0.5
) -> Iterator[list[dict[str, Any]]]:
    """The records new in ``metrics`` at each poll (often none), until ``proc`` has exited.

    Only lines not yet read are parsed; a line still being written waits for the next poll.
    The last batch is read after the exit, so no record is missed.
    """
    seen = 0
    while True:
        done = proc.poll() is not None
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        new = []
        for line in lines[seen:]:
            try:
                new.append(json.loads(line))
            except ValueError:
                break
        seen += len(new)
        yield new
        if done:
            return
        time.sleep(every_s)
