"""A training run as one async context: its mesh, its Coordinator, the CoordinatorService and
the gateway, started in that order and stopped in reverse on every exit path::

    async with Run(cfg) as run:
        result = await run.train(resume=False)

``python -m areal_grpc.coordinator`` (``areal-run``) is parse, build, and this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from arealgrpc.v1 import coordinator_pb2

from areal_grpc.cli import plaintext_weights_warning, run_channel_options, run_server_options
from areal_grpc.config import RunConfig, to_yaml
from areal_grpc.coordinator.gateway_process import GatewayProcess
from areal_grpc.coordinator.launcher import Mesh, fleet_launcher, new_mesh, start_mesh
from areal_grpc.coordinator.loop import Coordinator, RunResult, fleet_available, fleet_weight_sync
from areal_grpc.coordinator.mesh import local_precision
from areal_grpc.coordinator.service import CoordinatorServicer, Worker, WorkerHooks
from areal_grpc.errors import FieldError
from areal_grpc.launch import Child
from areal_grpc.model_source import ready_source
from areal_grpc.server import ChannelCache, RunningServer, set_default_channel_options, start_server

__all__ = ["Run", "prepared_source"]

log = logging.getLogger("areal_grpc.coordinator")

# RolloutReport.state -> the wire's RolloutServerState.
ROLLOUT_STATES = {
    "serving": coordinator_pb2.ROLLOUT_SERVER_STATE_SERVING,
    "joining": coordinator_pb2.ROLLOUT_SERVER_STATE_JOINING,
    "restarting": coordinator_pb2.ROLLOUT_SERVER_STATE_RESTARTING,
    "down": coordinator_pb2.ROLLOUT_SERVER_STATE_DOWN,
}


def prepared_source(source: str) -> str:
    """The source every child of the run loads (a GGUF file or named model converted first)."""
    ready = ready_source(source)
    if ready is not None:
        return ready
    # Seconds of torch and transformers imports, paid only for a conversion not yet cached.
    from areal_grpc.model import resolve_source

    return resolve_source(source)


class Run:
    """One training run of ``cfg``, writing under ``output.dir``."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg.output.dir)
        self.log_dir = self.out_dir / "logs"
        self.mesh: Mesh | None = None
        self.coordinator: Coordinator | None = None
        self.servicer: CoordinatorServicer | None = None
        self.server: RunningServer | None = None
        self.gateway: GatewayProcess | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Run:
        try:
            await self._prepare()
            await self._start_mesh()
            self._start_coordinator()
            await self._serve()
            await self._start_gateway()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

    async def train(self, resume: bool = False, progress: Any = None) -> RunResult:
        """Runs the loop to ``total_steps`` (from the latest checkpoint with ``resume``)."""
        assert self.coordinator is not None, "train() runs inside `async with Run(cfg)`"
        return await self.coordinator.run(resume=resume, progress=progress)

    def _write_mesh(self) -> None:
        assert self.mesh is not None
        self.mesh.write(self.out_dir / "mesh.json")

    async def _prepare(self) -> None:
        """The output directory, the resolved config in it, and the model every child loads."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(to_yaml(self.cfg))
        cfg = self.cfg
        if cfg.launcher.mode in ("local", "slurm"):
            # A GGUF file or named model is converted here, once, and every child loads the
            # same converted directory (Ray nodes and attached servers resolve it themselves).
            source = await asyncio.to_thread(prepared_source, cfg.model.source)
            if source != cfg.model.source:
                print(f"model: {cfg.model.source} -> {source}", flush=True)
                model = dataclasses.replace(cfg.model, source=source)
                self.cfg = dataclasses.replace(cfg, model=model)
            # Ray nodes and attached servers decide on their own hardware and log it there.
            print(local_precision(cfg), flush=True)
        # Every channel this process opens (health probes, rollout and trainer clients, the
        # fleet update) speaks the run's TLS and token; restored at the end for in-process
        # callers.
        previous = set_default_channel_options(run_channel_options(self.cfg.security))
        self._stack.callback(set_default_channel_options, previous)

    async def _start_mesh(self) -> None:
        cfg = self.cfg
        mesh = self.mesh = new_mesh(cfg, self.log_dir)
        self._stack.push_async_callback(self._stop_mesh)
        # Children start in a thread so the event loop keeps handling signals meanwhile; on
        # Ctrl-C the thread stops between children and the exit stack stops the rest.
        cancelled = threading.Event()
        starter = asyncio.ensure_future(
            asyncio.to_thread(start_mesh, cfg, self.log_dir, mesh, cancelled)
        )
        try:
            await asyncio.shield(starter)
        except asyncio.CancelledError:
            cancelled.set()
            await asyncio.wait([starter])
            raise
        self._write_mesh()
        print(
            f"mesh: rollout {mesh.rollout_addresses} trainer {mesh.trainer_addresses}", flush=True
        )

    async def _stop_mesh(self) -> None:
        mesh = self.mesh
        assert mesh is not None
        # A Ray mesh has no local children but actors, a placement group and maybe Ray.
        if mesh.children or self.cfg.launcher.mode == "ray":
            codes = await asyncio.to_thread(mesh.stop)
            bad = {k: v for k, v in codes.items() if v != 0}
            print("mesh stopped" + (f" (exit codes {bad})" if bad else " cleanly"), flush=True)

    def _start_coordinator(self) -> None:
        cfg, mesh = self.cfg, self.mesh
        assert mesh is not None
        sync = cfg.weight_sync.enabled
        if sync and not fleet_available():
            log.warning("areal_clients.fleet is not installed: weight sync is off")
            sync = False
        warning = plaintext_weights_warning(cfg.security, cfg.weight_sync.accepted_methods())
        if sync and warning:
            log.warning(warning)
        self.fleet = fleet_launcher(cfg, mesh)
        if self.fleet is not None:
            # A rollout server still starting must not outlive the run.
            self._stack.callback(self.fleet.close)
        # The weight updates' channels, kept from one step's update to the next.
        sync_channels = ChannelCache()
        self._stack.push_async_callback(sync_channels.aclose)
        self.coordinator = Coordinator(
            cfg,
            mesh.rollout_addresses,
            mesh.trainer_addresses,
            self.out_dir,
            weight_sync=functools.partial(fleet_weight_sync, channels=sync_channels)
            if sync
            else None,
            # Attach mode (None): the ranks' own supervisor restarts them; the coordinator
            # waits for them.
            restart_trainers=self._restart_trainers if cfg.launcher.mode != "attach" else None,
            # Attach mode (None): a lost rollout server is waited for, not replaced.
            launcher=self.fleet,
            rollout_replaced=self._rollout_replaced,
        )
        self._stack.push_async_callback(self.coordinator.close)

    async def _restart_trainers(self, addresses: Sequence[str]) -> list[str]:
        # A failed trainer group is replaced by fresh ranks (subprocesses or Ray actors);
        # mesh.json follows.
        assert self.mesh is not None
        new = await asyncio.to_thread(self.mesh.restart_trainers, self.cfg)
        self._write_mesh()
        print(f"trainer group restarted: {new}", flush=True)
        return new

    def _rollout_replaced(self, old: str, new: str | None) -> None:
        # A dead rollout server was replaced (or, restarts spent, dropped): mesh.json and the
        # listed worker follow.
        self._write_mesh()
        if new is None:
            return
        print(f"rollout server restarted: {old} -> {new}", flush=True)
        if self.servicer is not None:
            for worker in self.servicer.workers.values():
                if worker.address == old:
                    worker.address = new

    async def _serve(self) -> None:
        """CoordinatorService over the run's pool, with the mesh's servers as its workers."""
        cfg, mesh, coordinator = self.cfg, self.mesh, self.coordinator
        assert mesh is not None and coordinator is not None
        hooks = WorkerHooks(
            self._add_worker,
            self._remove_worker,
            self._refresh_worker,
            fleet=self.fleet,
            fleet_changed=self._write_mesh,
            rollout_restarts=lambda: coordinator.rollout_restarts,
        )
        servicer = self.servicer = CoordinatorServicer(coordinator.pool, hooks=hooks)
        for i, a in enumerate(mesh.rollout_addresses):
            servicer.add_local_worker(coordinator_pb2.WORKER_ROLE_ROLLOUT, a, f"rollout-{i}")
        for i, a in enumerate(mesh.trainer_addresses):
            servicer.add_local_worker(coordinator_pb2.WORKER_ROLE_TRAINER, a, f"trainer-{i}")
        server = self.server = await start_server(
            [servicer.as_service()],
            run_server_options(cfg.security, cfg.launcher.host, cfg.launcher.coordinator_port),
        )
        self._stack.push_async_callback(server.stop, 0)
        self._stack.push_async_callback(servicer.stop)
        servicer.start()
        print(f"COORDINATOR {server.address}", flush=True)

    async def _add_worker(self, worker: Worker) -> None:
        assert self.coordinator is not None
        if worker.role != coordinator_pb2.WORKER_ROLE_ROLLOUT:
            raise FieldError(
                "role", "trainer ranks form a fixed SPMD group; start the run with them"
            )
        await self.coordinator.add_rollout_server(worker.address)

    async def _remove_worker(self, worker: Worker) -> int:
        assert self.coordinator is not None
        return await self.coordinator.remove_rollout_server(worker.address)

    def _refresh_worker(self, worker: Worker) -> None:
        coordinator = self.coordinator
        assert coordinator is not None
        if worker.role == coordinator_pb2.WORKER_ROLE_ROLLOUT:
            report = coordinator.rollout_report(worker.address)
            worker.healthy = report is not None and report.state == "serving"
            worker.state = ROLLOUT_STATES[report.state if report is not None else "down"]
            if report is not None:
                worker.restarts = report.restarts
                if report.state == "serving":
                    worker.policy_version = report.policy_version
        else:
            worker.policy_version = coordinator.trainer_version

    async def _start_gateway(self) -> None:
        if not self.cfg.gateway.enabled:
            return
        assert self.server is not None and self.mesh is not None
        mesh = self.mesh

        # mesh.json lists the gateway's current process with the others.
        def started(child: Child) -> None:
            mesh.gateway = child
            self._write_mesh()

        gateway = self.gateway = GatewayProcess(
            self.cfg, self.server.address, self.log_dir, started
        )
        self._stack.push_async_callback(gateway.stop)
        await gateway.start()
