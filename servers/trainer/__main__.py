"""``areal-trainer``: serves TrainerService for one rank of the trainer group.

Start one process per rank, e.g. two ranks over gloo on one machine::

    areal-trainer --port 0 --rank 0 --world-size 2 --master-port 29510 --model builtin:tiny
    areal-trainer --port 0 --rank 1 --world-size 2 --master-port 29510 --model builtin:tiny

Under torchrun, leave out --rank/--world-size/--master-*: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from the environment, and the default gRPC port is 50071 + LOCAL_RANK. The
gRPC port is bound (and ``LISTENING host:port`` printed) before the process group forms, so a
launcher can start the ranks one by one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import torch
from areal.v1 import trainer_pb2, trainer_pb2_grpc
from areal_servers.trainer.algorithm import NormConfig, PPOConfig, RewardConfig
from areal_servers.trainer.engine import DistConfig, EngineConfig, OptimConfig
from areal_servers.trainer.microbatch import MicroBatchSpec
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from areal_servers.trainer.weight_publisher import PublisherConfig

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.server import Service, service

DEFAULT_PORT = 50071

NORMS: dict[str, NormConfig | None] = {
    "group": NormConfig("group", "group"),
    "batch": NormConfig("batch", "batch"),
    # Dr.GRPO: centre per group, no std.
    "group-mean": NormConfig("group", None),
    # RLOO: leave-one-out mean per group, no std.
    "rloo": NormConfig("group", None, mean_leave1out=True),
    "none": None,
}


def add_trainer_args(parser: argparse.ArgumentParser) -> None:
    """The trainer's options (process group, model, optimizer, algorithm)."""
    g = parser.add_argument_group("process group")
    g.add_argument("--rank", type=int, default=None, help="rank (default: $RANK or 0)")
    g.add_argument("--world-size", type=int, default=None, help="ranks ($WORLD_SIZE or 1)")
    g.add_argument("--master-addr", default=None, help="rendezvous host ($MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port ($MASTER_PORT)")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    g.add_argument("--collective-timeout-s", type=float, default=600.0)
    g.add_argument("--no-fsdp", action="store_true", help="plain single-process training")
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="builtin:tiny", help="builtin:tiny | builtin:micro | dir")
    g.add_argument("--seed", type=int, default=0, help="init seed of built-in models")
    g.add_argument("--device", default=None, help="cpu | cuda[:i] (default: auto)")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    g.add_argument("--mixed-precision", choices=["auto", "on", "off"], default="auto")
    g.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    g.add_argument(
        "--path-root",
        action="append",
        default=[],
        help="checkpoint/export paths must lie inside this directory (repeatable; relative "
        "paths are relative to the first; default: ./areal-files/trainer)",
    )
    g = parser.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--total-steps", type=int, default=None)
    g.add_argument("--min-lr-ratio", type=float, default=0.0)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0 disables clipping")
    g.add_argument("--max-tokens-per-mb", type=int, default=None)
    g = parser.add_argument_group("algorithm")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-higher", type=float, default=None)
    g.add_argument("--c-clip", type=float, default=None)
    g.add_argument("--behav-imp-weight-cap", type=float, default=5.0, help="<= 0 disables")
    g.add_argument("--behav-imp-weight-mode", choices=["mask", "clamp"], default="mask")
    g.add_argument("--reward-bias", type=float, default=0.0)
    g.add_argument("--reward-scale", type=float, default=1.0)
    g.add_argument("--reward-clip", type=float, default=20.0)
    g.add_argument("--reward-norm", choices=sorted(NORMS), default="group")
    g.add_argument("--adv-norm", choices=sorted(NORMS), default="none")
    g.add_argument("--kl-ctl", type=float, default=0.0)
    g.add_argument("--kl-estimator", choices=["k1", "k2", "k3"], default="k1")
    g.add_argument("--temperature", type=float, default=1.0)
    g = parser.add_argument_group("weight publishing (PublishWeights)")
    g.add_argument(
        "--weights-root", default=None, help="rank 0 writes versions here for DISK (unset: no DISK)"
    )
    g.add_argument("--weights-keep", type=int, default=2, help="published versions kept on disk")
    g.add_argument("--weights-bucket-mb", type=float, default=64.0, help="gather/send bucket")
    g.add_argument(
        "--weights-master-addr",
        default=None,
        help="address rollout servers use to reach rank 0's weight group (default: --host)",
    )
    g.add_argument("--weights-backend", choices=["auto", "gloo", "nccl"], default="auto")
    g.add_argument("--weights-timeout-s", type=float, default=600.0)


def config_from_args(args: argparse.Namespace) -> TrainerServiceConfig:
    """The service config the command line describes."""
    mixed = {"auto": None, "on": True, "off": False}[args.mixed_precision]
    engine = EngineConfig(
        model=args.model,
        seed=args.seed,
        fsdp=not args.no_fsdp,
        mixed_precision=mixed,
        device=args.device,
        dtype=args.dtype,
        optim=OptimConfig(
            lr=args.lr,
            weight_decay=args.weight_decay,
            warmup_steps=args.warmup_steps,
            schedule=args.lr_schedule,
            total_steps=args.total_steps,
            min_lr_ratio=args.min_lr_ratio,
            max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
        ),
        ppo=PPOConfig(
            eps_clip=args.eps_clip,
            eps_clip_higher=args.eps_clip_higher,
            c_clip=args.c_clip,
            behav_imp_weight_cap=(
                args.behav_imp_weight_cap if args.behav_imp_weight_cap > 0 else None
            ),
            behav_imp_weight_mode=args.behav_imp_weight_mode,
            kl_ctl=args.kl_ctl,
            kl_estimator=args.kl_estimator,
            temperature=args.temperature,
            reward=RewardConfig(
                bias=args.reward_bias, scale=args.reward_scale, clip=args.reward_clip
            ),
            reward_norm=NORMS[args.reward_norm],
            adv_norm=NORMS[args.adv_norm],
        ),
        microbatch=MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb),
    )
    dist_cfg = DistConfig(
        backend=None if args.backend == "auto" else args.backend,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rank=args.rank,
        world_size=args.world_size,
        timeout_s=args.collective_timeout_s,
    )
    host = args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    weights = PublisherConfig(
        disk_root=args.weights_root,
        keep_versions=args.weights_keep,
        bucket_bytes=max(1, int(args.weights_bucket_mb * (1 << 20))),
        master_address=args.weights_master_addr or host,
        backend=None if args.weights_backend == "auto" else args.weights_backend,
        timeout_s=args.weights_timeout_s,
        group_timeout_s=min(300.0, args.weights_timeout_s),
    )
    return TrainerServiceConfig(
        engine=engine,
        dist=dist_cfg,
        distributed=not args.no_fsdp,
        path_roots=tuple(args.path_root),
        weights=weights,
    )


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The services of a trainer rank (the engine builds in the background)."""
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    servicer = TrainerService(config_from_args(args))
    return [service(servicer, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-trainer``."""
    # Under torchrun several ranks share a node: each local rank gets its own default port
    # (50071 + LOCAL_RANK), so one command line serves every rank.
    default_port = DEFAULT_PORT + int(os.environ.get("LOCAL_RANK", "0"))
    parser = base_parser("areal-trainer", "Serve one trainer rank.", default_port)
    add_trainer_args(parser)
    code = serve_main(parser, build, argv)
    # Everything worth keeping is on disk or sent by now. torch's C++ teardown of a gloo group
    # whose peer left mid-collective can std::terminate (SIGABRT), so skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
