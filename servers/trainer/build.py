"""What a trainer rank serves, built from the run config and the rank's flags.

Kept apart from the entry point (``__main__``) so that ``areal-trainer --help`` and a bad
setting answer at once: this module imports torch and the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

import torch
from areal_servers.trainer.engine import DistConfig
from areal_servers.trainer.publish.base import PublisherConfig
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import trainer_pb2, trainer_pb2_grpc

from areal_grpc.config import RunConfig
from areal_grpc.server import Service, service
from areal_grpc.server_config import (
    TRAINER_SECTIONS,
    max_new_tokens,
    run_config_from_args,
    trainer_path_roots,
    weights_root,
)

__all__ = ["config_from_args", "service_config", "trainer_services"]


def config_from_args(args: argparse.Namespace) -> TrainerServiceConfig:
    """The service config this rank's command line describes."""
    return service_config(run_config_from_args(args, TRAINER_SECTIONS), args)


def service_config(run: RunConfig, args: argparse.Namespace) -> TrainerServiceConfig:
    """The service config of this rank: the run config's trainer settings and its own flags."""
    t, p, w = run.trainer, run.trainer.ppo, run.weight_sync
    dist_cfg = DistConfig(
        backend=None if t.backend == "auto" else t.backend,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rank=args.rank,
        world_size=args.world_size,
        timeout_s=t.collective_timeout_s,
    )
    host = args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    weights = PublisherConfig(
        disk_root=weights_root(run),
        keep_versions=w.keep_versions,
        bucket_bytes=max(1, int(w.bucket_mb * (1 << 20))),
        master_address=w.master_addr or host,
        backend=None if w.backend == "auto" else w.backend,
        timeout_s=w.timeout_s,
        group_timeout_s=min(300.0, w.timeout_s),
    )
    return TrainerServiceConfig(
        # Dr.GRPO's length constant, 0 in the file, is the response budget only the run knows.
        trainer=replace(
            t, ppo=replace(p, loss_constant_len=p.loss_constant_len or max_new_tokens(run))
        ),
        model=run.model,
        device=args.device or None,
        total_steps=run.total_steps,
        # Log-probs are recomputed under the temperature the rollouts sampled with.
        temperature=run.rollout.sampling.temperature or 1.0,
        dist=dist_cfg,
        distributed=t.fsdp,
        path_roots=tuple(trainer_path_roots(run)),
        weights=weights,
    )


def trainer_services(run: RunConfig, args: argparse.Namespace) -> Sequence[Service]:
    """The services of a trainer rank (the engine builds in the background)."""
    torch.set_num_threads(run.trainer.torch_threads)
    servicer = TrainerService(service_config(run, args))
    return [service(servicer, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)]
