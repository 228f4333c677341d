"""The command line shared by the server entry points (areal-rollout, areal-trainer, ...)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from areal_grpc import tracing
from areal_grpc.security import ServerTls
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
    sec = parser.add_argument_group("security")
    sec.add_argument("--tls-cert", help="server certificate chain (PEM); enables TLS")
    sec.add_argument("--tls-key", help="server private key (PEM)")
    sec.add_argument("--tls-client-ca", help="CA for client certificates (PEM); enables mTLS")
    sec.add_argument(
        "--auth-token-file",
        help="file holding the bearer token calls must carry (or set AREAL_AUTH_TOKEN)",
    )
    sec.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="allow serving without TLS on a non-loopback address",
    )
    return parser


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    """ServerOptions from the common options (address, TLS, auth)."""
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)
    elif args.tls_client_ca:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
    token = os.environ.get("AREAL_AUTH_TOKEN") or None
    if args.auth_token_file:
        token = Path(args.auth_token_file).read_text().strip()
    return ServerOptions(
        host=args.host,
        port=args.port,
        tls=tls,
        allow_plaintext=args.allow_plaintext,
        auth_token=token,
    )


def serve_main(
    parser: argparse.ArgumentParser, build: BuildServices, argv: Sequence[str] | None = None
) -> int:
    """Parses ``argv``, builds the services and serves them until SIGTERM/SIGINT."""
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    options = server_options_from_args(args)
    # service.name in traces: areal-rollout, areal-trainer, areal-coordinator.
    tracing.init_tracing(parser.prog)

    async def run() -> None:
        services = await build(args)
        running = await start_server(services, options)
        # One line on stdout that launchers parse to learn the bound port.
        print(f"LISTENING {running.address}", flush=True)
        await serve_until_signal(running)

    try:
        asyncio.run(run())
    finally:
        tracing.shutdown_tracing()
    return 0
