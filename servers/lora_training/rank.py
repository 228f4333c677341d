"""``python -m areal_servers.lora_training.rank``: one worker rank of the training service's
trainer group (:mod:`areal_servers.lora_training.replicas`). The service starts its workers
itself when ``tinker.trainer_ranks`` > 1; nobody starts one by hand.

It serves gRPC health and prints ``LISTENING host:port`` before it loads the model, so that
the workers load theirs at once. Then it joins the group and applies rank 0's commands until
told to stop. A failed collective ends it with exit code 1, and rank 0 replaces it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from areal_servers.lora_training.replicas import GroupEngine, follow, join_group

from areal_grpc.launch import LISTENING
from areal_grpc.server import BackgroundServer


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 after rank 0's stop command, 1 when the group failed."""
    parser = argparse.ArgumentParser(prog="python -m areal_servers.lora_training.rank")
    parser.add_argument("--model", required=True, help="model.source, as rank 0 loaded it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float64", "bfloat16"], help="as rank 0's"
    )
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="rank 0's host:port")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {args.rank}: %(message)s"
    )
    with BackgroundServer([]) as running:
        print(f"{LISTENING}{running.address}", flush=True)
        join_group(args.rank, args.world, args.master, args.timeout_s)
        try:
            engine = GroupEngine(
                args.model,
                seed=args.seed,
                dtype=getattr(torch, args.dtype),
                max_batch_tokens=args.max_batch_tokens,
                world=args.world,
                timeout_s=args.timeout_s,
                worker=True,
            )
            follow(engine)
        except Exception:
            logging.exception("the trainer group failed")
            return 1
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
