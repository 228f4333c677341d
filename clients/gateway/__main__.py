"""``areal-gateway --coordinator host:port``: serve the OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from collections.abc import Sequence

import uvicorn

from .app import GatewayConfig, create_app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="areal-gateway", description=__doc__)
    p.add_argument("--coordinator", required=True, help="the CoordinatorService's host:port")
    p.add_argument("--model", default="builtin:micro", help="the run's model.source (tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument(
        "--api-key-env",
        default="AREAL_GATEWAY_API_KEY",
        help="environment variable holding the bearer token clients must send (unset: none)",
    )
    p.add_argument("--producer-id", default="gateway")
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    """Binds, prints ``GATEWAY http://host:port/v1``, serves until stopped."""
    cfg = GatewayConfig(
        coordinator=args.coordinator,
        model=args.model,
        api_key=os.environ.get(args.api_key_env) or None,
        producer_id=args.producer_id,
        default_max_tokens=args.max_tokens,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), log_level="warning"))
    shown = f"[{host}]" if ":" in host else host
    print(f"GATEWAY http://{shown}:{port}/v1", flush=True)
    await server.serve(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
