"""Ray launcher (``launcher.mode=ray``): the mesh's servers as Ray actors in a placement group.

The layout is ``launcher.ray.nodes`` placement-group bundles, one per node, placed with
``launcher.ray.strategy`` (PACK by default, as AReaL does). The servers, trainer ranks first
and then rollout servers, are dealt to the bundles in contiguous blocks, so a two-node layout
puts the trainers on one node and the rollout servers on the other (AReaL's decoupled
allocation). Each bundle reserves the sum of its servers' ``launcher.*_cpus`` / ``*_gpus``.

Each server is one small actor that starts our usual entry point (``python -m
areal_servers.rollout`` / ``areal_servers.trainer``) as a subprocess on its node and reads
its ``LISTENING`` line, exactly as the local launcher does. A subprocess rather than the
server inside the actor process: the server keeps its own event loop, signal handling
(SIGTERM drains), torch threads and log file, and the code that runs is the same in every
launch mode. The child is tied to the actor with ``PR_SET_PDEATHSIG`` (Linux), so an actor
that dies or is killed takes its server with it: the coordinator then sees a broken stream,
takes the server out of rotation and re-queues its work (a failed server, not a hang).

Trainer rank 0's actor picks a free port on its node; that node's IP and port are the
ranks' torch.distributed rendezvous. Servers bind their node's IP (reachable from the other
nodes): off loopback that takes TLS (the ``security`` section) or an explicit
``security.allow_plaintext=true``, as for any server.

Rollout servers added mid-run (:meth:`RayMesh.start_rollout_server`) are actors outside the
placement group, placed wherever the cluster has ``launcher.rollout_cpus`` free.
:meth:`RayMesh.stop` stops every server (SIGTERM, then SIGKILL), kills the actors, removes
the placement group and shuts down the Ray instance this process started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_grpc.config import RunConfig
from areal_grpc.coordinator.mesh import (
    Mesh,
    MeshStartCancelled,
    check_sglang_url,
    rollout_argv,
    trainer_argv,
    wait_healthy,
)
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.launch import (
    ROLLOUT_SERVICE,
    TRAINER_SERVICE,
    Child,
    LaunchError,
    child_env,
    dies_with_this_process,
    start_child,
    stop_children,
)
from areal_grpc.ports import free_port
from areal_grpc.security import is_loopback

__all__ = ["RayMesh", "ServerActor", "bundle_layout", "start_ray_mesh"]

log = logging.getLogger(__name__)


# Grace period for SIGTERM before SIGKILL, per server.
STOP_GRACE_S = 15.0


class ServerActor:
    """Runs one server process on the actor's node (used as a Ray actor)."""

    def __init__(self) -> None:
        self.child: Child | None = None

    def node(self) -> dict[str, Any]:
        """The actor's node id and IP, and its own pid."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A port free on this node (the trainers' rendezvous when this is rank 0)."""
        return free_port(ray.util.get_node_ip_address())

    def start(
        self, name: str, argv: list[str], log_dir: str, env: dict[str, str], timeout_s: float
    ) -> dict[str, Any]:
        """Starts ``argv`` (with this node's interpreter); returns address and pid."""
        # The driver's interpreter path may not exist here; the module and arguments do.
        real = [sys.executable, *argv[1:]]
        wrapped = dies_with_this_process(real)
        self.child = start_child(
            name, wrapped, log_dir=Path(log_dir), env=env, ready_timeout_s=timeout_s
        )
        return {"address": self.child.address, "pid": self.child.process.pid}

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.child is not None and self.child.alive()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """Stops the server (SIGTERM, SIGKILL after ``grace_s``); returns its exit code."""
        if self.child is None:
            return 0
        codes = stop_children([self.child], grace_s=grace_s)
        return codes.get(self.child.name, 0)


_RemoteServerActor = ray.remote(max_restarts=0, max_concurrency=1)(ServerActor)


