"""``areal-coordinator``: CoordinatorService on its own, without a training loop.

It admits external producers under the staleness rule (leases with deadlines), validates
and buffers their submissions, reports status and versions, and keeps the worker registry.
Nothing trains what it buffers: a full run is ``python -m areal_grpc.coordinator``
(``areal-run``), which serves the same service in-process (``launcher.coordinator_port``).
Useful to develop and test a producer in any language against the real contract.

It reads the run config as the training run does (``--config run.yaml``, ``key=value``
overrides), with the same defaults: ``staleness.batch_size``, ``staleness.max_staleness``,
``staleness.lease_ttl_s`` and ``rollout.max_concurrent_rollouts``::

    areal-coordinator --port 50051 staleness.batch_size=8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.errors import FieldError
from areal_grpc.server import Service
from areal_grpc.server_config import add_run_config_args, run_config_from_args

DEFAULT_PORT = 50051


# Flags of earlier versions, and the run-config keys that replaced them.
REPLACED_FLAGS = {
    "--batch-size": "staleness.batch_size",
    "--max-staleness": "staleness.max_staleness",
    "--max-concurrent-rollouts": "rollout.max_concurrent_rollouts",
    "--lease-ttl-s": "staleness.lease_ttl_s",
}
SECTIONS = ("run", "staleness", "rollout")


def add_coordinator_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The standalone coordinator's options: its own, then the run config."""
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="reject token ids at or above this"
    )
    for flag, key in REPLACED_FLAGS.items():
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS, dest=f"old_{key}")
    add_run_config_args(parser)
    return parser


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The coordinator's services over a fresh work pool (no dataset, no loop), under the run
    config's staleness rule: the same keys and defaults as a training run."""
    for flag, key in REPLACED_FLAGS.items():
        if getattr(args, f"old_{key}") is not None:
            raise FieldError(flag, f"no longer read: use {key}={getattr(args, f'old_{key}')}")
    run = run_config_from_args(args, SECTIONS)
    s = run.staleness
    pool = WorkPool(
        s.batch_size,
        s.max_staleness,
        run.rollout.max_concurrent_rollouts,
        lease_ttl_s=s.lease_ttl_s,
        vocab_size=args.vocab_size,
    )
    servicer = CoordinatorServicer(pool)
    servicer.start()
    return [servicer.as_service()]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-coordinator``."""
    parser = base_parser("areal-coordinator", "Serve the CoordinatorService.", DEFAULT_PORT)
    return serve_main(add_coordinator_args(parser), build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
