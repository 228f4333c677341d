"""The command line shared by the server entry points (areal-rollout, areal-trainer, ...).

Also the bridge from a run's ``security`` config to those flags (:func:`security_argv`, for
the children a launcher starts) and to the options of the launcher's own server and channels
(:func:`run_server_options`, :func:`run_channel_options`), so that one config secures every
process of a run the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from areal_grpc import tracing
from areal_grpc.config import SecurityConfig
from areal_grpc.errors import FieldError, explain
from areal_grpc.security import ClientTls, ServerTls, load_auth_token
from areal_grpc.server import (
    EXIT_FATAL,
    ChannelOptions,
    ServerOptions,
    Service,
    serve_until_signal,
    set_default_channel_options,
    start_server,
)

log = logging.getLogger(__name__)

# Seconds the servicers get to close after a fatal failure (see serve_main).
FATAL_CLOSE_S = 30.0

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
    sec.add_argument(
        "--tls-ca",
        help="CA (PEM) verifying the servers this process calls; its channels use TLS",
    )
    sec.add_argument(
        "--tls-client-cert", help="certificate (PEM) this process presents as a client (mTLS)"
    )
    sec.add_argument("--tls-client-key", help="private key (PEM) of --tls-client-cert")
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
    return ServerOptions(
        host=args.host,
        port=args.port,
        tls=tls,
        allow_plaintext=args.allow_plaintext,
        auth_token=_token(args),
    )


def _token(args: argparse.Namespace) -> str | None:
    try:
        return load_auth_token(args.auth_token_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--auth-token-file: {exc}") from exc


def channel_options_from_args(args: argparse.Namespace) -> ChannelOptions:
    """Options of the channels this process opens, from --tls-ca and --tls-client-cert/key.

    The bearer token is the one the process's own server expects: a run has one token.
    """
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        raise SystemExit("--tls-client-cert and --tls-client-key go together")
    tls = None
    if args.tls_ca:
        tls = ClientTls(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    elif args.tls_client_cert:
        raise SystemExit("--tls-client-cert needs --tls-ca")
    return ChannelOptions(tls=tls, auth_token=_token(args))


def _abs(path: str) -> str:
    # Children may not share the launcher's working directory (remote launchers).
    return str(Path(path).resolve())


def security_argv(sec: SecurityConfig) -> list[str]:
    """The security flags of a server child of a run configured with ``sec``."""
    argv: list[str] = []
    if sec.tls_cert and sec.tls_key and sec.tls_ca:
        cert, key, ca = _abs(sec.tls_cert), _abs(sec.tls_key), _abs(sec.tls_ca)
        argv += ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
        if sec.mutual_tls:
            argv += ["--tls-client-ca", ca, "--tls-client-cert", cert, "--tls-client-key", key]
    if sec.auth_token_file:
        argv += ["--auth-token-file", _abs(sec.auth_token_file)]
    if sec.allow_plaintext:
        argv.append("--allow-plaintext")
    return argv


def run_server_options(sec: SecurityConfig, host: str, port: int) -> ServerOptions:
    """Options of a launcher's own server (e.g. CoordinatorService) under ``sec``."""
    tls = None
    if sec.tls_cert and sec.tls_key:
        tls = ServerTls(sec.tls_cert, sec.tls_key, sec.tls_ca if sec.mutual_tls else None)
    return ServerOptions(
        host=host,
        port=port,
        tls=tls,
        allow_plaintext=sec.allow_plaintext,
        auth_token=load_auth_token(sec.auth_token_file),
    )


def run_channel_options(sec: SecurityConfig) -> ChannelOptions:
    """Options of every channel a launcher opens to the servers of a run under ``sec``."""
    tls = None
    if sec.tls_cert and sec.tls_ca:
        if sec.mutual_tls:
            tls = ClientTls(sec.tls_ca, sec.tls_cert, sec.tls_key)
        else:
            tls = ClientTls(sec.tls_ca)
    return ChannelOptions(tls=tls, auth_token=load_auth_token(sec.auth_token_file))


def plaintext_weights_warning(sec: SecurityConfig, methods: Sequence[str]) -> str | None:
    """The warning for a run under TLS whose weight updates may take ``distributed``, which
    no TLS covers; None for any other run."""
    if not (sec.tls_cert and sec.tls_key) or "distributed" not in methods:
        return None
    return (
        "weight_sync: the distributed method (gloo, NCCL) is not encrypted, so under TLS the "
        "weights travel in the clear to any server that takes it (shared_memory stays on the "
        "host; socket and stream stay inside TLS); list weight_sync.methods without "
        "distributed to keep every update inside TLS"
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
    # Every client this process builds (e.g. trainer rank 0 pushing weights to rollout
    # servers) speaks the run's TLS and token without each call site passing options.
    set_default_channel_options(channel_options_from_args(args))
    # service.name in traces: areal-rollout, areal-trainer, areal-coordinator.
    tracing.init_tracing(parser.prog)

    async def run() -> str | None:
        services = await build(args)
        running = await start_server(services, options)
        # One line on stdout that launchers parse to learn the bound port.
        print(f"LISTENING {running.address}", flush=True)
        failed = await serve_until_signal(running)
        # Servicers with work outside gRPC calls (a trainer's collective job) finish it here,
        # while the event loop still runs; after a fatal failure, for a bounded time (what
        # failed, e.g. a dead engine's processes, may not answer).
        for svc in services:
            aclose = getattr(svc.servicer, "aclose", None)
            if aclose is None:
                continue
            if failed is None:
                await aclose()
                continue
            try:
                await asyncio.wait_for(aclose(), FATAL_CLOSE_S)
            except Exception as exc:
                log.warning("closing after the failure: %s", explain(exc))
        return failed

    try:
        failed = asyncio.run(run())
    except FieldError as exc:
        # A setting this server cannot take (its run config, a path): one line and exit 2,
        # as the coordinator does, which launchers report as a configuration error.
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        tracing.shutdown_tracing()
    if failed is not None:
        print(f"fatal: {failed}", file=sys.stderr, flush=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        # Now, whatever threads of the failed part are left (they may never end).
        os._exit(EXIT_FATAL)
    return 0
