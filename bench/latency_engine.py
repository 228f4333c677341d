"""A rollout server whose engine takes a sampled, long-tailed extra time per generation.

Used by ``bench/async_speedup.py``. :class:`LatencyEngine` wraps any
:class:`~areal_servers.rollout.engine.InferenceEngine`: every generation request (one sample)
first spends a delay ``d`` drawn from :class:`LogNormalDelay`, then streams the inner engine's
real tokens (so token ids, logprobs and per-token versions are the real engine's). The delay
stands for decoding time, whose long tail comes from the long tail of response lengths:

    d = min(median * exp(sigma * Z), cap * median),   Z ~ N(0, 1)

(a lognormal truncated at ``cap`` times the median, as a max-new-tokens limit truncates the
longest responses). Semantics kept:

- pause / resume: the delay clock runs only while the engine is not paused (a paused engine
  decodes nothing); a request in its delay phase waits like a queued request and is not
  counted as interrupted. The inner engine's requests are interrupted as usual.
- a request re-sent after an interruption (``generate_resumable`` re-sends prompt + partial
  output) does not pay a second delay: an interrupted stream leaves a credit under its
  prompt + output, which the next request with exactly those ids consumes.
- load_weights and the weight-update methods go to the inner engine (attribute delegation).

Run as a server (same options as ``areal-rollout`` plus the ``--delay-*`` ones)::

    .venv/bin/python bench/latency_engine.py --port 0 \\
        --delay-median-s 0.05 --delay-sigma 1.2 --delay-cap 10 model.source=builtin:micro

It prints ``LISTENING host:port`` once bound, like every server (areal_grpc.cli).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
from collections import Counter
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from areal_servers.rollout.__main__ import DEFAULT_PORT, add_rollout_args
from areal_servers.rollout.build import create_engine, rollout_services
from areal_servers.rollout.engine import (
    EngineStatus,
    FinishReason,
    InferenceEngine,
    SamplingConfig,
    TokenEvent,
)

from areal_grpc.cli import base_parser, serve_main
from areal_grpc.server import Service
from areal_grpc.server_config import ROLLOUT_SECTIONS, run_config_from_args


@dataclass(frozen=True)
class LogNormalDelay:
    """``min(median * exp(sigma * Z), cap * median)`` seconds."""

    median_s: float = 0.05
    sigma: float = 1.2
    cap: float = 10.0

    def sample(self, rng: random.Random) -> float:
        """One delay in seconds."""
        return min(self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)), self.cap_s)

    @property
    def cap_s(self) -> float:
        """The longest delay."""
        return self.cap * self.median_s

    def draws(self, shape: tuple[int, ...], seed: int = 12345) -> np.ndarray:
        """Independent draws (numpy), for Monte Carlo expectations."""
        z = np.random.default_rng(seed).standard_normal(shape)
        return np.minimum(self.median_s * np.exp(self.sigma * z), self.cap_s)

    def mean(self) -> float:
        """E[d] in closed form (lognormal mean with the cap's mass folded in)."""
        # E[min(m e^{sZ}, c m)] = m e^{s^2/2} Phi(ln c / s - s) + c m (1 - Phi(ln c / s)).
        m, s, c = self.median_s, self.sigma, self.cap
        phi = _norm_cdf
        return m * math.exp(s * s / 2) * phi(math.log(c) / s - s) + c * m * (
            1.0 - phi(math.log(c) / s)
        )

    def expected_max(self, n: int, trials: int = 200_000) -> float:
        """E[max of n independent delays] (Monte Carlo over ``trials`` sets)."""
        # Max of n draws = the inverse CDF at U^(1/n): one normal quantile per trial.
        u = np.random.default_rng(n).random(trials) ** (1.0 / n)
        z = torch.special.ndtri(torch.from_numpy(u)).numpy()
        return float(np.minimum(self.median_s * np.exp(self.sigma * z), self.cap_s).mean())

    def describe(self) -> str:
        """One line for logs."""
        return (
            f"lognormal delay: median {self.median_s * 1e3:.0f} ms, sigma {self.sigma}, "
            f"cap {self.cap}x median ({self.cap_s * 1e3:.0f} ms), mean {self.mean() * 1e3:.1f} ms"
        )


def _norm_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class LatencyEngine(InferenceEngine):
    """``inner`` with a sampled extra delay before each generation (see the module doc)."""

    def __init__(
        self,
        inner: InferenceEngine,
        delay: LogNormalDelay,
        seed: int = 0,
        log_path: str | None = None,
    ) -> None:
        self.inner = inner
        # One line per sampled delay (seconds), in request order, when set.
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115
        self.delay = delay
        self.rng = random.Random(seed)
        self.kind = inner.kind
        self.model_name = inner.model_name
        self.vocab_size = inner.vocab_size
        self.max_context = inner.max_context
        self.eos_token_id = inner.eos_token_id
        self.pad_token_id = inner.pad_token_id
        self._paused = False
        self._pause_event: asyncio.Event | None = None
        self._resume_event: asyncio.Event | None = None
        # prompt + partial output of interrupted streams -> how many re-sends skip the delay.
        self._credits: Counter[tuple[int, ...]] = Counter()
        self.delayed = 0
        self.delay_total_s = 0.0

    def __getattr__(self, name: str) -> Any:
        # Engine-specific extras (update_weights_from_disk, ...) go to the inner engine.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._pause_event is None or self._resume_event is None:
            self._pause_event, self._resume_event = asyncio.Event(), asyncio.Event()
            if not self._paused:
                self._resume_event.set()
        return self._pause_event, self._resume_event

    async def _wait_delay(self, seconds: float) -> None:
        """Sleeps ``seconds`` of unpaused time."""
        paused, resumed = self._events()
        loop = asyncio.get_running_loop()
        remaining = seconds
        while remaining > 0:
            await resumed.wait()
            started = loop.time()
            try:
                await asyncio.wait_for(paused.wait(), remaining)
            except TimeoutError:
                return
            remaining -= loop.time() - started

    async def stream(
        self, input_ids: Sequence[int], params: SamplingConfig
    ) -> AsyncGenerator[TokenEvent, None]:
        """The inner engine's stream, after the sampled delay (unless this is a re-send)."""
        key = tuple(input_ids)
        if self._credits[key] > 0:
            self._credits[key] -= 1
            if not self._credits[key]:
                del self._credits[key]
        else:
            d = self.delay.sample(self.rng)
            self.delayed += 1
            self.delay_total_s += d
            if self._log is not None:
                self._log.write(f"{d:.6f}\n")
                self._log.flush()
            await self._wait_delay(d)
        out: list[int] = []
        inner = self.inner.stream(input_ids, params)
        try:
            async for event in inner:
                out += event.token_ids
                if event.finish == FinishReason.INTERRUPTED:
                    self._credits[key + tuple(out)] += 1
                yield event
        finally:
            await inner.aclose()

    async def pause(self, wait: bool = True) -> int:
        """Stops the delay clocks and pauses the inner engine."""
        paused, resumed = self._events()
        self._paused = True
        resumed.clear()
        paused.set()
        return await self.inner.pause(wait)

    async def resume(self) -> None:
        """Resumes the inner engine and the delay clocks."""
        await self.inner.resume()
        paused, resumed = self._events()
        self._paused = False
        paused.clear()
        resumed.set()

    async def wait_until_resumed(self) -> None:
        """Returns when not paused."""
        await self.inner.wait_until_resumed()

    async def start(self) -> None:
        """The inner engine's start."""
        await self.inner.start()

    async def load_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, owned: bool = False
    ) -> dict[str, torch.Tensor]:
        """The inner engine's weight swap."""
        return await self.inner.load_weights(state_dict, version, owned=owned)

    @property
    def version(self) -> int:
        """The inner engine's policy version."""
        return self.inner.version

    def status(self) -> EngineStatus:
        """The inner engine's status."""
        return self.inner.status()

    async def close(self) -> None:
        """Closes the inner engine (and the delay log)."""
        await self.inner.close()
        if self._log is not None:
            self._log.close()


def add_delay_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--delay-*`` options."""
    parser.add_argument("--delay-median-s", type=float, default=0.05)
    parser.add_argument("--delay-sigma", type=float, default=1.2)
    parser.add_argument("--delay-cap", type=float, default=10.0, help="cap, in medians")
    parser.add_argument("--delay-seed", type=int, default=0)
    parser.add_argument("--delay-log", default=None, help="append each sampled delay here")
    return parser


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The services of ``areal-rollout`` (servers/rollout/build.py) over a LatencyEngine."""
    run = run_config_from_args(args, ROLLOUT_SECTIONS)
    torch.set_num_threads(run.rollout.torch_threads)
    delay = LogNormalDelay(args.delay_median_s, args.delay_sigma, args.delay_cap)
    engine = LatencyEngine(
        create_engine(run, args.sglang_url), delay, args.delay_seed, args.delay_log
    )
    return await rollout_services(run, engine)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``areal-rollout`` with a latency-injecting engine."""
    parser = base_parser(
        "areal-rollout-latency", "A rollout server with injected generation latency.", DEFAULT_PORT
    )
    return serve_main(add_delay_args(add_rollout_args(parser)), build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
