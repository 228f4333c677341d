"""Completions through the OpenAI-compatible gateway against direct gRPC ``Generate``.

One rollout server process (builtin:micro), an in-process CoordinatorService with it
registered, and ``areal-gateway`` as its own process. At each concurrency ``n`` (1, 8, 32),
``n`` concurrent clients each hold one RL session and send chat completions to the gateway,
and ``n`` clients send the same prompt ids straight to the rollout server with ``Generate``,
for ``--seconds`` each, in ``--rounds`` windows taking turns (all sides warmed up first).
Every completion asks for the same ``--max-tokens`` at temperature 1.

The gateway is driven two ways, as separate sides: by plain HTTP requests (aiohttp, as
serving benchmarks such as vLLM's drive an OpenAI endpoint), which measures the gateway; and
by the ``openai`` package, which measures what an agent written against it sees. The client
processes share the 2 cores with the servers here, and the ``openai`` package spends several
times the gateway's own CPU per completion, so its side reads the client library as much as
the gateway (the CPU lines printed say how much). Prints, per ``n``,

    RESULT bench=gateway_throughput_<n> value=<gateway completions/s, HTTP driver>
           unit=completions/s baseline=<direct completions/s> ratio=<value / baseline>
           target=0.9
    RESULT bench=gateway_openai_throughput_<n> (the same through the ``openai`` package)
    RESULT bench=gateway_p99_<n> value=<gateway p99 s, HTTP driver> unit=s
           baseline=<direct p99 s> ratio=<value / baseline> target=none

    .venv/bin/python bench/gateway.py [--seconds 10] [--concurrency 1 8 32] [--model M]

``--model smollm2-135m-instruct`` measures the same at the real model's scale (its own chat
template; the rollout server's CPU per completion is then several times the gateway's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import openai
import psutil
from areal_clients.gateway.chat import ChatRenderer
from areal_clients.rollout import RolloutClient
from arealgrpc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from results import result
from teardown import exit_on_sigterm

from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.launch import python_module_argv, start_child, stop_children
from areal_grpc.model import load_tokenizer
from areal_grpc.server import BackgroundServer, ServerOptions, sync_channel

MODEL = "builtin:micro"
MESSAGES = [{"role": "user", "content": "Repeat after me: the quick brown fox"}]


Call = Callable[[], Awaitable[None]]


async def load(calls: list[Call], seconds: float) -> tuple[float, list[float]]:
    """One worker per call function, each calling it back to back for ``seconds``: (seconds
    taken, latencies)."""
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def worker(call: Callable[[], Awaitable[None]]) -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            await call()
            latencies.append(time.monotonic() - t0)

    start = time.monotonic()
    await asyncio.gather(*(worker(c) for c in calls))
    return time.monotonic() - start, latencies


def p(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``."""
    return statistics.quantiles(values, n=100)[min(98, max(0, round(q * 100) - 1))]


