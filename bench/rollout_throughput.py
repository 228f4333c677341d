"""Rollout throughput: RunEpisodes over loopback gRPC vs the same engine in-process, and
continuous batching vs one request at a time.

1. ``rollout_throughput``: generated tokens/s of RLVR episodes (``--prompts`` prompts of the
   built-in task x ``--group-size`` samples, ``--max-new-tokens`` new tokens each, ignore_eos,
   temperature 1) through ``RunEpisodes`` on a real ``areal-rollout`` subprocess (its own
   process, so client and server do not share a GIL; OMP_NUM_THREADS=1 in its environment),
   vs the baseline: the same tasks run in this process by ``EpisodeRunner`` (the object the
   servicer itself uses: prepare + workflow + reward + group proto) on an ``HFEngine`` of the
   same config (model, seed, device cpu, max_running_requests). Both sides generate exactly
   the same number of tokens (checked). Rounds alternate gRPC / in-process so machine load
   hits both alike; the warm-up round of each side is not counted.
2. ``continuous_batching``: the in-process engine given ``--cb-requests`` requests (prompts
   of the same tasks; per-request max_new_tokens drawn from a seeded uniform in
   [M/2, 3M/2] for M = ``--max-new-tokens``, ignore_eos) submitted all at once, so they decode
   as one batch and each row leaves when its budget is spent (more than ``--max-running``
   requests would queue and join as rows leave), vs the same requests awaited one after
   another on the same engine.

3. ``--engine vllm`` (needs ``./scripts/setup --vllm``): the same RLVR episodes through
   ``RunEpisodes`` on an ``areal-rollout`` subprocess serving ``rollout.engine=vllm``, vs the
   baseline: vLLM's own ``AsyncLLM.generate`` in this process on the same prompt ids and
   sampling (``rollout_vllm_b<N>``, target 0.9), at batch sizes ``--batches`` (sequences per
   round: prompts x group size); and that in-process vLLM against an in-process hf engine on
   the same requests (``rollout_vllm_vs_hf_b<N>``, no target)::

       .venv/bin/python bench/rollout_throughput.py --engine vllm \
           --model smollm2-135m-instruct [--batches 8,64] [--repeats 3]

4. ``--engine sglang`` (needs ``./scripts/setup --sglang``): the same RLVR episodes through
   ``RunEpisodes`` on an ``areal-rollout`` subprocess attached to an SGLang server this
   benchmark launches, vs the baseline: direct HTTP ``/generate`` calls to that same SGLang
   server, one per sequence, with the same prompt ids and sampling (``rollout_sglang_b<N>``,
   target 0.9)::

       .venv/bin/python bench/rollout_throughput.py --engine sglang \
           --model smollm2-135m-instruct --batches 8 [--repeats 3]

Figures are medians over the timed rounds (``--repeats`` per side for 1,
``--repeats-sequential`` for 2); a CPU-seconds-per-round figure (server + client process vs
this process) is printed too, as a view that machine load disturbs less than wall time.
torch uses one thread in every process. Typical run: about a minute on 2 CPU cores::

    .venv/bin/python bench/rollout_throughput.py [--repeats 15] [--prompts 16] [--group-size 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from areal_servers.rollout.engine import InferenceEngine, SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.service import EpisodeRunner, RolloutServiceConfig, item_to_struct
from areal_servers.rollout.workflows import prompt_ids_of
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from google.protobuf import json_format
from results import result
from teardown import exit_on_sigterm

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from areal_grpc.model import load_tokenizer
from areal_grpc.server import aio_channel
from areal_grpc.tasks import task_dataset


def episode_tasks(args: argparse.Namespace) -> list[rollout_pb2.EpisodeTask]:
    """The RLVR tasks both sides run (same prompts, same sampling)."""
    items = task_dataset(args.task, "train", seed=args.seed)[: args.prompts]
    sampling = common_pb2.SamplingParams(
        temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True
    )
    return [
        rollout_pb2.EpisodeTask(
            task_id=f"t{i}",
            data=item_to_struct(item),
            group_size=args.group_size,
            workflow="rlvr",
            sampling=sampling,
        )
        for i, item in enumerate(items)
    ]


def generated_tokens(result: rollout_pb2.RunEpisodesResponse) -> int:
    """Tokens the model generated in one accepted episode result."""
    if result.outcome != rollout_pb2.EPISODE_OUTCOME_ACCEPTED:
        raise RuntimeError(f"episode {result.task_id} not accepted: {result.reason}")
    return sum(len(t.token_ids) - t.prompt_length for t in result.group.trajectories)


async def grpc_round(
    stub: rollout_pb2_grpc.RolloutServiceStub, tasks: list[rollout_pb2.EpisodeTask]
) -> tuple[int, float]:
    """(generated tokens, seconds) of one RunEpisodes stream carrying every task."""
    start = time.perf_counter()
    call = stub.RunEpisodes(iter([rollout_pb2.RunEpisodesRequest(task=t) for t in tasks]))
    tokens = 0
    count = 0
    async for reply in call:
        tokens += generated_tokens(reply)
        count += 1
    elapsed = time.perf_counter() - start
    if count != len(tasks):
        raise RuntimeError(f"{count} results for {len(tasks)} tasks")
    return tokens, elapsed


async def inproc_round(
    runner: EpisodeRunner, tasks: list[rollout_pb2.EpisodeTask]
) -> tuple[int, float]:
    """(generated tokens, seconds) of the same tasks run concurrently by EpisodeRunner."""
    start = time.perf_counter()
    prepared = [runner.prepare(t) for t in tasks]
    results = await asyncio.gather(*(runner.run(p) for p in prepared))
    elapsed = time.perf_counter() - start
    return sum(generated_tokens(r) for r in results), elapsed


async def cb_round(
    engine: HFEngine, requests: list[tuple[list[int], SamplingConfig]], sequential: bool
) -> tuple[int, float]:
    """(generated tokens, seconds): all requests submitted at once, or one after another."""
    start = time.perf_counter()
    if sequential:
        results = [await engine.generate(ids, cfg) for ids, cfg in requests]
    else:
        results = await asyncio.gather(*(engine.generate(ids, cfg) for ids, cfg in requests))
    elapsed = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results), elapsed


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(name: str, samples: list[tuple[int, float]], cpu: list[float] | None = None) -> float:
    """Prints the per-round rates and returns their median (tokens/s)."""
    rates = [n / s for n, s in samples]
    med = statistics.median(rates)
    spread = (max(rates) - min(rates)) / med if med else 0.0
    cpu_note = f"  CPU s/round {statistics.median(cpu):.3f}" if cpu else ""
    print(
        f"  {name:<24} tokens/round {samples[0][0]:>6}  median {med:8.0f} tok/s  "
        f"min {min(rates):8.0f}  max {max(rates):8.0f}  spread {spread:5.1%}{cpu_note}  "
        f"rounds: {' '.join(f'{r:.0f}' for r in rates)}",
        flush=True,
    )
    return med


async def bench(args: argparse.Namespace, server: Child) -> None:
    tokenizer = load_tokenizer(args.model)
    tasks = episode_tasks(args)
    expected = len(tasks) * args.group_size * args.max_new_tokens
    engine = HFEngine(
        ModelConfig(source=args.model, seed=args.seed),
        RolloutConfig(device="cpu", max_running_requests=args.max_running),
    )
    runner = EpisodeRunner(engine, tokenizer, RolloutServiceConfig())
    channel = aio_channel(server.address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    try:
        print(
            f"RunEpisodes: {len(tasks)} prompts x {args.group_size} samples x "
            f"{args.max_new_tokens} new tokens = {expected} tokens/round; {args.model}; "
            f"max_running_requests {args.max_running}; server {server.address} "
            f"(subprocess pid {server.process.pid})",
            flush=True,
        )
        # Warm-up of both sides (first forward passes, allocator, channel set-up).
        await grpc_round(stub, tasks)
        await inproc_round(runner, tasks)
        grpc_samples: list[tuple[int, float]] = []
        inproc_samples: list[tuple[int, float]] = []
        # CPU seconds per round (a load-insensitive view of the work each side does): gRPC is
        # the server process plus this client process, in-process is this process.
        grpc_cpu: list[float] = []
        inproc_cpu: list[float] = []
        pid = server.process.pid
        for r in range(args.repeats):
            # Alternate which side goes first so drifting machine load hits both alike.
            order = ("grpc", "inproc") if r % 2 == 0 else ("inproc", "grpc")
            for side in order:
                if side == "grpc":
                    cpu0 = time.process_time() + process_cpu_seconds(pid)
                    grpc_samples.append(await grpc_round(stub, tasks))
                    grpc_cpu.append(time.process_time() + process_cpu_seconds(pid) - cpu0)
                else:
                    cpu0 = time.process_time()
                    inproc_samples.append(await inproc_round(runner, tasks))
                    inproc_cpu.append(time.process_time() - cpu0)
        for n, _ in grpc_samples + inproc_samples:
            if n != expected:
                raise RuntimeError(f"a round generated {n} tokens, expected {expected}")
        grpc_rate = summary("gRPC RunEpisodes", grpc_samples, grpc_cpu)
        inproc_rate = summary("in-process EpisodeRunner", inproc_samples, inproc_cpu)
        pair_ratios = [
            (ng / sg) / (ni / si)
            for (ng, sg), (ni, si) in zip(grpc_samples, inproc_samples, strict=True)
        ]
        print(
            f"  per-round-pair gRPC/in-process ratios: "
            f"{' '.join(f'{r:.3f}' for r in pair_ratios)} "
            f"(median {statistics.median(pair_ratios):.3f})",
            flush=True,
        )

        rng = random.Random(args.seed)
        low = max(1, args.max_new_tokens // 2)
        high = args.max_new_tokens + args.max_new_tokens // 2
        prompts = [
            tokenizer.encode(t.data["prompt"], add_special_tokens=False)
            for t in tasks
            for _ in range(args.group_size)
        ]
        requests = [
            (
                prompts[i % len(prompts)],
                SamplingConfig(max_new_tokens=rng.randint(low, high), ignore_eos=True),
            )
            for i in range(args.cb_requests)
        ]
        cb_expected = sum(cfg.max_new_tokens for _, cfg in requests)
        print(
            f"continuous batching: {len(requests)} requests, max_new_tokens uniform in "
            f"[{low}, {high}] ({cb_expected} tokens/round), at most {args.max_running} running",
            flush=True,
        )
        await cb_round(engine, requests[: min(8, len(requests))], sequential=True)
        batched: list[tuple[int, float]] = []
        sequential: list[tuple[int, float]] = []
        for _ in range(args.repeats_sequential):
            batched.append(await cb_round(engine, requests, sequential=False))
            sequential.append(await cb_round(engine, requests, sequential=True))
        for n, _ in batched + sequential:
            if n != cb_expected:
                raise RuntimeError(f"a round generated {n} tokens, expected {cb_expected}")
        batched_rate = summary("continuous batching", batched)
        sequential_rate = summary("one request at a time", sequential)
    finally:
        await channel.close()
        await engine.close()

    print("(values are medians over the timed rounds; warm-up rounds not counted)")
    result("rollout_throughput", grpc_rate, "tok/s", inproc_rate, "0.9")
    result("continuous_batching", batched_rate, "tok/s", sequential_rate, "1.0")


async def raw_vllm_round(
    engine: InferenceEngine, prompts: list[list[int]], max_new_tokens: int
) -> tuple[int, float]:
    """(generated tokens, seconds) of vLLM's own AsyncLLM.generate, one request per sequence
    (the engine's sampling: temperature 1, ignore_eos, the sampled token's log-prob)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = engine._llm  # type: ignore[attr-defined]
    params = SamplingParams(
        temperature=1.0,
        max_tokens=max_new_tokens,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def one(i: int, ids: list[int]) -> int:
        count = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"raw-{i}"):
            count = len(out.outputs[0].token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return sum(counts), time.perf_counter() - start


async def engine_round(
    engine: InferenceEngine, prompts: list[list[int]], max_new_tokens: int
) -> tuple[int, float]:
    """(generated tokens, seconds) of one request per sequence through an engine."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(ids, cfg) for ids in prompts))
    return sum(len(r.output_ids) for r in results), time.perf_counter() - start


async def bench_vllm(args: argparse.Namespace, server: Child) -> None:
    from areal_servers.rollout.vllm_engine import VLLMEngine

    from areal_grpc.config import VllmSettings

    tokenizer = load_tokenizer(args.model)
    vllm = VLLMEngine(args.model, VllmSettings(), seed=args.seed)
    await vllm.start()
    hf = HFEngine(ModelConfig(source=args.model, seed=args.seed), RolloutConfig(device="cpu"))
    channel = aio_channel(server.address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    results: list[tuple[str, float, str, float, str]] = []
    try:
        for batch in args.batches:
            prompts_n = max(1, batch // args.group_size)
            sub = argparse.Namespace(**{**vars(args), "prompts": prompts_n})
            tasks = episode_tasks(sub)
            # The prompt ids the RLVR workflow sends (its chat template and all), per sequence.
            ctx = types.SimpleNamespace(
                engine=vllm,
                tokenizer=tokenizer,
                sampling=SamplingConfig(max_new_tokens=args.max_new_tokens),
            )
            prompts = [
                prompt_ids_of(ctx, json_format.MessageToDict(t.data))[1]  # type: ignore[arg-type]
                for t in tasks
                for _ in range(args.group_size)
            ]
            expected = len(prompts) * args.max_new_tokens
            print(
                f"batch {len(prompts)}: {len(tasks)} prompts x {args.group_size} samples x "
                f"{args.max_new_tokens} new tokens = {expected} tokens/round; {args.model}",
                flush=True,
            )
            await grpc_round(stub, tasks)
            await raw_vllm_round(vllm, prompts, args.max_new_tokens)
            await engine_round(hf, prompts, args.max_new_tokens)
            grpc_s: list[tuple[int, float]] = []
            raw_s: list[tuple[int, float]] = []
            hf_s: list[tuple[int, float]] = []
            for r in range(args.repeats):
                sides = ["grpc", "raw", "hf"]
                for side in sides[r % 3 :] + sides[: r % 3]:
                    if side == "grpc":
                        grpc_s.append(await grpc_round(stub, tasks))
                    elif side == "raw":
                        raw_s.append(await raw_vllm_round(vllm, prompts, args.max_new_tokens))
                    else:
                        hf_s.append(await engine_round(hf, prompts, args.max_new_tokens))
            for n, _ in grpc_s + raw_s + hf_s:
                if n != expected:
                    raise RuntimeError(f"a round generated {n} tokens, expected {expected}")
            g = summary("gRPC RunEpisodes (vllm)", grpc_s)
            raw = summary("in-process vLLM generate", raw_s)
            h = summary("in-process hf engine", hf_s)
            results.append((f"rollout_vllm_b{len(prompts)}", g, "tok/s", raw, "0.9"))
            results.append((f"rollout_vllm_vs_hf_b{len(prompts)}", raw, "tok/s", h, "none"))
    finally:
        await channel.close()
        await hf.close()
        await vllm.close()
    print("(values are medians over the timed rounds; warm-up rounds not counted)")
    for line in results:
        result(*line)


async def raw_sglang_round(
    url: str, prompts: list[list[int]], max_new_tokens: int
) -> tuple[int, float]:
    """(generated tokens, seconds) of direct ``/generate`` calls, one per sequence, with the
    body the engine sends (temperature 1, ignore_eos, the sampled token's log-prob)."""
    from areal_servers.rollout.sglang_engine import (
        generate_payload,
        http_client,
        http_request,
        parse_generate_response,
    )

    cfg = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    async with http_client() as client:
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(
                http_request(url, "POST", "/generate", generate_payload(ids, cfg), 600.0, client)
                for ids in prompts
            )
        )
        seconds = time.perf_counter() - start
    return sum(len(parse_generate_response(r.json())[0]) for r in replies), seconds


async def bench_sglang(args: argparse.Namespace, server: Child, url: str) -> None:
    tokenizer = load_tokenizer(args.model)
    channel = aio_channel(server.address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    results: list[tuple[str, float, str, float, str]] = []
    try:
        for batch in args.batches:
            prompts_n = max(1, batch // args.group_size)
            tasks = episode_tasks(argparse.Namespace(**{**vars(args), "prompts": prompts_n}))
            ctx = types.SimpleNamespace(
                engine=types.SimpleNamespace(check_prompt=lambda *a: None),
                tokenizer=tokenizer,
                sampling=SamplingConfig(max_new_tokens=args.max_new_tokens),
            )
            prompts = [
                prompt_ids_of(ctx, json_format.MessageToDict(t.data))[1]  # type: ignore[arg-type]
                for t in tasks
                for _ in range(args.group_size)
            ]
            expected = len(prompts) * args.max_new_tokens
            print(
                f"batch {len(prompts)}: {len(tasks)} prompts x {args.group_size} samples x "
                f"{args.max_new_tokens} new tokens = {expected} tokens/round; {args.model}",
                flush=True,
            )
            await grpc_round(stub, tasks)
            await raw_sglang_round(url, prompts, args.max_new_tokens)
            grpc_s: list[tuple[int, float]] = []
            raw_s: list[tuple[int, float]] = []
            for r in range(args.repeats):
                for side in ("grpc", "raw") if r % 2 == 0 else ("raw", "grpc"):
                    if side == "grpc":
                        grpc_s.append(await grpc_round(stub, tasks))
                    else:
                        raw_s.append(await raw_sglang_round(url, prompts, args.max_new_tokens))
            for n, _ in grpc_s + raw_s:
                if n != expected:
                    raise RuntimeError(f"a round generated {n} tokens, expected {expected}")
            g = summary("gRPC RunEpisodes (sglang)", grpc_s)
            raw = summary("direct HTTP to SGLang", raw_s)
            results.append((f"rollout_sglang_b{len(prompts)}", g, "tok/s", raw, "0.9"))
    finally:
        await channel.close()
    print("(values are medians over the timed rounds; warm-up rounds not counted)")
    for line in results:
        result(*line)


def launch_sglang(args: argparse.Namespace) -> tuple[object, str]:
    """An SGLang server for ``args.model`` as a rollout server launches one; (it, its URL)."""
    import httpx
    from areal_servers.rollout.served_model import served_checkpoint
    from areal_servers.rollout.sglang_server import (
        SGLangProcess,
        launch_argv,
        launch_env,
        sglang_python,
    )

    from areal_grpc.config import SglangSettings
    from areal_grpc.ports import free_port

    settings = SglangSettings()
    served, _ = served_checkpoint(args.model, args.seed, "bench")
    port = free_port()
    gpu = torch.cuda.is_available()
    argv = launch_argv(sglang_python(settings), served, port, settings, seed=args.seed, gpu=gpu)
    process = SGLangProcess(argv, launch_env(gpu))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + settings.start_timeout_s
    while True:
        if process.exit_code() is not None:
            raise RuntimeError(f"SGLang exited: {process.last_lines()}")
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("SGLang did not start")
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("hf", "vllm", "sglang"), default="hf")
    parser.add_argument(
        "--batches",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[8, 64],
        help="--engine vllm / sglang: sequences per round, comma-separated (8,64)",
    )
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--task", default="first3", help="built-in task the prompts come from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-running", type=int, default=256, help="max_running_requests")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per side")
    parser.add_argument("--cb-requests", type=int, default=32)
    parser.add_argument(
        "--repeats-sequential", type=int, default=3, help="timed rounds of the batching test"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, exit_on_sigterm)

    argv = python_module_argv(
        "areal_servers.rollout",
        "--port=0",
        "--host=127.0.0.1",
        "--log-level=WARNING",
        f"model.source={args.model}",
        f"model.seed={args.seed}",
        f"rollout.engine={args.engine}",
        "rollout.device=cpu",
        f"rollout.max_running_requests={args.max_running}",
    )
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    children: list[Child] = []
    sglang = None
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as logs:
        try:
            if args.engine == "sglang":
                # The rollout server attaches to it, so both sides talk to one SGLang server.
                sglang, url = launch_sglang(args)
                argv += ["--sglang-url", url]
            children.append(
                start_child("rollout", argv, log_dir=Path(logs), env=env, ready_timeout_s=900)
            )
            if args.engine == "sglang":
                asyncio.run(bench_sglang(args, children[0], url))
            else:
                asyncio.run((bench_vllm if args.engine == "vllm" else bench)(args, children[0]))
        except BaseException:
            for child in children:
                if child.log_path is not None and child.log_path.exists():
                    sys.stderr.write(child.log_path.read_text()[-4000:])
            raise
        finally:
            stop_children(children)
            if sglang is not None:
                sglang.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
