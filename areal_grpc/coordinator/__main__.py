"""``python -m areal_grpc.coordinator``: run asynchronous RL on the mesh.

With no arguments: starts the local mesh (rollout server(s) and two trainer ranks as
subprocesses on free loopback ports), trains the built-in task, writes metrics, a plot and
the final model under ``output.dir``, stops the mesh and exits 0. Examples::

    python -m areal_grpc.coordinator
    python -m areal_grpc.coordinator --config run.yaml trainer.optimizer.lr=5e-4 \\
        staleness.max_staleness=0
    python -m areal_grpc.coordinator launcher.mode=attach \\
        'launcher.attach.rollout_addresses=[10.0.0.5:50061]' \\
        'launcher.attach.trainer_addresses=[10.0.0.6:50071,10.0.0.7:50071]'
    python -m areal_grpc.coordinator --resume output.dir=outputs/run   # after a stop or crash

Ctrl-C (SIGINT) or SIGTERM stops the run and every child process cleanly (exit code 130 /
143); checkpoints already committed stay usable with ``--resume``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from areal_grpc import tracing
from areal_grpc.config import RunConfig, describe, load_config, preflight, to_yaml
from areal_grpc.coordinator.launcher import new_mesh
from areal_grpc.coordinator.loop import RolloutFleetLost, TrainerGroupFailed
from areal_grpc.coordinator.run import Run
from areal_grpc.coordinator.slurm import check_slurm
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.launch import LaunchError
from areal_grpc.model_source import locate_source
from areal_grpc.paths import check_replaceable

__all__ = ["main", "parse_args", "run"]

log = logging.getLogger("areal_grpc.coordinator")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options of a run."""
    parser = argparse.ArgumentParser(
        prog="python -m areal_grpc.coordinator",
        description="Run asynchronous RL (GRPO) on a mesh of gRPC services. With no "
        "arguments: the built-in tiny model and task on a local mesh.",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        help="YAML file of settings (areal_grpc.config); repeat it to layer several, the last "
        "winning, e.g. --config configs/algorithms/dapo.yaml --config run.yaml",
    )
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
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. trainer.optimizer.lr=5e-4",
    )
    return parser.parse_args(argv)


class Progress:
    """A rich progress bar with reward, eval, the train/rollout log-prob gap (the latest
    measured ``logp_gap_mean``) and step time; plain lines without the gap when not a TTY."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None
        self._eval: float | None = None
        # The latest measured train/rollout gap (not every step trains fresh tokens).
        self._gap: float | None = None

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
            TextColumn("gap {task.fields[gap]}"),
            TextColumn("{task.fields[step_s]} s/step"),
            TimeElapsedColumn(),
        )
        self._bar.start()
        self._task = self._bar.add_task(
            "train", total=total, completed=done, reward="-", eval="-", gap="-", step_s="-"
        )

    def update(self, record: dict[str, Any]) -> None:
        """Advances to the step in ``record`` (a metrics record)."""
        if record.get("eval_accuracy") is not None:
            self._eval = record["eval_accuracy"]
        ev = "-" if self._eval is None else f"{self._eval:.3f}"
        if record.get("logp_gap_mean") is not None:
            self._gap = record["logp_gap_mean"]
        gap = "-" if self._gap is None else f"{self._gap:.1e}"
        if self._bar is None:
            # The plain line keeps its documented form; the gap is in metrics.jsonl.
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
            gap=gap,
            step_s=f"{record['step_s']:.2f}",
        )

    def stop(self) -> None:
        """Removes the live display."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


async def run(cfg: RunConfig, resume: bool = False) -> int:
    """Brings the run up, trains to the end, reports, and stops everything."""
    async with Run(cfg) as active:
        progress = Progress(cfg.output.progress_bar and sys.stdout.isatty())
        result = await active.train(resume=resume, progress=progress)
        print(
            f"done: {result.steps} steps, version {result.version}, "
            f"reward {_fmt(result.first_reward)} -> {_fmt(result.last_reward)}, "
            f"eval {_fmt(result.first_eval)} -> {_fmt(result.last_eval)}, "
            f"{result.wall_s:.0f} s",
            flush=True,
        )
        print(f"metrics: {active.out_dir / 'metrics.jsonl'}", flush=True)
        if result.plot_path:
            print(f"plot: {result.plot_path}", flush=True)
        if result.export_path:
            print(f"model: {result.export_path}", flush=True)
    return 0


def check_launch(cfg: RunConfig) -> None:
    """What would stop the run at launch, found before anything starts (FieldError).

    The output directory must be creatable, and ``launcher.host`` / ``coordinator_port`` a
    local address this process can listen on (every mode serves CoordinatorService there; the
    local launcher's children bind the same host). The files and packages the config names
    must be here.
    """
    preflight(cfg)
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
