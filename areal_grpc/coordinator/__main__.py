"""``python -m areal_grpc.coordinator``: run asynchronous RL on the mesh.

With no arguments: starts the local mesh (rollout server(s) and two trainer ranks as
subprocesses on free loopback ports), trains the built-in task, writes metrics, a plot and
the final model under ``output.dir``, stops the mesh and exits 0. Examples::

    python -m areal_grpc.coordinator
    python -m areal_grpc.coordinator --config run.yaml trainer.lr=5e-4 staleness.max_staleness=0
    python -m areal_grpc.coordinator launcher.mode=attach \\
        'launcher.rollout_addresses=[10.0.0.5:50061]' \\
        'launcher.trainer_addresses=[10.0.0.6:50071,10.0.0.7:50071]'
    python -m areal_grpc.coordinator --resume output.dir=outputs/run   # after a stop or crash

Ctrl-C (SIGINT) or SIGTERM stops the run and every child process cleanly (exit code 130 /
143); checkpoints already committed stay usable with ``--resume``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import functools
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arealgrpc.v1 import coordinator_pb2

from areal_grpc import tracing
from areal_grpc.cli import plaintext_weights_warning, run_channel_options, run_server_options
from areal_grpc.config import RunConfig, describe, load_config, to_yaml
from areal_grpc.coordinator.gateway_process import GatewayProcess
from areal_grpc.coordinator.launcher import fleet_launcher, new_mesh, start_mesh
from areal_grpc.coordinator.loop import (
    Coordinator,
    RolloutFleetLost,
    TrainerGroupFailed,
    fleet_available,
    fleet_weight_sync,
)
from areal_grpc.coordinator.service import CoordinatorServicer, Worker, WorkerHooks
from areal_grpc.coordinator.slurm import check_slurm
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.launch import Child, LaunchError
from areal_grpc.model_source import locate_source, ready_source
from areal_grpc.paths import check_replaceable
from areal_grpc.server import ChannelCache, set_default_channel_options, start_server

__all__ = ["main", "parse_args", "run"]

log = logging.getLogger("areal_grpc.coordinator")

# RolloutReport.state -> the wire's RolloutServerState.
ROLLOUT_STATES = {
    "serving": coordinator_pb2.ROLLOUT_SERVER_STATE_SERVING,
    "joining": coordinator_pb2.ROLLOUT_SERVER_STATE_JOINING,
    "restarting": coordinator_pb2.ROLLOUT_SERVER_STATE_RESTARTING,
    "down": coordinator_pb2.ROLLOUT_SERVER_STATE_DOWN,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options of a run."""
    parser = argparse.ArgumentParser(
        prog="python -m areal_grpc.coordinator",
        description="Run asynchronous RL (GRPO) on a mesh of gRPC services. With no "
        "arguments: the built-in tiny model and task on a local mesh.",
    )
    parser.add_argument("--config", default=None, help="YAML file of settings (areal_grpc.config)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in output.dir"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    parser.add_argument(
        "--explain",
        nargs="?",
        const="",
        metavar="KEY",
        help="print each setting (under KEY, e.g. trainer.ppo) with its default, choices and "
        "meaning, and exit",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=5e-4"
    )
    return parser.parse_args(argv)


class Progress:
    """A rich progress bar with reward, eval and step time (plain lines when not a TTY)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None
        self._eval: float | None = None

    def start(self, done: int, total: int) -> None:
        """Shows the bar at ``done`` of ``total`` steps."""
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("eval {task.fields[eval]}"),
            TextColumn("{task.fields[step_s]} s/step"),
            TimeElapsedColumn(),
        )
        self._bar.start()
        self._task = self._bar.add_task(
            "train", total=total, completed=done, reward="-", eval="-", step_s="-"
        )

    def update(self, record: dict[str, Any]) -> None:
        """Advances to the step in ``record`` (a metrics record)."""
        if record.get("eval_accuracy") is not None:
            self._eval = record["eval_accuracy"]
        ev = "-" if self._eval is None else f"{self._eval:.3f}"
        if self._bar is None:
            print(
                f"step {record['step']}: reward {record['reward_mean']:.3f} eval {ev} "
                f"version {record['version']} {record['step_s']:.2f} s/step",
                flush=True,
            )
            return
        self._bar.update(
            self._task,
            completed=record["step"],
            reward=f"{record['reward_mean']:.3f}",
            eval=ev,
            step_s=f"{record['step_s']:.2f}",
        )

    def stop(self) -> None:
        """Removes the live display."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


async def run(cfg: RunConfig, resume: bool = False) -> int:
    """Brings the mesh up, serves CoordinatorService, runs the loop, stops everything."""
    out_dir = Path(cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(to_yaml(cfg))
    if cfg.launcher.mode in ("local", "slurm"):
        # A GGUF file or named model is converted here, once, and every child loads the
        # same converted directory (Ray nodes and attached servers resolve it themselves).
        source = await asyncio.to_thread(prepared_source, cfg.model.source)
        if source != cfg.model.source:
            print(f"model: {cfg.model.source} -> {source}", flush=True)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, source=source))
    log_dir = out_dir / "logs"
    mesh = new_mesh(cfg, log_dir)
    coordinator: Coordinator | None = None
    servicer: CoordinatorServicer | None = None
    server = None
    gateway: GatewayProcess | None = None
    # Every channel this process opens (health probes, rollout and trainer clients, the fleet
    # update) speaks the run's TLS and token; restored at the end for in-process callers.
    previous_channels = set_default_channel_options(run_channel_options(cfg.security))
    # The weight updates' channels, kept from one step's update to the next.
    sync_channels = ChannelCache()
    try:
        # Children start in a thread so the event loop keeps handling signals meanwhile; on
        # Ctrl-C the thread stops between children and the finally below stops the rest.
        cancelled = threading.Event()
        starter = asyncio.ensure_future(
            asyncio.to_thread(start_mesh, cfg, log_dir, mesh, cancelled)
        )
        try:
            await asyncio.shield(starter)
        except asyncio.CancelledError:
            cancelled.set()
            await asyncio.wait([starter])
            raise
        mesh.write(out_dir / "mesh.json")
        print(
            f"mesh: rollout {mesh.rollout_addresses} trainer {mesh.trainer_addresses}", flush=True
        )
        sync = cfg.weight_sync.enabled
        if sync and not fleet_available():
            log.warning("areal_clients.fleet is not installed: weight sync is off")
            sync = False
        warning = plaintext_weights_warning(cfg.security, cfg.weight_sync.accepted_methods())
        if sync and warning:
            log.warning(warning)

        async def restart_trainers(addresses: Sequence[str]) -> list[str]:
            # A failed trainer group is replaced by fresh ranks (subprocesses or Ray actors);
            # mesh.json follows.
            new = await asyncio.to_thread(mesh.restart_trainers, cfg)
            mesh.write(out_dir / "mesh.json")
            print(f"trainer group restarted: {new}", flush=True)
            return new

        fleet = fleet_launcher(cfg, mesh)

        def rollout_replaced(old: str, new: str | None) -> None:
            # A dead rollout server was replaced (or, restarts spent, dropped): mesh.json and
            # the listed worker follow.
            mesh.write(out_dir / "mesh.json")
            if new is None:
                return
            print(f"rollout server restarted: {old} -> {new}", flush=True)
            if servicer is not None:
                for worker in servicer.workers.values():
                    if worker.address == old:
                        worker.address = new

        coordinator = Coordinator(
            cfg,
            mesh.rollout_addresses,
            mesh.trainer_addresses,
            out_dir,
            weight_sync=functools.partial(fleet_weight_sync, channels=sync_channels)
            if sync
            else None,
            # Attach mode (None): the ranks' own supervisor restarts them; the coordinator
            # waits for them.
            restart_trainers=restart_trainers if cfg.launcher.mode != "attach" else None,
            # Attach mode (None): a lost rollout server is waited for, not replaced.
            launcher=fleet,
            rollout_replaced=rollout_replaced,
        )

        async def add(worker: Worker) -> None:
            assert coordinator is not None
            if worker.role != coordinator_pb2.WORKER_ROLE_ROLLOUT:
                raise FieldError(
                    "role", "trainer ranks form a fixed SPMD group; start the run with them"
                )
            await coordinator.add_rollout_server(worker.address)

        async def remove(worker: Worker) -> int:
            assert coordinator is not None
            return await coordinator.remove_rollout_server(worker.address)

        def refresh(worker: Worker) -> None:
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

        hooks = WorkerHooks(
            add,
            remove,
            refresh,
            fleet=fleet,
            fleet_changed=lambda: mesh.write(out_dir / "mesh.json"),
            rollout_restarts=lambda: coordinator.rollout_restarts if coordinator else 0,
        )
        servicer = CoordinatorServicer(coordinator.pool, hooks=hooks)
        for i, a in enumerate(mesh.rollout_addresses):
            servicer.add_local_worker(coordinator_pb2.WORKER_ROLE_ROLLOUT, a, f"rollout-{i}")
        for i, a in enumerate(mesh.trainer_addresses):
            servicer.add_local_worker(coordinator_pb2.WORKER_ROLE_TRAINER, a, f"trainer-{i}")
        server = await start_server(
            [servicer.as_service()],
            run_server_options(cfg.security, cfg.launcher.host, cfg.launcher.coordinator_port),
        )
        servicer.start()
        print(f"COORDINATOR {server.address}", flush=True)
        if cfg.gateway.enabled:
            # mesh.json lists the gateway's current process with the others.
            def gateway_started(child: Child) -> None:
                mesh.gateway = child
                mesh.write(out_dir / "mesh.json")

            gateway = GatewayProcess(cfg, server.address, log_dir, gateway_started)
            await gateway.start()
        progress = Progress(cfg.output.progress_bar and sys.stdout.isatty())
        result = await coordinator.run(resume=resume, progress=progress)
        print(
            f"done: {result.steps} steps, version {result.version}, "
            f"reward {_fmt(result.first_reward)} -> {_fmt(result.last_reward)}, "
            f"eval {_fmt(result.first_eval)} -> {_fmt(result.last_eval)}, "
            f"{result.wall_s:.0f} s",
            flush=True,
        )
        print(f"metrics: {out_dir / 'metrics.jsonl'}", flush=True)
        if result.plot_path:
            print(f"plot: {result.plot_path}", flush=True)
        if result.export_path:
            print(f"model: {result.export_path}", flush=True)
        return 0
    finally:
        if gateway is not None:
            await gateway.stop()
        if servicer is not None:
            await servicer.stop()
        if server is not None:
            await server.stop(0)
        if coordinator is not None:
            await coordinator.close()
        await sync_channels.aclose()
        if servicer is not None and servicer.hooks.fleet is not None:
            servicer.hooks.fleet.close()  # a server still starting must not outlive the run
        # A Ray mesh has no local children but actors, a placement group and maybe Ray.
        if mesh.children or cfg.launcher.mode == "ray":
            codes = await asyncio.to_thread(mesh.stop)
            bad = {k: v for k, v in codes.items() if v != 0}
            print("mesh stopped" + (f" (exit codes {bad})" if bad else " cleanly"), flush=True)
        set_default_channel_options(previous_channels)


