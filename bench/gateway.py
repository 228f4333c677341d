"""Completions through the OpenAI-compatible gateway against direct gRPC ``Generate``.

One rollout server process (builtin:micro), an in-process CoordinatorService with it
registered, and ``areal-gateway`` as its own process. At each concurrency ``n`` (1, 8, 32),
``n`` concurrent clients each hold one RL session and send chat completions through the
``openai`` package for ``--seconds``; then ``n`` clients send the same prompt ids straight to
the rollout server with ``Generate`` for as long. Every completion asks for the same
``--max-tokens`` at temperature 1. Prints, per ``n``,

    RESULT bench=gateway_throughput_<n> value=<gateway completions/s> unit=completions/s
           baseline=<direct completions/s> ratio=<value / baseline> target=0.9
    RESULT bench=gateway_p99_<n> value=<gateway p99 s> unit=s baseline=<direct p99 s>
           ratio=<value / baseline> target=none

    .venv/bin/python bench/gateway.py [--seconds 10] [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai
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


async def load(
    n: int, seconds: float, make: Callable[[int], Awaitable[Callable[[], Awaitable[None]]]]
) -> tuple[float, list[float]]:
    """``n`` workers calling their request function back to back: (completions/s, latencies)."""
    calls = [await make(i) for i in range(n)]
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def worker(call: Callable[[], Awaitable[None]]) -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            await call()
            latencies.append(time.monotonic() - t0)

    start = time.monotonic()
    await asyncio.gather(*(worker(c) for c in calls))
    return len(latencies) / (time.monotonic() - start), latencies


def p(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``."""
    return statistics.quantiles(values, n=100)[min(98, max(0, round(q * 100) - 1))]


async def measure(args: argparse.Namespace, gateway: str, rollout: str) -> None:
    renderer = ChatRenderer(load_tokenizer(MODEL))
    prompt = renderer.encode(renderer.text(MESSAGES))
    sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens)
    direct = RolloutClient(rollout)
    http = httpx.AsyncClient(timeout=60)
    clients: list[openai.AsyncOpenAI] = []

    async def via_gateway(i: int) -> Callable[[], Awaitable[None]]:
        sid = (await http.post(f"{gateway}/rl/sessions", json={})).json()["session_id"]
        c = openai.AsyncOpenAI(
            base_url=f"{gateway}/v1",
            api_key="x",
            max_retries=0,
            default_headers={"X-Session-Id": sid},
        )
        clients.append(c)

        async def call() -> None:
            await c.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=args.max_tokens, temperature=1.0
            )

        return call

    async def via_grpc(i: int) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            await direct.generate(prompt, sampling, timeout_s=60)

        return call

    for n in args.concurrency:
        await load(n, 2.0, via_grpc)  # warm-up
        g_rate, g_lat = await load(n, args.seconds, via_gateway)
        for c in clients:
            await c.close()
        clients.clear()
        d_rate, d_lat = await load(n, args.seconds, via_grpc)
        print(
            f"n={n:>2}: gateway {g_rate:.1f}/s p50 {p(g_lat, 0.5) * 1e3:.0f} ms p99 "
            f"{p(g_lat, 0.99) * 1e3:.0f} ms | direct {d_rate:.1f}/s p50 "
            f"{p(d_lat, 0.5) * 1e3:.0f} ms p99 {p(d_lat, 0.99) * 1e3:.0f} ms",
            flush=True,
        )
        result(f"gateway_throughput_{n}", g_rate, "completions/s", d_rate, "0.9")
        result(f"gateway_p99_{n}", p(g_lat, 0.99), "s", p(d_lat, 0.99), "none")
    await http.aclose()
    await direct.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        logs = Path(tmp)
        rollout = start_child(
            "rollout",
            python_module_argv("areal_servers.rollout", "--port", "0", f"model.source={MODEL}"),
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
                    f"model.source={MODEL}",
                ),
                log_dir=logs,
            )
            asyncio.run(measure(args, f"http://{gateway.address}", rollout.address))
        finally:
            stop_children([c for c in (gateway, rollout) if c is not None])
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
