"""``areal-coordinator``: serves CoordinatorService on its own (attach mode)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from areal.v1 import coordinator_pb2, coordinator_pb2_grpc

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.server import Service, service

DEFAULT_PORT = 50051


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The coordinator's services (handlers arrive with the coordinator issue)."""
    return [
        service(
            coordinator_pb2_grpc.CoordinatorServiceServicer(),
            coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
            coordinator_pb2,
        )
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-coordinator``."""
    parser = base_parser("areal-coordinator", "Serve the CoordinatorService.", DEFAULT_PORT)
    return serve_main(parser, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
