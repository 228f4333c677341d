"""What the servers take from the run config: one definition of every setting and its default.

A rollout server and a trainer rank read the same :class:`~areal_grpc.config.RunConfig` the
coordinator runs on (``--config`` a YAML file or the inline document a launcher passes, then
``key=value`` overrides, as on the coordinator's command line) and derive their own settings
from it with the functions here. Their command lines add only what differs between processes
of one run: address, rank, rendezvous, device, SGLang URL.

    areal-trainer --port 0 --rank 0 --world-size 2 --master-port 29510 \\
        --config run.yaml trainer.optimizer.lr=2e-5
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from pathlib import Path

from areal_grpc.config import RunConfig, load_config, preflight, to_json
from areal_grpc.tasks import TASKS

__all__ = [
    "ROLLOUT_SECTIONS",
    "TRAINER_SECTIONS",
    "add_run_config_args",
    "config_argv",
    "for_servers",
    "max_new_tokens",
    "run_config_from_args",
    "trainer_path_roots",
    "weights_root",
]

# The sections each server checks (a server on another node need not see the data files).
ROLLOUT_SECTIONS = ("run", "model", "rollout", "weight_sync", "output")
TRAINER_SECTIONS = ("run", "model", "rollout", "trainer", "weight_sync", "checkpoint", "output")


def add_run_config_args(parser: argparse.ArgumentParser) -> None:
    """``--config`` and the ``key=value`` overrides, as the coordinator takes them."""
    g = parser.add_argument_group("run config (the coordinator's keys; see --print-config)")
    g.add_argument(
        "--config",
        action="append",
        default=None,
        help="the run's YAML config file (or the document itself, as launchers pass it)",
    )
    g.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. trainer.optimizer.lr=2e-5",
    )


def run_config_from_args(args: argparse.Namespace, sections: Sequence[str]) -> RunConfig:
    """The run config a server's command line describes (FieldError names a bad key)."""
    cfg = load_config(args.config, args.overrides, sections=sections)
    preflight(cfg, sections)
    return cfg


def config_argv(cfg: RunConfig) -> list[str]:
    """The arguments handing ``cfg`` to a server of the run."""
    return ["--config", to_json(for_servers(cfg))]


def for_servers(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its directories absolute: a server may start in another directory."""
    out = copy.deepcopy(cfg)
    out.output.dir = str(Path(cfg.output.dir).resolve())
    if cfg.checkpoint.dir:
        out.checkpoint.dir = str(Path(cfg.checkpoint.dir).resolve())
    if cfg.weight_sync.disk_root:
        out.weight_sync.disk_root = str(Path(cfg.weight_sync.disk_root).resolve())
    return out


def max_new_tokens(cfg: RunConfig) -> int:
    """Configured max_new_tokens, else the built-in task's answer length, else 16."""
    if cfg.rollout.sampling.max_new_tokens is not None:
        return cfg.rollout.sampling.max_new_tokens
    task = TASKS.get(cfg.data.task)
    return task.max_new_tokens if task is not None else 16


def weights_root(cfg: RunConfig) -> str | None:
    """Directory of DISK weight updates (trainer rank 0 writes, rollout servers read); None
    when the run does not use the disk method."""
    if "disk" not in cfg.weight_sync.accepted_methods():
        return None
    root = cfg.weight_sync.disk_root or str(Path(cfg.output.dir) / "weights")
    return str(Path(root).resolve())


def trainer_path_roots(cfg: RunConfig) -> list[str]:
    """Where trainer ranks may write checkpoints and exports: the run's output directory, and
    the checkpoint directory when it lies elsewhere."""
    roots = [Path(cfg.output.dir).resolve()]
    if cfg.checkpoint.dir:
        ck = Path(cfg.checkpoint.dir).resolve()
        if not ck.is_relative_to(roots[0]):
            roots.append(ck)
    return [str(r) for r in roots]