def bundle_layout(cfg: RunConfig) -> list[list[str]]:
    """Server names per bundle: trainer ranks then rollout servers, in contiguous blocks."""
    names = [f"trainer-{r}" for r in range(cfg.trainer.ranks)] + [
        f"rollout-{i}" for i in range(cfg.rollout.num_servers)
    ]
    nodes = cfg.launcher.ray.nodes
    blocks: list[list[str]] = []
    start = 0
    for j in range(nodes):
        size = len(names) // nodes + (1 if j < len(names) % nodes else 0)
        blocks.append(names[start : start + size])
        start += size
    return blocks


def _resources(cfg: RunConfig, name: str) -> dict[str, float]:
    la = cfg.launcher
    if name.startswith("trainer-"):
        return {"CPU": la.trainer_cpus, "GPU": la.trainer_gpus}
    return {"CPU": la.rollout_cpus, "GPU": la.rollout_gpus}


def _bundle(cfg: RunConfig, names: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for name in names:
        for key, value in _resources(cfg, name).items():
            total[key] = total.get(key, 0.0) + value
    bundle = {k: v for k, v in total.items() if v > 0}
    # Ray refuses empty bundles; a token CPU share keeps zero-resource layouts placeable.
    return bundle or {"CPU": 0.01}


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with the value after ``flag`` replaced."""
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def _networked(argv: list[str], host: str) -> list[str]:
    """Binds ``host``; beyond loopback that needs TLS or ``security.allow_plaintext``."""
    argv = _with_flag(argv, "--host", host)
    if not is_loopback(host) and "--tls-cert" not in argv and "--allow-plaintext" not in argv:
        # The same rule as every server's own: plaintext off loopback is a choice the
        # operator makes for a trusted network, never a default.
        raise FieldError(
            "security.allow_plaintext",
            f"the Ray node {host} is not loopback: configure TLS (security.tls_cert, "
            "security.tls_key, security.tls_ca) or set security.allow_plaintext=true",
        )
    return argv


@dataclass
class _Server:
    """A server started through an actor."""

    name: str
    actor: Any
    address: str = ""
    pid: int = 0
    node: dict[str, Any] = field(default_factory=dict)


@dataclass
class RayMesh(Mesh):
    """The mesh on Ray: same addresses as :class:`Mesh`, plus the actors behind them."""

    cfg: RunConfig | None = None
    servers: dict[str, _Server] = field(default_factory=dict)
    placement: PlacementGroup | None = None
    # True when this process called ray.init (then stop() disconnects or shuts Ray down).
    owns_ray: bool = False
    started_s: float = 0.0
    # Seconds of each start phase (placement, actors, servers), for the log and benchmarks.
    timings: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next_rollout: int = 0
    _closed: bool = False

    def describe(self) -> dict[str, object]:
        """Addresses, pids and the Ray node of every server (``mesh.json``)."""
        return {
            "rollout": self.rollout_addresses,
            "trainer": self.trainer_addresses,
            "launcher": "ray",
            "placement_group": self.placement.id.hex() if self.placement is not None else None,
            "servers": [
                {"name": s.name, "address": s.address, "pid": s.pid, **s.node}
                for s in self.servers.values()
            ],
        }

    # -- starting ----------------------------------------------------------------------------

    def _new_actor(self, name: str, bundle: int | None) -> _Server:
        assert self.cfg is not None
        res = _resources(self.cfg, name)
        options: dict[str, Any] = {"num_cpus": res["CPU"], "num_gpus": res["GPU"]}
        if bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=bundle
            )
        # Created and recorded under the lock, so stop() sees every actor that exists; one
        # still starting is killed there and its server dies with it (PDEATHSIG).
        with self._lock:
            if self._closed:
                raise PreconditionError("the run is stopping: no server is started")
            server = _Server(name, _RemoteServerActor.options(**options).remote())
            self.servers[name] = server
        return server

    def _get(self, refs: list[Any], what: str, timeout_s: float) -> list[Any]:
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError as exc:
            raise LaunchError(
                f"{what} did not finish within launcher.ray.start_timeout_s={timeout_s:.0f}s "
                f"(cluster resources: {ray.available_resources()})"
            ) from exc
        except RayTaskError as exc:
            if isinstance(exc.cause, LaunchError):
                raise exc.cause from None  # a server that did not start says why, one line
            raise
        except RayError as exc:
            # An actor or node lost while starting: Ray's first line says which.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LaunchError(f"{what} failed: {first}") from exc

    def _launch(self, servers: list[_Server], argvs: list[list[str]], timeout_s: float) -> None:
        assert self.log_dir is not None
        refs = [
            s.actor.start.remote(s.name, argv, str(self.log_dir), child_env(), timeout_s)
            for s, argv in zip(servers, argvs, strict=True)
        ]
        for s, ref in zip(servers, refs, strict=True):
            started = self._get([ref], f"starting {s.name}", timeout_s)[0]
            s.address, s.pid = started["address"], started["pid"]

    def start(self, cancelled: threading.Event | None = None) -> None:
        """Reserves the placement group, starts every server, fills in the addresses."""
        assert self.cfg is not None
        cfg = self.cfg
        timeout_s = cfg.launcher.ray.start_timeout_s

        def check() -> None:
            if cancelled is not None and cancelled.is_set():
                raise MeshStartCancelled("mesh start cancelled")

        t0 = time.monotonic()
        layout = bundle_layout(cfg)
        bundles = [_bundle(cfg, names) for names in layout]
        self.placement = placement_group(bundles, strategy=cfg.launcher.ray.strategy)
        try:
            ray.get(self.placement.ready(), timeout=timeout_s)
        except GetTimeoutError as exc:
            raise FieldError(
                "launcher.ray.nodes",
                f"the placement group {bundles} "
                f"({cfg.launcher.ray.strategy}) could not be placed within {timeout_s:.0f}s; "
                f"the cluster has {ray.cluster_resources()}",
            ) from exc
        self.timings["placement"] = time.monotonic() - t0
        check()
        servers = [self._new_actor(name, j) for j, names in enumerate(layout) for name in names]
        nodes = self._get([s.actor.node.remote() for s in servers], "placing the actors", timeout_s)
        for s, node in zip(servers, nodes, strict=True):
            s.node = node
        self.timings["actors"] = time.monotonic() - t0 - self.timings["placement"]
        check()
        trainers = [s for s in servers if s.name.startswith("trainer-")]
        rollouts = [s for s in servers if s.name.startswith("rollout-")]
        argvs = self._trainer_argvs(trainers, timeout_s) if trainers else []
        for i, s in enumerate(rollouts):
            argvs.append(_networked(rollout_argv(cfg, i), s.node["node_ip"]))
        self._next_rollout = len(rollouts)
        # Every server starts at once (each takes seconds to import torch).
        self._launch(trainers + rollouts, argvs, timeout_s)
        self.trainer_addresses[:] = [s.address for s in trainers]
        self.rollout_addresses[:] = [s.address for s in rollouts]
        check()
        wait_healthy(
            [(a, ROLLOUT_SERVICE) for a in self.rollout_addresses]
            + [(a, TRAINER_SERVICE) for a in self.trainer_addresses],
            timeout_s=timeout_s,
        )
        self.started_s = time.monotonic() - t0
        self.timings["servers"] = (
            self.started_s - self.timings["placement"] - self.timings["actors"]
        )
        log.info(
            "ray mesh up in %.1fs (%s): %s",
            self.started_s,
            ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()),
            {s.name: s.node.get("node_id", "")[:8] for s in servers},
        )

    def _trainer_argvs(self, trainers: list[_Server], timeout_s: float) -> list[list[str]]:
        """The ranks' command lines: rank 0's node and a free port there are the rendezvous."""
        assert self.cfg is not None
        rank0 = trainers[0]
        port = self._get([rank0.actor.free_port.remote()], "rendezvous port", timeout_s)[0]
        master = rank0.node["node_ip"]
        return [
            _networked(
                _with_flag(trainer_argv(self.cfg, rank, port), "--master-addr", master),
                s.node["node_ip"],
            )
            for rank, s in enumerate(trainers)
        ]

    def restart_trainers(self, cfg: RunConfig) -> list[str]:
        """Replaces the whole trainer group with fresh rank actors in the same bundles.

        As :meth:`Mesh.restart_trainers`: a group that lost a rank cannot be reused, so every
        rank is stopped (its actor too) and new ones rendezvous afresh; returns the addresses.
        """
        timeout_s = cfg.launcher.ray.start_timeout_s
        with self._lock:
            old = [s for s in self.servers.values() if s.name.startswith("trainer-")]
        for server in old:
            # Survivors may sit in a failed collective: a long drain would only delay this.
            self._stop_one(server, grace_s=5.0)
        bundle_of = {name: j for j, names in enumerate(bundle_layout(cfg)) for name in names}
        trainers = [
            self._new_actor(f"trainer-{r}", bundle_of[f"trainer-{r}"])
            for r in range(cfg.trainer.ranks)
        ]
        nodes = self._get(
            [s.actor.node.remote() for s in trainers], "placing the trainer actors", timeout_s
        )
        for s, node in zip(trainers, nodes, strict=True):
            s.node = node
        self._launch(trainers, self._trainer_argvs(trainers, timeout_s), timeout_s)
        self.trainer_addresses[:] = [s.address for s in trainers]
        wait_healthy(
            [(a, TRAINER_SERVICE) for a in self.trainer_addresses],
            timeout_s=cfg.fault_tolerance.trainer.restart_timeout_s,
        )
        return list(self.trainer_addresses)

    # -- the elastic fleet -------------------------------------------------------------------

    def owns(self, address: str) -> bool:
        """True for a rollout server this launcher started (and can stop)."""
        with self._lock:
            return any(
                s.address == address and s.name.startswith("rollout-")
                for s in self.servers.values()
            )

    def alive(self, address: str) -> bool:
        """False once the rollout server at ``address`` (or its actor) is gone."""
        with self._lock:
            server = next((s for s in self.servers.values() if s.address == address), None)
        if server is None:
            return False
        try:
            return bool(ray.get(server.actor.alive.remote(), timeout=10.0))
        except (RayActorError, GetTimeoutError):
            # A dead actor took its server with it; a stuck one counts as unresponsive.
            return False

    def start_rollout_server(self) -> str:
        """Starts one more rollout server actor (outside the placement group); its address."""
        assert self.cfg is not None
        cfg = self.cfg
        with self._lock:
            if self._closed:
                raise PreconditionError("the run is stopping: no rollout server is started")
            index = self._next_rollout
            self._next_rollout += 1
        check_sglang_url(cfg, index)
        timeout_s = cfg.launcher.ray.start_timeout_s
        server = self._new_actor(f"rollout-{index}", None)
        try:
            server.node = self._get(
                [server.actor.node.remote()], f"placing rollout-{index}", timeout_s
            )[0]
            argv = _networked(rollout_argv(cfg, index), server.node["node_ip"])
            self._launch([server], [argv], timeout_s)
            wait_healthy([(server.address, ROLLOUT_SERVICE)], timeout_s=timeout_s)
        except BaseException:
            self._kill(server)
            raise
        self.rollout_addresses.append(server.address)
        return server.address

    def stop_rollout_server(self, address: str, grace_s: float = STOP_GRACE_S) -> int:
        """Stops the rollout server at ``address`` (SIGKILL after ``grace_s``) and its actor;
        its exit code."""
        with self._lock:
            server = next((s for s in self.servers.values() if s.address == address), None)
        if server is None:
            raise PreconditionError(f"no rollout server at {address} was started by this run")
        code = self._stop_one(server, grace_s)
        if address in self.rollout_addresses:
            self.rollout_addresses.remove(address)
        return code

    # -- stopping ----------------------------------------------------------------------------

    def _kill(self, server: _Server) -> None:
        with self._lock:
            self.servers.pop(server.name, None)
        # Already gone, or Ray itself was shut down by stop() meanwhile.
        with contextlib.suppress(Exception):
            ray.kill(server.actor)

    def _stop_one(self, server: _Server, grace_s: float = STOP_GRACE_S) -> int:
        try:
            code = int(ray.get(server.actor.stop.remote(grace_s), timeout=grace_s + 15.0))
        except (RayActorError, GetTimeoutError) as exc:
            # A dead actor took its server with it (PDEATHSIG); report it as failed.
            log.warning("%s: actor gone or stuck (%s); killing it", server.name, exc)
            code = -9
        self._kill(server)
        return code

    def close(self) -> None:
        """Refuses further starts (stop() closes too)."""
        with self._lock:
            self._closed = True

    def stop(self) -> dict[str, int]:
        """Stops every server, kills the actors, removes the placement group, leaves Ray."""
        self.close()
        if not ray.is_initialized():
            return {}
        with self._lock:
            servers = list(self.servers.values())
        codes: dict[str, int] = {}
        refs = {s.name: s.actor.stop.remote() for s in servers}
        for s in servers:
            try:
                codes[s.name] = int(ray.get(refs[s.name], timeout=STOP_GRACE_S + 15.0))
            except (RayActorError, GetTimeoutError) as exc:
                log.warning("%s: actor gone or stuck (%s)", s.name, exc)
                codes[s.name] = -9
            self._kill(s)
        if self.placement is not None:
            try:
                remove_placement_group(self.placement)
            except RayError as exc:
                log.warning("removing the placement group failed: %s", exc)
            self.placement = None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False
        return codes


def _connect(cfg: RunConfig) -> bool:
    """Joins the configured cluster or starts a private instance; True if this call did."""
    if ray.is_initialized():
        return False
    la = cfg.launcher
    kwargs: dict[str, Any] = {
        "log_to_driver": False,  # servers log to their own files under output.dir/logs
        "include_dashboard": False,
    }
    if la.ray.address is None:
        demand = cfg.trainer.ranks * la.trainer_cpus + cfg.rollout.num_servers * la.rollout_cpus
        # Logical CPUs: enough for the layout plus room for servers added mid-run.
        kwargs["num_cpus"] = int(demand + 0.999) + (os.cpu_count() or 1)
        gpus = cfg.trainer.ranks * la.trainer_gpus + cfg.rollout.num_servers * la.rollout_gpus
        if gpus > 0:
            kwargs["num_gpus"] = int(gpus + 0.999)
        # Only small arguments travel through the object store.
        kwargs["object_store_memory"] = 128 * 1024 * 1024
    elif la.ray.address.startswith("ray://"):
        kwargs = {"address": la.ray.address}  # Ray Client takes no driver options
    else:
        kwargs["address"] = la.ray.address
    ray.init(**kwargs)
    return True


def start_ray_mesh(
    cfg: RunConfig,
    log_dir: Path,
    mesh: Mesh | None = None,
    cancelled: threading.Event | None = None,
) -> RayMesh:
    """Starts the mesh on Ray and waits until it is healthy (stopped here on any error).

    Pass the :class:`RayMesh` from :func:`areal_grpc.coordinator.launcher.new_mesh` as ``mesh`` to
    be able to stop it whatever happens.
    """
    if not isinstance(mesh, RayMesh):
        mesh = RayMesh([], [], log_dir=log_dir)
    mesh.cfg = cfg
    mesh.log_dir = mesh.log_dir or log_dir
    try:
        t0 = time.monotonic()
        mesh.owns_ray = _connect(cfg)
        mesh.timings["ray_init"] = time.monotonic() - t0
        mesh.start(cancelled)
    except BaseException:
        mesh.stop()
        raise
    return mesh
