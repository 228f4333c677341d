"""The command line shared by the server entry points (areal-rollout, areal-trainer, ...)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from areal_grpc import tracing
from areal_grpc.server import ServerOptions, Service, serve_until_signal, start_server

BuildServices = Callable[[argparse.Namespace], Awaitable[Sequence[Service]]]


def base_parser(prog: str, description: str, default_port: int) -> argparse.ArgumentParser:
    """A parser with the options every server takes."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=default_port, help="port to bind; 0 picks a free one"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    return parser


def serve_main(
    parser: argparse.ArgumentParser, build: BuildServices, argv: Sequence[str] | None = None
) -> int:
    """Parses ``argv``, builds the services and serves them until SIGTERM/SIGINT."""
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    # service.name in traces: areal-rollout, areal-trainer, areal-coordinator.
    tracing.init_tracing(parser.prog)

    async def run() -> None:
        services = await build(args)
        running = await start_server(services, ServerOptions(host=args.host, port=args.port))
        # One line on stdout that launchers parse to learn the bound port.
        print(f"LISTENING {running.address}", flush=True)
        await serve_until_signal(running)

    try:
        asyncio.run(run())
    finally:
        tracing.shutdown_tracing()
    return 0
