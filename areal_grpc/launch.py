"""Local launcher: starts service processes on loopback, learns their ports, stops them.

Each child is one of our console entry points run with ``--port 0``; it prints
``LISTENING host:port`` once bound (areal_grpc.cli), which is how the launcher learns its
address without racing for free ports. Children are stopped with SIGTERM (graceful drain),
then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from arealgrpc.v1 import rollout_pb2, trainer_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_grpc.server import sync_channel

log = logging.getLogger(__name__)

LISTENING = "LISTENING "


class LaunchError(RuntimeError):
    """The mesh could not be started for a reason the user can act on (one line, no traceback)."""

    exit_code = 1


class ChildStartError(LaunchError):
    """A child exited (or never printed LISTENING) while starting; says why in one line.

    ``returncode`` 2 is the child's own configuration error, which the coordinator passes on
    as its exit status.
    """

    def __init__(self, name: str, returncode: int | None, reason: str, log_path: str = "") -> None:
        super().__init__(name, returncode, reason, log_path)  # args as given: picklable (Ray)
        self.name = name
        self.returncode = returncode
        self.reason = reason
        self.log_path = log_path
        self.exit_code = 2 if returncode == 2 else 1

    def __str__(self) -> str:
        code = f"exit code {self.returncode}"
        if self.returncode is None:
            code = "no LISTENING line in time"
        why = f": {self.reason}" if self.reason else ""
        where = f"; see {self.log_path}" if self.log_path else ""
        return f"{self.name} did not start ({code}){why}{where}"


def last_error_line(path: Path | None, limit: int = 64 * 1024) -> str:
    """The last non-blank line of a child's log (its exception or error message), or ''."""
    if path is None or not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        lines = f.read().decode("utf-8", "replace").splitlines()
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


@dataclass
class Child:
    """A started service process."""

    name: str
    process: subprocess.Popen[str]
    address: str
    log_path: Path | None = None
    _pump: threading.Thread | None = field(default=None, repr=False)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None


def _pump_output(stream: IO[str], sink: IO[str] | None) -> None:
    for line in stream:
        if sink is not None:
            sink.write(line)
            sink.flush()


def start_child(
    name: str,
    argv: Sequence[str],
    *,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
) -> Child:
    """Starts ``argv`` and returns once it printed its LISTENING line (else raises)."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    sink: IO[str] | None = None
    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        sink = log_path.open("a")
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=sink if sink is not None else subprocess.DEVNULL,
        text=True,
        env=child_env,
        start_new_session=True,  # Ctrl-C in the terminal reaches the launcher only.
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + ready_timeout_s
    address = None
    # Read lines until LISTENING; the pump thread takes the rest so the pipe never fills.
    result: list[str] = []

    def read_until_listening() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if sink is not None:
                sink.write(line)
                sink.flush()
            if line.startswith(LISTENING):
                result.append(line[len(LISTENING) :].strip())
                break

    reader = threading.Thread(target=read_until_listening, daemon=True)
    reader.start()
    while reader.is_alive() and time.monotonic() < deadline and proc.poll() is None:
        reader.join(0.05)
    if result:
        address = result[0]
    if address is None:
        if not reader.is_alive():
            # Its output ended: it is exiting. Its exit code may lag the end of its output.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10.0)
        exited = proc.poll()
        proc.kill()
        proc.wait()
        reader.join(1.0)  # the rest of its output reaches the log first
        if sink is not None:
            sink.flush()
        raise ChildStartError(
            name, exited, last_error_line(log_path), str(log_path) if log_path else ""
        )
    pump = threading.Thread(target=_pump_output, args=(proc.stdout, sink), daemon=True)
    pump.start()
    log.info("%s listening on %s (pid %d)", name, address, proc.pid)
    return Child(name=name, process=proc, address=address, log_path=log_path, _pump=pump)


def child_env() -> dict[str, str]:
    """Environment of a mesh child: one OpenMP thread unless the user asked for more.

    Every child assuming it owns all cores would oversubscribe a small machine.
    """
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def start_children(
    specs: Sequence[tuple[str, Sequence[str]]],
    record: Callable[[Child], None],
    *,
    log_dir: Path | None = None,
    ready_timeout_s: float = 120.0,
) -> None:
    """Starts every ``(name, argv)`` at once (each takes seconds to import torch), each
    given ``ready_timeout_s`` to print its LISTENING line.

    ``record`` gets each started child, in ``specs`` order and before any error is raised,
    so a caller that records into what it stops still stops every child that started; then
    the first failure is raised.
    """
    env = child_env()
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        futures = [
            pool.submit(
                start_child, name, argv, log_dir=log_dir, env=env, ready_timeout_s=ready_timeout_s
            )
            for name, argv in specs
        ]
        for fut in futures:
            try:
                record(fut.result())
            except BaseException as exc:
                errors.append(exc)
    if errors:
        raise errors[0]


def python_module_argv(module: str, *args: str) -> list[str]:
    """argv running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def health_status(address: str, service: str = "", timeout_s: float = 5.0) -> str:
    """The grpc.health.v1 status name of ``service`` at ``address`` (UNKNOWN on failure)."""
    with sync_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# The grpc.health service names our servers report under, as the contract spells them.
