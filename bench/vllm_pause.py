"""vLLM's two pause modes for weight updates, keep against abort-and-resume, on one engine.

Run by hand (needs ``./scripts/setup --vllm``):
``.venv/bin/python bench/vllm_pause.py [--model SOURCE] [--requests B] [--tokens N]
[--updates U] [--every S] [--repeats R]``.

What runs: one ``VLLMEngine`` in this process. Per round, ``B`` sampled requests of exactly
``N`` new tokens (``ignore_eos``) go through ``generate_resumable``, as the rollout server's
workflows send them, while ``U`` weight updates land ``S`` seconds apart, each one pause,
load (vLLM's layerwise reload of the served weights, from a safetensors file written once
before the rounds, as a disk or shared-memory update arrives) and resume.

* abort (``rollout.vllm.pause_mode=abort``, the default): requests in flight end INTERRUPTED
  with their partial output, and ``generate_resumable`` sends each again as prompt + partial
  output after resume.
* keep: vLLM holds them and recomputes their KV cache under the new weights on resume.

The two modes alternate round by round on the same engine (the mode is read at each pause),
so both see the same machine load. Printed per mode: the median wall time of a round, the
generated tokens per second, and how many requests an update interrupted. One line per case:
``RESULT bench=vllm_pause_keep value=<keep s> unit=s baseline=<abort s> ratio=<r>
target=none`` (a round's wall time, medians; below 1: keep is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from results import result
from safetensors.torch import save_file


async def one_round(
    engine, files: list[Path], mode: str, args: argparse.Namespace, version: int
) -> tuple[float, int, int]:
    """Seconds for the round, tokens generated, requests interrupted; the engine ends at
    ``version + args.updates``."""
    from areal_servers.rollout.engine import SamplingConfig, generate_resumable

    engine.settings = dataclasses.replace(engine.settings, pause_mode=mode)
    prompts = [
        [11 + (7 * i + j) % 200 for j in range(args.prompt_tokens)] for i in range(args.requests)
    ]
    interrupted = 0

    async def updates() -> None:
        nonlocal interrupted
        for u in range(args.updates):
            await asyncio.sleep(args.every)
            interrupted += await engine.pause()
            await engine.load_weight_files(files, version + u + 1)
            await engine.resume()

    start = time.perf_counter()
    updater = asyncio.ensure_future(updates())
    results = await asyncio.gather(
        *(
            generate_resumable(
                engine,
                p,
                SamplingConfig(
                    temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True, seed=i
                ),
            )
            for i, p in enumerate(prompts)
        )
    )
    await updater
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in results)
    assert all(len(r.output_ids) == args.tokens for r in results), "a request came back short"
    return wall, tokens, interrupted


async def main_async(args: argparse.Namespace) -> None:
    import torch
    from areal_servers.rollout.vllm_engine import VLLMEngine

    from areal_grpc.config import VllmSettings
    from areal_grpc.model import load_model

    torch.set_num_threads(1)
    settings = VllmSettings(kv_cache_gib=args.kv_cache_gib, max_num_seqs=max(args.requests, 1))
    engine = VLLMEngine(args.model, settings, seed=0)
    t0 = time.perf_counter()
    await engine.start()
    print(f"vLLM started in {time.perf_counter() - t0:.1f} s ({args.model})", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-vllm-pause-", dir="/dev/shm"))
    try:
        # The served weights themselves: each update reloads them (the cost of the pause is
        # the point, not what changes).
        sd = load_model(args.model, seed=0).state_dict()
        path = scratch / "weights.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}, str(path))
        version = engine.version
        walls: dict[str, list[float]] = {"abort": [], "keep": []}
        rates: dict[str, list[float]] = {"abort": [], "keep": []}
        hits: dict[str, list[int]] = {"abort": [], "keep": []}
        # One unmeasured round first: vLLM compiles and warms its caches.
        await one_round(engine, [path], "abort", args, version)
        version += args.updates
        for r in range(args.repeats):
            for mode in ("abort", "keep") if r % 2 == 0 else ("keep", "abort"):
                wall, tokens, interrupted = await one_round(engine, [path], mode, args, version)
                version += args.updates
                walls[mode].append(wall)
                rates[mode].append(tokens / wall)
                hits[mode].append(interrupted)
                print(
                    f"  round {r} {mode:5s}: {wall:.2f} s, {tokens / wall:.1f} tok/s, "
                    f"{interrupted} interrupted",
                    flush=True,
                )
        for mode in ("abort", "keep"):
            print(
                f"{mode}: median {statistics.median(walls[mode]):.2f} s per round "
                f"(range {min(walls[mode]):.2f}-{max(walls[mode]):.2f}), "
                f"{statistics.median(rates[mode]):.1f} tok/s, interrupted per round {hits[mode]}",
                flush=True,
            )
        result(
            "vllm_pause_keep",
            statistics.median(walls["keep"]),
            "s",
            statistics.median(walls["abort"]),
            "none",
        )
    finally:
        await engine.close()
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()


def main(argv: list[str] | None = None) -> None:
    """Parses the arguments and runs the rounds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--tokens", type=int, default=400, help="new tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--updates", type=int, default=5, help="weight updates per round")
    parser.add_argument("--every", type=float, default=0.3, help="seconds between updates")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per mode")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = parser.parse_args(argv)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
