"""``areal-coordinator``: CoordinatorService on its own, without a training loop.

It admits external producers under the staleness rule (leases with deadlines), validates
and buffers their submissions, reports status and versions, and keeps the worker registry.
Nothing trains what it buffers: a full run is ``python -m areal_grpc.coordinator``, which
serves the same service in-process (``launcher.coordinator_port``). Useful to develop and
test a producer in any language against the real contract.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.server import Service

DEFAULT_PORT = 50051


def add_coordinator_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The standalone coordinator's options."""
    parser.add_argument("--batch-size", type=int, default=32, help="groups per step (B)")
    parser.add_argument("--max-staleness", type=int, default=2, help="eta")
    parser.add_argument(
        "--max-concurrent-rollouts", type=int, default=None, help="default: --batch-size"
    )
    parser.add_argument("--lease-ttl-s", type=float, default=60.0, help="lease lifetime")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="reject token ids at or above this"
    )
    return parser


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The coordinator's services over a fresh work pool (no dataset, no loop)."""
    pool = WorkPool(
        args.batch_size,
        args.max_staleness,
        args.max_concurrent_rollouts,
        lease_ttl_s=args.lease_ttl_s,
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