ROLLOUT_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
TRAINER_SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name

# (address, service, timeout_s) -> the grpc.health.v1 status name; injectable so that the
# coordinator's components can be unit-tested against in-process fakes.
HealthCheck = Callable[[str, str, float], Awaitable[str]]


async def check_health(address: str, service: str = "", timeout_s: float = 5.0) -> str:
    """:func:`health_status` without blocking the event loop (a :data:`HealthCheck`)."""
    return await asyncio.to_thread(health_status, address, service, timeout_s)


# Run as ``python -c _PDEATHSIG_EXEC <parent pid> argv...``: asks the kernel to SIGKILL this
# process when its parent dies, then becomes the real program (the setting survives exec).
# The parent check closes the race of a parent dying before prctl.
_PDEATHSIG_EXEC = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass  # not Linux: the parent's own stop is the only clean-up
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def dies_with_this_process(argv: Sequence[str]) -> list[str]:
    """``argv`` (an interpreter first) wrapped so that the child is killed when this process
    dies, even by SIGKILL, which leaves no chance to stop it (Linux; elsewhere as is).

    The kernel ties the child to the thread that starts it: start it from a thread that
    lives as long as this process (the main one, or a pool's worker)."""
    return [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *argv]


def stop_children(children: Sequence[Child], grace_s: float = 15.0) -> dict[str, int]:
    """SIGTERM every child, wait up to ``grace_s``, SIGKILL stragglers; returns exit codes.

    What a child left behind in its process group goes too (each child leads its own, see
    :func:`start_child`): a server killed with SIGKILL cannot stop its own subprocesses, and
    vLLM's engine and worker processes outlive a killed rollout server otherwise.
    """
    for child in children:
        if child.alive():
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes: dict[str, int] = {}
    for child in children:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            codes[child.name] = child.process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs; killing it", child.name, grace_s)
            child.process.kill()
            codes[child.name] = child.process.wait()
        kill_group_leftovers(child.process.pid, child.name)
    return codes


# How long a stopped child's process group may take to empty by itself: helpers such as
# multiprocessing's resource tracker exit on their own a moment after their parent.
_LEFTOVER_GRACE_S = 2.0


def kill_group_leftovers(pgid: int, name: str, grace_s: float = _LEFTOVER_GRACE_S) -> None:
    """SIGKILLs whatever is left of process group ``pgid`` (its leader has exited) once
    ``grace_s`` has passed without the group emptying by itself.

    multiprocessing's resource trackers go last: a tracker unlinks the shared memory that its
    processes registered and did not free (vLLM's message queues, ``/dev/shm/psm_*``) once
    they are gone, then exits; killed with them, it would leave those segments behind."""
    if _group_empty_within(pgid, grace_s):
        return
    members = _group_members(pgid)
    trackers = {p for p in members if _is_resource_tracker(p)}
    if trackers and len(trackers) < len(members):
        for pid in members:
            if pid not in trackers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if _group_empty_within(pgid, grace_s):
            log.warning("%s left processes behind in its process group; killed them", name)
            return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return  # nothing left
    except PermissionError:
        log.warning("%s left processes in its group %d this process may not kill", name, pgid)
        return
    log.warning("%s left processes behind in its process group; killed them", name)


def _group_empty_within(pgid: int, timeout_s: float) -> bool:
    """Whether process group ``pgid`` has no process left, waiting up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if os.path.isdir("/proc") and not _group_members(pgid):
            return True  # zombies only, which their new parent (init) reaps, or not
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``, from /proc (none without it)."""
    members = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
