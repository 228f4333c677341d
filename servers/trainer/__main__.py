"""``areal-trainer``: serves TrainerService for one rank of the trainer group."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from areal.v1 import trainer_pb2, trainer_pb2_grpc

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.server import Service, service

DEFAULT_PORT = 50071


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The services of a trainer rank (handlers arrive with the trainer issue)."""
    return [
        service(
            trainer_pb2_grpc.TrainerServiceServicer(),
            trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
            trainer_pb2,
        )
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-trainer``."""
    parser = base_parser("areal-trainer", "Serve one trainer rank.", DEFAULT_PORT)
    return serve_main(parser, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
