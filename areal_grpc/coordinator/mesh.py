"""The mesh of a run: rollout servers and trainer ranks, started here (local) or attached.

Local mode starts every server as a subprocess (our entry points with ``--port 0``) on
loopback and learns its address from its ``LISTENING`` line. Trainer ranks rendezvous over a
free loopback port. Children get one torch thread each, so a small machine is not
oversubscribed by every process assuming it owns all cores. Attach mode uses the addresses in
``launcher.rollout_addresses`` / ``launcher.trainer_addresses`` and starts nothing.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from areal_grpc.cli import security_argv
from areal_grpc.config import RunConfig
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.launch import (
    Child,
    child_env,
    health_status,
    python_module_argv,
    start_child,
    start_children,
    stop_children,
)
from areal_grpc.tasks import TASKS

__all__ = [
    "FleetLauncher",
    "LocalFleet",
    "Mesh",
    "MeshStartCancelled",
    "free_port",
    "rollout_argv",
    "start_local_mesh",
    "trainer_argv",
    "wait_healthy",
]

log = logging.getLogger(__name__)

ROLLOUT_SERVICE = "areal.v1.RolloutService"
TRAINER_SERVICE = "areal.v1.TrainerService"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for the trainers' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def max_new_tokens(cfg: RunConfig) -> int:
    """Configured max_new_tokens, else the built-in task's answer length, else 16."""
    if cfg.rollout.sampling.max_new_tokens is not None:
        return cfg.rollout.sampling.max_new_tokens
    task = TASKS.get(cfg.data.task)
    return task.max_new_tokens if task is not None else 16


def check_supported(cfg: RunConfig) -> None:
    """Raises FieldError for settings the servers have no option for (not silently ignored)."""
    p = cfg.trainer.ppo
    if p.ppo_epochs != 1:
        raise FieldError("trainer.ppo.ppo_epochs", "the trainer runs one PPO epoch per step")
    if p.norm_eps != 1e-5:
        raise FieldError("trainer.ppo.norm_eps", "the trainer's normalisation eps is fixed: 1e-5")


def weights_root(cfg: RunConfig) -> str:
    """Directory of DISK weight updates (shared by trainer rank 0 and the rollout servers)."""
    root = cfg.weight_sync.disk_root or str(Path(cfg.output.dir) / "weights")
    return str(Path(root).resolve())


def trainer_path_roots(cfg: RunConfig) -> list[str]:
    """Where trainer ranks may write checkpoints and exports: the run's output directory, and
    the checkpoint directory when it lies elsewhere (resolved: children may start elsewhere)."""
    roots = [Path(cfg.output.dir).resolve()]
    if cfg.checkpoint.dir:
        ck = Path(cfg.checkpoint.dir).resolve()
        if not ck.is_relative_to(roots[0]):
            roots.append(ck)
    return [str(r) for r in roots]


def rollout_argv(cfg: RunConfig, index: int) -> list[str]:
    """Command line of rollout server ``index``."""
    r = cfg.rollout
    argv = [
        "--host",
        cfg.launcher.host,
        "--port",
        "0",
        "--log-level",
        cfg.output.log_level,
        "--model",
        cfg.model.source,
        # The same seed everywhere: it also seeds the built-in model's init, which must equal
        # the trainers' (version 0 is never transferred).
        "--seed",
        str(cfg.model.seed),
        "--engine",
        r.engine,
        "--device",
        r.device,
        "--default-workflow",
        r.workflow,
        "--max-new-tokens",
        str(max_new_tokens(cfg)),
        "--torch-threads",
        str(r.torch_threads),
    ]
    if r.max_batch_tokens is not None:
        argv += ["--max-batch-tokens", str(r.max_batch_tokens)]
    argv += ["--weight-methods", ",".join(cfg.weight_sync.methods)]
    if "disk" in cfg.weight_sync.methods:
        argv += ["--weights-root", weights_root(cfg)]
    if r.engine == "sglang":
        argv += ["--sglang-url", r.sglang_urls[index]]
    argv += security_argv(cfg.security)
    return python_module_argv("areal_servers.rollout", *argv)


