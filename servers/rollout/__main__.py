"""``areal-rollout``: serves RolloutService and WeightSyncService on one server."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
from areal.v1 import rollout_pb2, rollout_pb2_grpc
from areal_servers.rollout.engine import InferenceEngine
from areal_servers.rollout.hf_engine import HFEngine, HFEngineConfig
from areal_servers.rollout.service import RolloutServiceConfig, RolloutServicer
from areal_servers.rollout.weight_sync import WeightSyncConfig, build_weight_sync_service

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.model import load_tokenizer
from areal_grpc.server import Service, service

DEFAULT_PORT = 50061


def add_rollout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the rollout server's options to ``parser``."""
    parser.add_argument(
        "--model", default="builtin:tiny", help="builtin:tiny|micro or a local HF dir"
    )
    parser.add_argument("--seed", type=int, default=0, help="built-in model init and sampler seed")
    parser.add_argument("--engine", choices=["hf", "sglang"], default="hf")
    parser.add_argument("--device", default="auto", help="hf engine device: auto, cpu, cuda")
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="KV cache budget in token slots (rows x longest prompt+max_new_tokens; 0: none)",
    )
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--sglang-url", default="", help="attach the sglang engine to this URL")
    parser.add_argument("--default-workflow", default="rlvr")
    parser.add_argument(
        "--workflow-params", default="{}", help="JSON object of default workflow parameters"
    )
    parser.add_argument("--max-new-tokens", type=int, default=16, help="default max_new_tokens")
    parser.add_argument(
        "--weights-root",
        default=None,
        help="UpdateFromDisk paths must lie under this directory (unset: no DISK updates)",
    )
    parser.add_argument(
        "--weight-methods",
        default="distributed,stream,disk",
        help="weight-sync methods this server accepts (comma-separated)",
    )
    return parser


def create_engine(args: argparse.Namespace) -> InferenceEngine:
    """The engine the options ask for."""
    if args.engine == "sglang":
        from areal_servers.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

        return SGLangEngine(
            SGLangEngineConfig(
                model=args.model,
                url=args.sglang_url,
                seed=args.seed,
                launch=not args.sglang_url,
            )
        )
    return HFEngine(
        HFEngineConfig(
            model=args.model,
            seed=args.seed,
            device=args.device,
            max_running_requests=args.max_running_requests,
            max_batch_tokens=args.max_batch_tokens or None,
        )
    )


def create_rollout_servicer(args: argparse.Namespace) -> RolloutServicer:
    """The RolloutService handlers (with their engine) the options ask for."""
    params = json.loads(args.workflow_params)
    if not isinstance(params, dict):
        raise SystemExit("--workflow-params must be a JSON object")
    engine = create_engine(args)
    config = RolloutServiceConfig(
        default_workflow=args.default_workflow,
        default_workflow_params=params,
        default_max_new_tokens=args.max_new_tokens,
    )
    return RolloutServicer(engine, load_tokenizer(args.model), config)


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The services of a rollout server."""
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    rollout = create_rollout_servicer(args)
    start = getattr(rollout.engine, "start", None)
    if start is not None:
        # The sglang engine launches or attaches to its server and waits until it is healthy.
        await start()
    return [
        service(rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2),
        build_weight_sync_service(
            rollout.engine,
            WeightSyncConfig(
                disk_root=args.weights_root,
                methods=tuple(m for m in args.weight_methods.split(",") if m),
            ),
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-rollout``."""
    parser = base_parser("areal-rollout", "Serve a rollout (inference) server.", DEFAULT_PORT)
    return serve_main(add_rollout_args(parser), build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
