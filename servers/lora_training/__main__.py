"""``python -m areal_servers.lora_training --config <run config> [key=value ...]``:
LoraTrainingService alone, on ``model.source`` with the tenants of ``tinker.tenants_file``
and checkpoints under ``tinker.root``. ``python -m areal_grpc.tinker`` starts it as its
child, supervises it and serves the HTTP face in front of it; run it directly to offer only
the gRPC service. Prints ``LISTENING host:port`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from areal_servers.lora_training.fleet import SamplerFleet
from areal_servers.lora_training.replicas import GroupEngine
from areal_servers.lora_training.service import LoraTrainingServicer, Tenants
from arealgrpc.v1 import lora_training_pb2, lora_training_pb2_grpc

from areal_grpc.cli import run_channel_options, run_server_options
from areal_grpc.config import RunConfig, read_tenants
from areal_grpc.errors import FieldError
from areal_grpc.launch import LISTENING
from areal_grpc.model import resolve_source
from areal_grpc.paths import write_marker
from areal_grpc.server import serve_until_signal, service, start_server, sync_channel
from areal_grpc.server_config import add_run_config_args, run_config_from_args

SECTIONS = ("model", "output", "security", "tinker")
# The names users give a source's model (the first is how it is listed).
MODEL_NAMES = {"smollm2-135m-instruct": ["HuggingFaceTB/SmolLM2-135M-Instruct"]}


def model_names(source: str) -> list[str]:
    """Every name the service accepts for ``source``'s model, the listed one first."""
    return [*MODEL_NAMES.get(source, []), source]


def tinker_root(run: RunConfig) -> Path:
    """Where the service writes checkpoints (created, marked as ours)."""
    root = Path(run.tinker.root or Path(run.output.dir) / "tinker").resolve()
    root.mkdir(parents=True, exist_ok=True)
    write_marker(root, "tinker")
    return root


async def serve(run: RunConfig) -> None:
    """Loads the model and serves LoraTrainingService until SIGTERM or SIGINT."""
    t = run.tinker
    if t.tenants_file is None:
        raise FieldError("tinker.tenants_file", "the service alone needs its tenants' keys")
    keys = read_tenants(t.tenants_file)
    # A named model becomes a checkpoint directory (converted once into the cache): the
    # engine loads it, and SDK clients on this machine load its tokenizer from it.
    source = await asyncio.to_thread(resolve_source, run.model.source)
    # Workers tie their lives to the thread that starts them (dies_with_this_process): the
    # executor's threads live as long as the service.
    engine = await asyncio.to_thread(
        GroupEngine,
        source,
        seed=run.model.seed,
        world=t.trainer_ranks,
        timeout_s=t.trainer_timeout_s,
        log_dir=Path(run.output.dir).resolve() / "logs",
    )
    tokenizer_id = source if Path(source).is_dir() else ""
    # The fleet's channels take the run's TLS and token, as the run's own servers do.
    fleet_options = run_channel_options(run.security)
    fleet = (
        SamplerFleet(t.rollout_addresses, lambda a: sync_channel(a, fleet_options))
        if t.rollout_addresses
        else None
    )
    servicer = LoraTrainingServicer(
        engine,
        t,
        Tenants(keys),
        tinker_root(run),
        model_names(run.model.source),
        tokenizer_id,
        fleet,
    )
    running = await start_server(
        [
            service(
                servicer,
                lora_training_pb2_grpc.add_LoraTrainingServiceServicer_to_server,
                lora_training_pb2,
            )
        ],
        # The run's TLS; not its bearer token: a tenant's API key is every call's credential.
        dataclasses.replace(run_server_options(run.security, t.host, t.grpc_port), auth_token=None),
    )
    await servicer.start()
    print(f"{LISTENING}{running.address}", flush=True)
    print(f"SERVICE pid {os.getpid()}", flush=True)

    async def stop() -> None:
        await servicer.stop()
        await asyncio.to_thread(engine.close)

    await serve_until_signal(running, on_stop=stop)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 2 on a config error."""
    parser = argparse.ArgumentParser(prog="python -m areal_servers.lora_training")
    add_run_config_args(parser)
    args = parser.parse_args(argv)
    try:
        run = run_config_from_args(args, SECTIONS)
        if run.tinker.tenants_file is None:
            raise FieldError("tinker.tenants_file", "the service alone needs its tenants' keys")
    except FieldError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=run.output.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
