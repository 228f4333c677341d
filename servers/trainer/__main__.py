"""``areal-trainer``: serves TrainerService for one rank of the trainer group.

Start one process per rank, e.g. two ranks over gloo on one machine::

    areal-trainer --port 0 --rank 0 --world-size 2 --master-port 29510 model.source=builtin:tiny
    areal-trainer --port 0 --rank 1 --world-size 2 --master-port 29510 model.source=builtin:tiny

Every training setting comes from the run config, as the coordinator reads it: ``--config
run.yaml`` (the coordinator's own file) and ``key=value`` overrides (``trainer.optimizer.lr=2e-5``);
see areal_grpc.server_config.

Under torchrun, leave out --rank/--world-size/--master-*: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from the environment, and the default gRPC port is 50071 + LOCAL_RANK. The
gRPC port is bound (and ``LISTENING host:port`` printed) before the process group forms, so a
launcher can start the ranks one by one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.server import Service
from areal_grpc.server_config import TRAINER_SECTIONS, add_run_config_args, run_config_from_args
from areal_grpc.shared_memory import release_own

DEFAULT_PORT = 50071


def add_trainer_args(parser: argparse.ArgumentParser) -> None:
    """The rank's own options (process group, device), then the run config."""
    g = parser.add_argument_group("this rank")
    g.add_argument("--rank", type=int, default=None, help="rank (default: $RANK or 0)")
    g.add_argument("--world-size", type=int, default=None, help="ranks ($WORLD_SIZE or 1)")
    g.add_argument("--master-addr", default=None, help="rendezvous host ($MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port ($MASTER_PORT)")
    g.add_argument(
        "--device", default=None, help="cpu | cuda[:i] (default: trainer.device, auto per rank)"
    )
    add_run_config_args(parser)


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The services of a trainer rank (the engine builds in the background)."""
    # The run config is checked before torch is imported: a bad setting answers at once.
    run = run_config_from_args(args, TRAINER_SECTIONS)
    from areal_servers.trainer.build import trainer_services

    return trainer_services(run, args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-trainer``."""
    # Under torchrun several ranks share a node: each local rank gets its own default port
    # (50071 + LOCAL_RANK), so one command line serves every rank.
    default_port = DEFAULT_PORT + int(os.environ.get("LOCAL_RANK", "0"))
    parser = base_parser("areal-trainer", "Serve one trainer rank.", default_port)
    add_trainer_args(parser)
    code = serve_main(parser, build, argv)
    # The version in shared memory goes with us (os._exit skips atexit).
    release_own()
    # Everything worth keeping is on disk or sent by now. torch's C++ teardown of a gloo group
    # whose peer left mid-collective can std::terminate (SIGABRT), so skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