def local_trainer_device(cfg: RunConfig, rank: int) -> str:
    """Rank ``rank``'s device when every rank runs on this machine: a GPU each, or the CPU.

    "auto" trains on the GPUs only when there is one per rank (NCCL refuses two ranks on one
    GPU, and FSDP cannot mix CPU and GPU ranks); "cuda" insists on that.
    """
    t = cfg.trainer
    if t.device == "cpu":
        return "cpu"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
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
    """Command line of trainer rank ``rank``."""
    check_supported(cfg)
    t = cfg.trainer
    p = t.ppo
    argv = [
        "--host",
        cfg.launcher.host,
        "--port",
        "0",
        "--log-level",
        cfg.output.log_level,
        "--rank",
        str(rank),
        "--world-size",
        str(t.ranks),
        "--master-addr",
        cfg.launcher.host,
        "--master-port",
        str(master_port),
        "--backend",
        t.backend,
        "--model",
        cfg.model.source,
        "--seed",
        str(cfg.model.seed),
        "--torch-threads",
        str(t.torch_threads),
        "--lr",
        repr(t.lr),
        "--weight-decay",
        repr(t.weight_decay),
        "--warmup-steps",
        str(t.warmup_steps),
        "--lr-schedule",
        t.lr_schedule,
        "--total-steps",
        str(cfg.total_steps),
        "--max-grad-norm",
        repr(t.grad_clip),
        "--max-tokens-per-mb",
        str(t.max_tokens_per_mb),
        "--eps-clip",
        repr(p.eps_clip),
        "--behav-imp-weight-cap",
        repr(p.behav_imp_weight_cap if p.behav_imp_weight_cap is not None else 0.0),
        "--behav-imp-weight-mode",
        p.behav_imp_weight_mode,
        "--reward-norm",
        p.reward_norm,
        "--adv-norm",
        p.adv_norm,
        "--kl-ctl",
        repr(p.kl_ctl),
        # Log-probs are recomputed under the same temperature the rollouts sampled with.
        "--temperature",
        repr(cfg.rollout.sampling.temperature or 1.0),
    ]
    argv += ["--weights-timeout-s", repr(cfg.weight_sync.timeout_s)]
    for root in trainer_path_roots(cfg):
        argv += ["--path-root", root]
    if "disk" in cfg.weight_sync.methods:
        argv += ["--weights-root", weights_root(cfg)]
    device = local_trainer_device(cfg, rank) if cfg.launcher.mode == "local" else t.device
    if device != "auto":
        argv += ["--device", device]
    if p.eps_clip_higher is not None:
        argv += ["--eps-clip-higher", repr(p.eps_clip_higher)]
    if p.c_clip is not None:
        argv += ["--c-clip", repr(p.c_clip)]
    # Rank 0 also calls the rollout servers (weight updates): same TLS and token.
    argv += security_argv(cfg.security)
    return python_module_argv("areal_servers.trainer", *argv)


@dataclass
class Mesh:
    """Addresses of the mesh, and the children this process started (local mode)."""

    rollout_addresses: list[str]
    trainer_addresses: list[str]
    children: list[Child] = field(default_factory=list)
    log_dir: Path | None = None

    def describe(self) -> dict[str, object]:
        """Addresses and pids, for ``mesh.json`` (lets tools find and stop the children)."""
        return {
            "rollout": self.rollout_addresses,
            "trainer": self.trainer_addresses,
            "children": [
                {"name": c.name, "address": c.address, "pid": c.process.pid} for c in self.children
            ],
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
            timeout_s=cfg.trainer.restart_timeout_s,
        )
        return list(self.trainer_addresses)


def wait_healthy(addresses: Sequence[tuple[str, str]], timeout_s: float = 300.0) -> None:
    """Waits until every ``(address, service)`` reports SERVING."""
    deadline = time.monotonic() + timeout_s
    for address, svc in addresses:
        while True:
            state = health_status(address, svc, timeout_s=5.0)
            if state == "SERVING":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{svc} at {address} is not serving (health {state})")
            time.sleep(0.2)


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
            mesh.rollout_addresses[:] = cfg.launcher.rollout_addresses
            mesh.trainer_addresses[:] = cfg.launcher.trainer_addresses
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

            start_children(specs, record, log_dir=log_dir)
        check()
        wait_healthy(
            [(a, ROLLOUT_SERVICE) for a in mesh.rollout_addresses]
            + [(a, TRAINER_SERVICE) for a in mesh.trainer_addresses]
        )
    except BaseException:
        mesh.stop()
        raise
    return mesh


# -- the elastic rollout fleet ---------------------------------------------------------------


class FleetLauncher(Protocol):
    """Starts and stops single rollout servers of a running mesh (blocking calls)."""

    def start_rollout_server(self) -> str:
        """Starts one rollout server, waits until it serves; its address."""
        ...

    def stop_rollout_server(self, address: str) -> int:
        """Stops the rollout server at ``address``; its exit code."""
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
        if self.cfg.rollout.engine == "sglang" and index >= len(self.cfg.rollout.sglang_urls):
            raise PreconditionError(
                f"rollout.sglang_urls has no URL for rollout server {index}: add one first"
            )
        child = start_child(
            f"rollout-{index}",
            rollout_argv(self.cfg, index),
            log_dir=self.mesh.log_dir,
            env=child_env(),
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

    def stop_rollout_server(self, address: str) -> int:
        """Stops the rollout subprocess at ``address`` (SIGTERM, then SIGKILL)."""
        with self._lock:
            child = next((c for c in self.mesh.children if c.address == address), None)
            if child is None:
                raise PreconditionError(f"no rollout server at {address} was started by this run")
            self.mesh.children.remove(child)
            if address in self.mesh.rollout_addresses:
                self.mesh.rollout_addresses.remove(address)
        return stop_children([child])[child.name]