async def measure(args: argparse.Namespace, gateway: str, rollout: str, pids: list[int]) -> None:
    renderer = ChatRenderer(load_tokenizer(args.model))
    suffix = "" if args.model == MODEL else "_" + re.sub(r"\W+", "_", args.model).strip("_")
    prompt = renderer.encode(renderer.text(MESSAGES))
    sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens)
    direct = RolloutClient(rollout)
    http = httpx.AsyncClient(timeout=60)
    # CPU seconds of the rollout server, the gateway and this process (the clients).
    procs = [psutil.Process(pid) for pid in pids] + [psutil.Process()]

    def cpu() -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in procs]

    async def gateway_calls(
        n: int, driver: str
    ) -> tuple[list[Call], Callable[[], Awaitable[None]]]:
        """``n`` sessions' call functions through ``driver`` (``http`` or ``openai``), and what
        ends the sessions (each has a lease)."""
        sids = [
            (await http.post(f"{gateway}/rl/sessions", json={})).json()["session_id"]
            for _ in range(n)
        ]
        body = {
            "model": args.model,
            "messages": MESSAGES,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
        }
        closers: list[Callable[[], Awaitable[None]]] = []

        def openai_call(sid: str) -> Call:
            c = openai.AsyncOpenAI(
                base_url=f"{gateway}/v1",
                api_key="x",
                max_retries=0,
                default_headers={"X-Session-Id": sid},
            )
            closers.append(c.close)

            async def call() -> None:
                await c.chat.completions.create(**body)

            return call

        def http_call(sid: str) -> Call:
            s = aiohttp.ClientSession(
                f"{gateway}/", headers={"X-Session-Id": sid, "Authorization": "Bearer x"}
            )
            closers.append(s.close)

            async def call() -> None:
                async with s.post("v1/chat/completions", json=body) as r:
                    reply = await r.json()
                    if r.status != 200 or not reply["choices"]:
                        raise RuntimeError(f"gateway answered {r.status}: {reply}")

            return call

        calls = [(openai_call if driver == "openai" else http_call)(sid) for sid in sids]

        async def end() -> None:
            for close in closers:
                await close()
            for sid in sids:
                await http.delete(f"{gateway}/rl/sessions/{sid}")

        return calls, end

    async def call_direct() -> None:
        await direct.generate(prompt, sampling, timeout_s=60)

    async def window(side: str, n: int, seconds: float) -> tuple[float, list[float]]:
        if side == "direct":
            return await load([call_direct] * n, seconds)
        # Fresh sessions per window (outside its time): a lease lasts a minute.
        calls, end = await gateway_calls(n, side)
        try:
            return await load(calls, seconds)
        finally:
            await end()

    sides = ("direct", "http", "openai")
    for n in args.concurrency:
        for side in sides:
            await window(side, n, 2.0)  # warm-up
        # Short windows taking turns, in alternating order: a slower or faster stretch of
        # this shared machine falls on all sides alike.
        taken = dict.fromkeys(sides, 0.0)
        lat: dict[str, list[float]] = {side: [] for side in sides}
        spent = {side: [0.0] * len(procs) for side in sides}
        for r in range(args.rounds):
            for side in sides[::-1] if r % 2 else sides:
                before = cpu()
                seconds, latencies = await window(side, n, args.seconds / args.rounds)
                used = [a - b for a, b in zip(cpu(), before, strict=True)]
                spent[side] = [t + u for t, u in zip(spent[side], used, strict=True)]
                taken[side] += seconds
                lat[side] += latencies
        rate = {side: len(lat[side]) / taken[side] for side in sides}
        print(
            f"n={n:>2}: "
            + " | ".join(
                f"{side} {rate[side]:.1f}/s p50 {p(lat[side], 0.5) * 1e3:.0f} ms "
                f"p99 {p(lat[side], 0.99) * 1e3:.0f} ms"
                for side in sides
            ),
            flush=True,
        )
        for side in sides:
            per = [1e3 * t / max(1, len(lat[side])) for t in spent[side]]
            print(
                f"n={n:>2}: {side} CPU ms per completion: rollout server {per[0]:.2f}, "
                f"gateway {per[1]:.2f}, clients {per[2]:.2f}; CPU busy "
                f"{sum(spent[side]) / taken[side]:.2f} of {os.cpu_count()} cores",
                flush=True,
            )
        tag = f"{n}{suffix}"
        result(f"gateway_throughput_{tag}", rate["http"], "completions/s", rate["direct"], "0.9")
        result(
            f"gateway_openai_throughput_{tag}",
            rate["openai"],
            "completions/s",
            rate["direct"],
            "0.9",
        )
        result(f"gateway_p99_{tag}", p(lat["http"], 0.99), "s", p(lat["direct"], 0.99), "none")
    await http.aclose()
    await direct.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per side and concurrency")
    parser.add_argument("--rounds", type=int, default=5, help="turns the seconds are cut into")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--model",
        default=MODEL,
        help="model source of the rollout server and the gateway; results of any other than "
        f"{MODEL} carry its name (gateway_throughput_8_smollm2_135m_instruct)",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        logs = Path(tmp)
        rollout = start_child(
            "rollout",
            python_module_argv(
                "areal_servers.rollout", "--port", "0", f"model.source={args.model}"
            ),
            log_dir=logs,
        )
        # Room for every session of the largest concurrency (no training consumes groups).
        pool = WorkPool(max(args.concurrency) * 4, 0)
        servicer = CoordinatorServicer(pool)
        server = BackgroundServer([servicer.as_service()], ServerOptions("127.0.0.1", 0))
        running = server.start()
        gateway = None
        try:
            with sync_channel(running.address) as channel:
                coordinator_pb2_grpc.CoordinatorServiceStub(channel).RegisterWorker(
                    coordinator_pb2.RegisterWorkerRequest(
                        role=coordinator_pb2.WORKER_ROLE_ROLLOUT, address=rollout.address
                    ),
                    timeout=10,
                )
            gateway = start_child(
                "gateway",
                python_module_argv(
                    "areal_clients.gateway",
                    "--coordinator",
                    running.address,
                    f"model.source={args.model}",
                ),
                log_dir=logs,
            )
            asyncio.run(
                measure(
                    args,
                    f"http://{gateway.address}",
                    rollout.address,
                    [rollout.process.pid, gateway.process.pid],
                )
            )
        finally:
            stop_children([c for c in (gateway, rollout) if c is not None])
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
