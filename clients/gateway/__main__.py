"""``areal-gateway --coordinator host:port [key=value ...]``: serve the OpenAI-compatible
gateway of a run.

It reads the run's config keys (``--config`` and dotted overrides, as the coordinator takes
them): ``model.source`` (its tokenizer and chat template), ``gateway.*`` (host, port, default
max_tokens, the API key's environment variable, a chat template file of its own) and
``security``: its gRPC calls speak the run's TLS and bearer token, it serves HTTPS with the
run's certificate, and clients must send the run's token (else ``$<gateway.api_key_env>``,
if set) as ``Authorization: Bearer``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

import uvicorn

from areal_grpc import tracing
from areal_grpc.cli import run_channel_options
from areal_grpc.config import RunConfig
from areal_grpc.errors import FieldError
from areal_grpc.launch import LISTENING
from areal_grpc.ports import http_listener
from areal_grpc.security import is_loopback, load_auth_token
from areal_grpc.server import set_default_channel_options
from areal_grpc.server_config import add_run_config_args, run_config_from_args

from .app import create_app

SECTIONS = ("run", "model", "security", "gateway")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="areal-gateway", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--coordinator", required=True, help="the CoordinatorService's host:port")
    p.add_argument("--allow-plaintext", action="store_true", help="serve HTTP beyond loopback")
    add_run_config_args(p)
    return p.parse_args(argv)


def api_key(run: RunConfig) -> str | None:
    """The bearer token clients must send: the run's own, else ``$<gateway.api_key_env>``."""
    key = load_auth_token(run.security.auth_token_file) or os.environ.get(run.gateway.api_key_env)
    return key or None


async def serve(run: RunConfig, coordinator: str, allow_plaintext: bool) -> None:
    """Binds, prints the LISTENING and GATEWAY lines, serves until stopped."""
    sec, g = run.security, run.gateway
    tls = bool(sec.tls_cert and sec.tls_key)
    if not tls and not allow_plaintext and not is_loopback(g.host):
        raise SystemExit(
            f"areal-gateway: refusing to serve plaintext HTTP on {g.host}: configure "
            "security.tls_cert/tls_key, bind to loopback, or pass --allow-plaintext"
        )
    set_default_channel_options(run_channel_options(sec))
    sock, address = http_listener(g.host, g.port)
    config = uvicorn.Config(
        create_app(run, coordinator, api_key(run)),
        log_level="warning",
        ssl_certfile=sec.tls_cert if tls else None,
        ssl_keyfile=sec.tls_key if tls else None,
    )
    server = uvicorn.Server(config)
    print(f"{LISTENING}{address}", flush=True)
    print(f"GATEWAY {'https' if tls else 'http'}://{address}/v1", flush=True)
    await server.serve(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    try:
        run = run_config_from_args(args, SECTIONS)
    except FieldError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    # Spans go to $OTEL_EXPORTER_OTLP_ENDPOINT when it is set (else tracing stays off).
    tracing.init_tracing("areal-gateway")
    try:
        asyncio.run(serve(run, args.coordinator, args.allow_plaintext))
    finally:
        tracing.shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
