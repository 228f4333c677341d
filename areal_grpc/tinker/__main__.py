"""``python -m areal_grpc.tinker [--config run.yaml] [key=value ...]``: many tenants' LoRA
training runs on one base model, served as LoraTrainingService (gRPC) and as the HTTP
endpoints the official ``tinker`` SDK calls.

It reads the run's config tree: ``model.source`` is the base model (the run's tiny default
becomes SmolLM2-135M-Instruct here, the model this service is for), ``tinker.*`` the service,
``output.dir`` its logs and (``tinker.root`` unset) checkpoints: ``outputs/tinker`` by default
here, apart from a training run's ``outputs/run``.
The training service runs as a child process (``python -m areal_servers.lora_training``)
that this one supervises: if it dies, calls in flight fail with a clear error, it is started
again, and calls on runs it held say they were lost. Once both serve it prints ``TINKER
http://host:port`` (point ``TINKER_BASE_URL`` there) and ``GRPC host:port`` (again after a
restart); with no ``tinker.tenants_file`` it serves one tenant and prints its key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from areal_clients.tinker.app import Face, create_app
from areal_servers.lora_training.__main__ import SECTIONS, tinker_root

from areal_grpc.cli import run_channel_options
from areal_grpc.config import RunConfig, load_config, preflight
from areal_grpc.errors import FieldError
from areal_grpc.launch import (
    LISTENING,
    Child,
    LaunchError,
    dies_with_this_process,
    python_module_argv,
    start_child,
    stop_children,
)
from areal_grpc.ports import http_listener
from areal_grpc.security import is_loopback
from areal_grpc.server import set_default_channel_options
from areal_grpc.server_config import add_run_config_args, config_argv

DEFAULT_SOURCE = "smollm2-135m-instruct"
# Not the run's outputs/run: a training run there would share (and overwrite) its logs.
DEFAULT_OUTPUT_DIR = "outputs/tinker"
# Loading SmolLM2 (and converting it, the first time on a machine) before the service serves.
START_TIMEOUT_S = 600.0


def config_from_args(argv: Sequence[str] | None) -> RunConfig:
    """The run config the command line describes, with this service's default model."""
    parser = argparse.ArgumentParser(prog="python -m areal_grpc.tinker", description=__doc__)
    add_run_config_args(parser)
    args = parser.parse_args(argv)
    # Under the user's files and overrides: this service's defaults, not the run's.
    defaults = json.dumps(
        {"model": {"source": DEFAULT_SOURCE}, "output": {"dir": DEFAULT_OUTPUT_DIR}}
    )
    cfg = load_config([defaults, *(args.config or [])], args.overrides, sections=SECTIONS)
    preflight(cfg, SECTIONS)
    tls = bool(cfg.security.tls_cert and cfg.security.tls_key)
    if not tls and not is_loopback(cfg.tinker.host) and not cfg.security.allow_plaintext:
        # API keys travel in every request: not in the clear beyond this machine by accident.
        raise FieldError(
            "tinker.host",
            f"{cfg.tinker.host} is not loopback and the service would speak plaintext HTTP "
            "and gRPC: set security.tls_cert, tls_key and tls_ca (HTTPS and TLS), bind "
            "127.0.0.1, or set security.allow_plaintext=true behind a TLS-terminating proxy",
        )
    return cfg


@dataclass
class Supervised:
    """The training service child and how to start it again."""

    argv: list[str]
    log_dir: Path
    child: Child | None = None

    def start(self) -> Child:
        self.child = start_child(
            "lora-training", self.argv, log_dir=self.log_dir, ready_timeout_s=START_TIMEOUT_S
        )
        return self.child


async def supervise(service: Supervised, face: Face, server: uvicorn.Server) -> None:
    """Restarts the training service when it exits; a start that fails ends the face too."""
    while True:
        await asyncio.sleep(1.0)
        child = service.child
        if child is None or child.alive():
            continue
        code = child.process.returncode
        await asyncio.to_thread(stop_children, [child], 1.0)  # what it left behind goes too
        when = time.strftime("%H:%M:%S")
        reason = (
            f"the training service exited (code {code}) at {when} and was restarted: runs "
            "made before then are lost"
        )
        print(f"training service exited (code {code}): restarting", flush=True)
        face.service_lost(reason)
        try:
            restarted = await asyncio.to_thread(service.start)
        except LaunchError as exc:
            print(f"training service did not restart: {exc}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        await face.repoint(restarted.address)
        print(f"GRPC {restarted.address}", flush=True)


async def serve(cfg: RunConfig) -> None:
    """Starts the training service (a supervised child) and the HTTP face in front of it;
    serves until a signal."""
    t = cfg.tinker
    root = tinker_root(cfg)
    if t.tenants_file is None:
        key = f"tml-{secrets.token_urlsafe(24)}"
        tenants = root / "tenants.json"
        tenants.touch(mode=0o600)
        tenants.write_text(json.dumps({"default": key}))
        cfg.tinker.tenants_file = str(tenants)
        print(f"TENANT default key {key}", flush=True)
    service = Supervised(
        # The service holds the model: it must not outlive this process, even a kill -9 of it.
        dies_with_this_process(
            python_module_argv("areal_servers.lora_training", *config_argv(cfg))
        ),
        Path(cfg.output.dir).resolve() / "logs",
    )
    child = await asyncio.to_thread(service.start)
    sec = cfg.security
    # The face's channel to the service speaks the run's TLS; a tenant's API key, not the
    # run's token, is each call's credential.
    set_default_channel_options(dataclasses.replace(run_channel_options(sec), auth_token=None))
    app = create_app(child.address)
    sock, address = http_listener(t.host, t.port)
    tls = bool(sec.tls_cert and sec.tls_key)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            # SDK clients keep their connections open: a stop waits this long, not for them.
            timeout_graceful_shutdown=5,
            ssl_certfile=sec.tls_cert if tls else None,
            ssl_keyfile=sec.tls_key if tls else None,
        )
    )
    # Stopped here, so that the training service is stopped after the face.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    # LISTENING first: launchers (areal_grpc.launch.start_child) wait for it.
    print(f"{LISTENING}{address}", flush=True)
    print(f"GRPC {child.address}", flush=True)
    print(f"TINKER {'https' if tls else 'http'}://{address}", flush=True)
    supervisor = asyncio.create_task(supervise(service, app.state.face, server))
    try:
        await server.serve(sockets=[sock])
    finally:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        if service.child is not None:
            await asyncio.to_thread(stop_children, [service.child])
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
