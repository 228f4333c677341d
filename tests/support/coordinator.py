"""The coordinator's side of the tests: ``python -m areal_grpc.coordinator`` as a subprocess
(:class:`CoordinatorCommand`, behind the ``coordinator_command`` fixture), small run configs for
a coordinator in this process, and what a run trained or left running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
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


class CoordinatorCommand:
    """Runs ``python -m areal_grpc.coordinator`` as a user does; stops what tests leave running."""

    # A short run on the built-in echo task: small batches, no eval, checkpoints or outputs.
    SMALL_RUN = (
        "data.task=echo",
        "staleness.batch_size=2",
        "staleness.group_size=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "output.plot=false",
        "output.tensorboard=false",
    )

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[str]] = []
        self._seen: dict[subprocess.Popen[str], str] = {}

    def start(
        self,
        out: Path,
        *overrides: str,
        resume: bool = False,
        env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
        config: Path | None = None,
        on: Callable[[list[str]], list[str]] | None = None,
    ) -> subprocess.Popen[str]:
        """The command writing to ``out`` (``config``: its --config file; ``on``: the argv
        wrapped to run elsewhere, e.g. a test host's ``argv``); stdout and stderr merged into
        ``proc.stdout``."""
        argv = [sys.executable, "-m", "areal_grpc.coordinator"]
        if resume:
            argv.append("--resume")
        if config is not None:
            argv += ["--config", str(config)]
        argv += [f"output.dir={out}", "output.progress_bar=false", *overrides]
        if on is not None:
            argv = on(argv)
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        for name in unset_env:
            full_env.pop(name, None)
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
        )
        self._procs.append(proc)
        return proc

    def address(self, proc: subprocess.Popen[str]) -> str:
        """The address the run serves CoordinatorService at, from its ``COORDINATOR`` line."""
        assert proc.stdout is not None
        # Byte by byte from the pipe: nothing read past the line waits in proc.stdout's buffer,
        # where finish() (communicate reads the pipe itself) would never see it.
        fd = proc.stdout.fileno()
        seen = bytearray()
        line_start = 0
        while byte := os.read(fd, 1):
            seen += byte
            if byte == b"\n":
                line = seen[line_start:].decode()
                line_start = len(seen)
                if line.startswith("COORDINATOR "):
                    self._seen[proc] = seen.decode()
                    return line.split()[1]
        proc.wait()
        raise AssertionError("the run ended before serving:\n" + seen.decode())

    def finish(self, proc: subprocess.Popen[str], timeout: float = 240) -> str:
        """Waits for the run to end; its whole output (printed: pytest shows it on failure)."""
        rest, _ = proc.communicate(timeout=timeout)
        out = self._seen.pop(proc, "") + rest
        print(out)
        return out

    def run(
        self,
        out: Path,
        *overrides: str,
        timeout: float = 300,
        resume: bool = False,
        env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
        config: Path | None = None,
    ) -> tuple[int, str]:
        """A whole run: (exit code, output)."""
        proc = self.start(
            out, *overrides, resume=resume, env=env, unset_env=unset_env, config=config
        )
        log = self.finish(proc, timeout=timeout)
        return proc.returncode, log

    @staticmethod
    def trained_steps(out: Path) -> int:
        """Train records in the run's metrics.jsonl so far (each is flushed as written)."""
        path = out / "metrics.jsonl"
        if not path.is_file():
            return 0
        lines = path.read_text().splitlines()
        return sum(json.loads(line)["kind"] == "train" for line in lines if line.endswith("}"))

    @staticmethod
    @contextlib.contextmanager
    def paused(pid: int, out: Path) -> Iterator[int]:
        """The run's coordinator (``pid``, writing to ``out``) stopped with SIGSTOP for the
        block; yields how many steps it has trained.

        What the block does to the mesh (kill a server, say) then happens at a known step,
        whatever the machine's load. With V steps trained, the staleness rule has let at most
        the groups of ``max_staleness + V + 1`` steps be generated, so a run longer than that
        still needs a rollout server afterwards (:meth:`needs_rollouts_after`).
        """
        os.kill(pid, signal.SIGSTOP)
        try:
            yield CoordinatorCommand.trained_steps(out)
        finally:
            os.kill(pid, signal.SIGCONT)

    @staticmethod
    def needs_rollouts_after(trained: int, total_steps: int, max_staleness: int = 2) -> bool:
        """Whether a run that has trained ``trained`` steps must still generate groups."""
        return total_steps > max_staleness + trained + 1

    def close(self) -> None:
        """Stops every run still going as Ctrl-C does (it stops its mesh too), else kills it."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()
        self._seen.clear()
