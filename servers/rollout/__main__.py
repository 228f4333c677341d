"""``areal-rollout``: serves RolloutService and WeightSyncService."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from areal.v1 import rollout_pb2, rollout_pb2_grpc, weight_sync_pb2, weight_sync_pb2_grpc

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.server import Service, service

DEFAULT_PORT = 50061


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The services of a rollout server (handlers arrive with the rollout issue)."""
    return [
        service(
            rollout_pb2_grpc.RolloutServiceServicer(),
            rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
            rollout_pb2,
        ),
        service(
            weight_sync_pb2_grpc.WeightSyncServiceServicer(),
            weight_sync_pb2_grpc.add_WeightSyncServiceServicer_to_server,
            weight_sync_pb2,
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-rollout``."""
    parser = base_parser("areal-rollout", "Serve a rollout (inference) server.", DEFAULT_PORT)
    return serve_main(parser, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
