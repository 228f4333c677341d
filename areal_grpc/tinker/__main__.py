"""``python -m areal_grpc.tinker [--config run.yaml] [key=value ...]``: many tenants' LoRA
training runs on one base model, served as LoraTrainingService (gRPC) and as the HTTP
endpoints the official ``tinker`` SDK calls.

It reads the run's config tree: ``model.source`` is the base model (the run's tiny default
becomes SmolLM2-135M-Instruct here, the model this service is for), ``tinker.*`` the service.
Once both serve it prints ``TINKER http://host:port`` (point ``TINKER_BASE_URL`` there) and
``GRPC host:port``; with no ``tinker.tenants_file`` it serves one tenant and prints its key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from areal_clients.tinker.app import create_app
from areal_servers.lora_training.engine import LoraEngine
from areal_servers.lora_training.service import LoraTrainingServicer, Tenants
from arealgrpc.v1 import lora_training_pb2, lora_training_pb2_grpc

from areal_grpc.config import RunConfig, load_config, preflight, read_tenants
from areal_grpc.errors import FieldError
from areal_grpc.launch import LISTENING
from areal_grpc.model import resolve_source
from areal_grpc.paths import write_marker
from areal_grpc.security import is_loopback
from areal_grpc.server import ServerOptions, service, start_server
from areal_grpc.server_config import add_run_config_args

log = logging.getLogger("areal_grpc.tinker")

DEFAULT_SOURCE = "smollm2-135m-instruct"
# The names users give a source's model (the first is how it is listed).
MODEL_NAMES = {"smollm2-135m-instruct": ["HuggingFaceTB/SmolLM2-135M-Instruct"]}
SECTIONS = ("model", "output", "security", "tinker")


def model_names(source: str) -> list[str]:
    """Every name the service accepts for ``source``'s model, the listed one first."""
    return [*MODEL_NAMES.get(source, []), source]


def config_from_args(argv: Sequence[str] | None) -> RunConfig:
    """The run config the command line describes, with this service's default model."""
    parser = argparse.ArgumentParser(prog="python -m areal_grpc.tinker", description=__doc__)
    add_run_config_args(parser)
    args = parser.parse_args(argv)
    # Under the user's files and overrides: this service's default model, not the run's.
    defaults = json.dumps({"model": {"source": DEFAULT_SOURCE}})
    cfg = load_config([defaults, *(args.config or [])], args.overrides, sections=SECTIONS)
    preflight(cfg, SECTIONS)
    if not is_loopback(cfg.tinker.host) and not cfg.security.allow_plaintext:
        # API keys travel in every request: not in the clear beyond this machine by accident.
        raise FieldError(
            "tinker.host",
            f"{cfg.tinker.host} is not loopback and the service speaks plaintext HTTP and gRPC "
            "(no TLS yet): bind 127.0.0.1, or set security.allow_plaintext=true behind a "
            "TLS-terminating proxy",
        )
    return cfg


async def serve(cfg: RunConfig) -> None:
    """Loads the model, starts the gRPC service and the HTTP face, serves until a signal."""
    t = cfg.tinker
    if t.tenants_file is not None:
        keys = read_tenants(t.tenants_file)
    else:
        keys = {"default": f"tml-{secrets.token_urlsafe(24)}"}
        print(f"TENANT default key {keys['default']}", flush=True)
    root = Path(t.root or Path(cfg.output.dir) / "tinker").resolve()
    root.mkdir(parents=True, exist_ok=True)
    write_marker(root, "tinker")
    # A named model becomes a checkpoint directory (converted once into the cache): the
    # engine loads it, and SDK clients on this machine load its tokenizer from it.
    source = await asyncio.to_thread(resolve_source, cfg.model.source)
    engine = await asyncio.to_thread(LoraEngine, source, seed=cfg.model.seed)
    tokenizer_id = source if Path(source).is_dir() else ""
    servicer = LoraTrainingServicer(
        engine, t, Tenants(keys), root, model_names(cfg.model.source), tokenizer_id
    )
    running = await start_server(
        [
            service(
                servicer,
                lora_training_pb2_grpc.add_LoraTrainingServiceServicer_to_server,
                lora_training_pb2,
            )
        ],
        ServerOptions(host=t.host, port=t.grpc_port, allow_plaintext=cfg.security.allow_plaintext),
    )
    await servicer.start()
    sock = socket.socket(socket.AF_INET6 if ":" in t.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((t.host, t.port))
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(
        uvicorn.Config(create_app(running.address), log_level="warning", lifespan="on")
    )
    # uvicorn's own handlers would end serve() before the gRPC side drains.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    shown = f"[{host}]" if ":" in host else host
    # LISTENING first: launchers (areal_grpc.launch.start_child) wait for it.
    print(f"{LISTENING}{shown}:{port}", flush=True)
    print(f"GRPC {running.address}", flush=True)
    print(f"TINKER http://{shown}:{port}", flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        await servicer.stop()
        await running.stop(1.0)
    print("tinker service stopped", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 2 on a config error."""
    try:
        cfg = config_from_args(argv)
    except FieldError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.output.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
