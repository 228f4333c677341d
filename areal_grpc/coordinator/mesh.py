"""The mesh of a run: rollout servers and trainer ranks, started here (local) or attached.

Local mode starts every server as a subprocess (our entry points with ``--port 0``) on
loopback and learns its address from its ``LISTENING`` line. Trainer ranks rendezvous over a
free loopback port. Children get one torch thread each, so a small machine is not
oversubscribed by every process assuming it owns all cores. Attach mode uses the addresses in
``launcher.attach.rollout_addresses`` / ``launcher.attach.trainer_addresses`` and starts nothing.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from areal_grpc.cli import security_argv
from areal_grpc.config import RunConfig
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.launch import (
    ROLLOUT_SERVICE,
    TRAINER_SERVICE,
    Child,
    child_env,
    health_status,
    python_module_argv,
    start_child,
    start_children,
    stop_children,
)
from areal_grpc.ports import free_port
from areal_grpc.precision import bf16_compute, choose_dtype
from areal_grpc.server_config import config_argv

__all__ = [
    "FleetLauncher",
    "LocalFleet",
    "Mesh",
    "MeshStartCancelled",
    "check_sglang_url",
    "local_precision",
    "rollout_argv",
    "start_local_mesh",
    "trainer_argv",
    "wait_healthy",
]

log = logging.getLogger(__name__)


def server_host(cfg: RunConfig, role: str, index: int) -> str:
    """The host a server binds: ``launcher.host``, or under Slurm with several nodes the
    node it runs on."""
    if cfg.launcher.mode == "slurm":
        from areal_grpc.coordinator.slurm import allocation, node_of

        alloc = allocation()
        if len(alloc.nodes) > 1:
            return node_of(alloc, role, index)
    return cfg.launcher.host


def _launched(cfg: RunConfig, argv: list[str], role: str, index: int) -> list[str]:
    if cfg.launcher.mode == "slurm":
        from areal_grpc.coordinator.slurm import step_argv

        return step_argv(cfg, argv, role, index)
    return argv


def check_sglang_url(cfg: RunConfig, index: int) -> None:
    """PreconditionError when rollout server ``index`` would attach to an SGLang server that
    ``rollout.sglang.urls`` does not name (a server added beyond the list)."""
    urls = cfg.rollout.sglang.urls
    if cfg.rollout.engine == "sglang" and urls and index >= len(urls):
        raise PreconditionError(
            f"rollout.sglang.urls has no URL for rollout server {index}: add one first"
        )


def rollout_argv(cfg: RunConfig, index: int) -> list[str]:
    """Command line of rollout server ``index``: its address and the run config."""
    r = cfg.rollout
    host = server_host(cfg, "rollout", index)
    argv = ["--host", host, "--port", "0", "--log-level", cfg.output.log_level]
    if r.engine == "sglang" and r.sglang.urls:
        argv += ["--sglang-url", r.sglang.urls[index]]
    argv += security_argv(cfg.security)
    return _launched(
        cfg,
        python_module_argv("areal_servers.rollout", *argv, *config_argv(cfg)),
        "rollout",
        index,
    )


def cuda_device_count() -> int:
    """The GPUs torch would use here; torch is imported only where a GPU may be."""
    # The coordinator otherwise never imports torch: that takes it seconds of both cores
    # while its children start. Without NVIDIA (or ROCm) device files there is no GPU.
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_precision(cfg: RunConfig) -> str:
    """What the rollout engines and the trainer compute in on this machine, and why: the
    line a local run prints at start."""
    r = cfg.rollout
    gpu = r.device == "cuda" or (r.device == "auto" and cuda_device_count() > 0)
    dtype, why = choose_dtype(r.dtype, "cuda" if gpu else "cpu")
    t = cfg.trainer
    # Rank 1's device is rank 0's kind, without rank 0's warning (start_mesh gives that).
    device = local_trainer_device(cfg, 1).partition(":")[0]
    mixed, mixed_why = bf16_compute(t.mixed_precision, t.dtype, device)
    return (
        f"precision: rollout {dtype} ({why}); trainer {'bfloat16' if mixed else t.dtype} "
        f"compute, {t.dtype} weights ({mixed_why})"
    )


def local_trainer_device(cfg: RunConfig, rank: int) -> str:
    """Rank ``rank``'s device when every rank runs on this machine: a GPU each, or the CPU.

    "auto" trains on the GPUs only when there is one per rank (NCCL refuses two ranks on one
    GPU, and FSDP cannot mix CPU and GPU ranks); "cuda" insists on that.
    """
    t = cfg.trainer
    if t.device == "cpu":
        return "cpu"
    gpus = cuda_device_count()
    if gpus >= t.ranks:
        return f"cuda:{rank}"
    if t.device == "cuda":
        raise FieldError(
            "trainer.ranks",
            f"{t.ranks} ranks on trainer.device=cuda need a GPU each; this machine has {gpus}",
        )
    if gpus and rank == 0:
        log.warning(
            "trainer: %d ranks but %d GPU(s): training on the CPU (trainer.ranks=%d would "
            "train on the GPUs)",
            t.ranks,
            gpus,
            gpus,
        )
    return "cpu"


def trainer_argv(cfg: RunConfig, rank: int, master_port: int) -> list[str]:
    """Command line of trainer rank ``rank``: its address, rendezvous, device, the run config."""
    host = server_host(cfg, "trainer", rank)
    argv = [
        "--host",
        host,
        "--port",
        "0",
        "--log-level",
        cfg.output.log_level,
        "--rank",
        str(rank),
        "--world-size",
        str(cfg.trainer.ranks),
        "--master-addr",
        server_host(cfg, "trainer", 0),
        "--master-port",
        str(master_port),
    ]
    device = local_trainer_device(cfg, rank) if cfg.launcher.mode == "local" else cfg.trainer.device
    if device != "auto":
        argv += ["--device", device]
    # Rank 0 also calls the rollout servers (weight updates): same TLS and token.
    argv += security_argv(cfg.security)
    return _launched(
        cfg,
        python_module_argv("areal_servers.trainer", *argv, *config_argv(cfg)),
        "trainer",
        rank,
    )


@dataclass
class Mesh:
    """Addresses of the mesh, and the children this process started (local mode)."""

    rollout_addresses: list[str]
    trainer_addresses: list[str]
    children: list[Child] = field(default_factory=list)
    log_dir: Path | None = None
    # The run's gateway process (gateway.enabled), stopped by its own supervisor.
    gateway: Child | None = None

    def describe(self) -> dict[str, object]:
        """Addresses and pids, for ``mesh.json`` (lets tools find and stop the children);
        under Slurm each server's job step id too."""
        children = [*self.children, *([self.gateway] if self.gateway else [])]
        listed: list[dict[str, object]] = [
            {"name": c.name, "address": c.address, "pid": c.process.pid} for c in children
        ]
        if any(_is_step(c) for c in children):
            from areal_grpc.coordinator.slurm import step_ids

            steps = step_ids()
            for entry, c in zip(listed, children, strict=True):
                if _is_step(c) and c.name in steps:
                    entry["step"] = steps[c.name]
        return {
            "rollout": self.rollout_addresses,
            "trainer": self.trainer_addresses,
            "children": listed,
        }

    def write(self, path: Path) -> None:
        """Writes :meth:`describe` as JSON."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.describe(), indent=2))

    def stop(self) -> dict[str, int]:
        """Stops the children (SIGTERM, then SIGKILL after a grace period)."""
        codes = stop_children(self.children)
        self.children = []
        return codes

    def restart_trainers(self, cfg: RunConfig) -> list[str]:
        """Replaces the whole trainer group with fresh ranks; returns their addresses.

        A group that lost a rank cannot be reused (the survivors' process group is broken),
        so every trainer child is stopped and new ranks rendezvous on a fresh port. The new
        addresses replace ``trainer_addresses`` (rank order).
        """
        old = [c for c in self.children if c.name.startswith("trainer-")]
        # Survivors may sit in a failed collective: a long drain would only delay the restart.
        stop_children(old, grace_s=5.0)
        for child in old:
            self.children.remove(child)
        port = free_port(cfg.launcher.host)
        started: list[Child] = []

        def record(child: Child) -> None:
            # Recorded as it comes up, so stop() reaches every started child on an error.
            self.children.append(child)
            started.append(child)

        specs = [(f"trainer-{r}", trainer_argv(cfg, r, port)) for r in range(cfg.trainer.ranks)]
        start_children(specs, record, log_dir=self.log_dir)  # recorded in rank order
        self.trainer_addresses[:] = [c.address for c in started]
        wait_healthy(
            [(a, TRAINER_SERVICE) for a in self.trainer_addresses],
            timeout_s=cfg.fault_tolerance.trainer.restart_timeout_s,
        )
        return list(self.trainer_addresses)


def _is_step(child: Child) -> bool:
    args = child.process.args
    return isinstance(args, list) and bool(args) and args[0] == "srun"


def wait_healthy(addresses: Sequence[tuple[str, str]], timeout_s: float = 300.0) -> None:
    """Waits until every ``(address, service)`` reports SERVING (RuntimeError at timeout_s)."""
    pending = list(addresses)
    last: dict[tuple[str, str], str] = {}

    def all_serving() -> bool:
        last.update({key: health_status(*key, timeout_s=5.0) for key in pending})
        pending[:] = [key for key in pending if last[key] != "SERVING"]
        return not pending

    poll = Retrying(
        retry=retry_if_result(lambda done: not done),
        stop=stop_after_delay(timeout_s),
        wait=wait_fixed(0.2),
    )
    try:
        poll(all_serving)
    except RetryError:
        raise RuntimeError(
            "; ".join(f"{svc} at {a} is not serving (health {last[a, svc]})" for a, svc in pending)
        ) from None


class MeshStartCancelled(RuntimeError):
    """Starting the mesh was cancelled (e.g. Ctrl-C); the caller stops what was started."""


def start_local_mesh(
    cfg: RunConfig,
    log_dir: Path,
    mesh: Mesh | None = None,
    cancelled: threading.Event | None = None,
) -> Mesh:
    """Starts (local) or attaches to (attach) the mesh and waits until it is healthy.

    Children are appended to ``mesh`` as they start, so a caller that passes its own
    :class:`Mesh` can stop them whatever happens; ``cancelled`` aborts before children start. On
    an error the children started so far are stopped here.
    """
    mesh = mesh if mesh is not None else Mesh([], [], log_dir=log_dir)

    def check() -> None:
        if cancelled is not None and cancelled.is_set():
            raise MeshStartCancelled("mesh start cancelled")

    try:
        if cfg.launcher.mode == "attach":
            mesh.rollout_addresses[:] = cfg.launcher.attach.rollout_addresses
            mesh.trainer_addresses[:] = cfg.launcher.attach.trainer_addresses
        else:
            port = free_port(cfg.launcher.host)
            specs = [
                (f"rollout-{i}", rollout_argv(cfg, i)) for i in range(cfg.rollout.num_servers)
            ] + [(f"trainer-{r}", trainer_argv(cfg, r, port)) for r in range(cfg.trainer.ranks)]
            check()

            def record(child: Child) -> None:
                mesh.children.append(child)
                if child.name.startswith("rollout-"):
                    mesh.rollout_addresses.append(child.address)
                else:
                    mesh.trainer_addresses.append(child.address)

            start_children(
                specs, record, log_dir=log_dir, ready_timeout_s=rollout_start_timeout_s(cfg)
            )
        check()
        wait_healthy(
            [(a, ROLLOUT_SERVICE) for a in mesh.rollout_addresses]
            + [(a, TRAINER_SERVICE) for a in mesh.trainer_addresses]
        )
    except BaseException:
        mesh.stop()
        raise
    return mesh


def rollout_start_timeout_s(cfg: RunConfig) -> float:
    """Seconds a rollout server may take to serve: a vllm engine starts processes of its own
    and loads the model before the server listens (``rollout.vllm.start_timeout_s``)."""
    default = 120.0
    if cfg.rollout.engine == "vllm":
        return max(default, cfg.rollout.vllm.start_timeout_s + 30.0)
    return default


# -- the elastic rollout fleet ---------------------------------------------------------------


class FleetLauncher(Protocol):
    """Starts and stops single rollout servers of a running mesh (blocking calls)."""

    def start_rollout_server(self) -> str:
        """Starts one rollout server, waits until it serves; its address."""
        ...

    def stop_rollout_server(self, address: str, grace_s: float = 15.0) -> int:
        """Stops the rollout server at ``address`` (SIGKILL after ``grace_s`` s if SIGTERM
        has not); its exit code."""
        ...

    def owns(self, address: str) -> bool:
        """True for a rollout server this launcher started (and so can stop)."""
        ...

    def alive(self, address: str) -> bool:
        """False once the process of a rollout server this launcher started is gone."""
        ...

    def close(self) -> None:
        """Refuses further starts; a start still under way stops its server (run ending)."""
        ...


class LocalFleet:
    """:class:`FleetLauncher` of a local mesh: rollout servers as subprocesses."""

    def __init__(self, cfg: RunConfig, mesh: Mesh) -> None:
        self.cfg = cfg
        self.mesh = mesh
        self._lock = threading.Lock()
        self._next = len(mesh.rollout_addresses)
        self._closed = False

    def close(self) -> None:
        """Refuses further starts (call before stopping the mesh)."""
        with self._lock:
            self._closed = True

    def owns(self, address: str) -> bool:
        """True for a rollout subprocess of this mesh."""
        return any(
            c.address == address and c.name.startswith("rollout-") for c in self.mesh.children
        )

    def alive(self, address: str) -> bool:
        """False once the rollout subprocess at ``address`` has exited (or is not ours)."""
        return any(c.address == address and c.alive() for c in self.mesh.children)

    def start_rollout_server(self) -> str:
        """Starts ``rollout-<n>`` as a subprocess and waits until it serves."""
        with self._lock:
            if self._closed:
                raise PreconditionError("the run is stopping: no rollout server is started")
            index = self._next
            self._next += 1
        check_sglang_url(self.cfg, index)
        child = start_child(
            f"rollout-{index}",
            rollout_argv(self.cfg, index),
            log_dir=self.mesh.log_dir,
            env=child_env(),
            ready_timeout_s=rollout_start_timeout_s(self.cfg),
        )
        try:
            wait_healthy([(child.address, ROLLOUT_SERVICE)], timeout_s=120.0)
            with self._lock:
                if self._closed:
                    # The mesh was stopped while this server started: it would outlive the run.
                    raise PreconditionError("the run is stopping: the new server was stopped")
                self.mesh.children.append(child)
                self.mesh.rollout_addresses.append(child.address)
        except BaseException:
            stop_children([child])
            raise
        return child.address

    def stop_rollout_server(self, address: str, grace_s: float = 15.0) -> int:
        """Stops the rollout subprocess at ``address`` (SIGTERM, SIGKILL after ``grace_s``)."""
        with self._lock:
            child = next((c for c in self.mesh.children if c.address == address), None)
            if child is None:
                raise PreconditionError(f"no rollout server at {address} was started by this run")
            self.mesh.children.remove(child)
            if address in self.mesh.rollout_addresses:
                self.mesh.rollout_addresses.remove(address)
        return stop_children([child], grace_s=grace_s)[child.name]