def prepared_source(source: str) -> str:
    """The source every child of the run loads (a GGUF file or named model converted first)."""
    ready = ready_source(source)
    if ready is not None:
        return ready
    # Seconds of torch and transformers imports, paid only for a conversion not yet cached.
    from areal_grpc.model import resolve_source

    return resolve_source(source)


def check_launch(cfg: RunConfig) -> None:
    """What would stop the run at launch, found before anything starts (FieldError).

    The output directory must be creatable, and ``launcher.host`` / ``coordinator_port`` a
    local address this process can listen on (every mode serves CoordinatorService there; the
    local launcher's children bind the same host).
    """
    out = Path(cfg.output.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".areal-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise FieldError("output.dir", f"cannot write {out}: {exc.strerror or exc}") from None
    la = cfg.launcher
    if la.mode == "slurm":
        check_slurm()
    try:
        infos = socket.getaddrinfo(la.host, la.coordinator_port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise FieldError("launcher.host", f"cannot resolve {la.host!r}: {exc.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind(sockaddr)
        except OSError as exc:
            key = "launcher.coordinator_port" if exc.errno == errno.EADDRINUSE else "launcher.host"
            raise FieldError(
                key,
                f"cannot listen on {la.host}:{la.coordinator_port}: {exc.strerror or exc}",
            ) from None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, configure, run; 130 on SIGINT, 143 on SIGTERM."""
    args = parse_args(argv)
    if args.explain is not None:
        try:
            print(describe(args.explain), end="")
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.launcher.mode in ("local", "ray", "slurm"):
            try:
                locate_source(cfg.model.source)
            except ValueError as exc:
                raise FieldError("model.source", str(exc)) from None
        if cfg.launcher.mode == "ray":
            new_mesh(cfg, Path(cfg.output.dir))  # names the missing ray extra early
        if not args.print_config:
            check_launch(cfg)
        if cfg.checkpoint.export_hf:
            # Found now, not after the whole run: the export replaces only its own directory.
            try:
                check_replaceable(Path(cfg.output.dir).resolve() / "model", "the model export")
            except PreconditionError as exc:
                raise FieldError("output.dir", str(exc)) from None
    except FieldError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    logging.basicConfig(
        level=cfg.output.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def guarded() -> int:
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        assert main_task is not None
        received: list[int] = []

        def on_signal(sig: int) -> None:
            if not received:
                log.warning("%s: stopping the run and the mesh", signal.Signals(sig).name)
                received.append(sig)
                main_task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await run(cfg, resume=args.resume)
        except asyncio.CancelledError:
            if received:
                return 128 + received[0]
            raise
        except FieldError as exc:
            # A setting found wrong while the mesh starts (a child's arguments, Ray
            # placement): the same one line and status as config validation.
            print(f"config error: {exc}", file=sys.stderr, flush=True)
            return 2
        except LaunchError as exc:
            # A server that could not start (its own error line is in the message) or a
            # cluster that could not place the layout: one line, and 2 when the server
            # refused its configuration.
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        except (TrainerGroupFailed, RolloutFleetLost) as exc:
            # Expected failure modes (no checkpoint, restarts used up, ranks never came back,
            # no rollout server left): one line saying why, not a traceback; committed
            # checkpoints allow --resume.
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1

    # service.name areal-coordinator; children started by the mesh trace themselves from the
    # same OTEL_* environment.
    tracing.init_tracing("areal-coordinator")
    try:
        return asyncio.run(guarded())
    finally:
        tracing.shutdown_tracing()


if __name__ == "__main__":
    sys.exit(main())
