"""The coordinator's evaluator, a component on its own: real rollout servers (builtin:micro, in
process, on loopback), no run around it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator

import pytest
import torch
from areal_clients.rollout import RolloutClient
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.service import RolloutServiceConfig, RolloutServicer
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from google.protobuf import struct_pb2

from areal_grpc.config import ModelConfig
from areal_grpc.coordinator.evaluator import Evaluator
from areal_grpc.model import load_tokenizer
from areal_grpc.rewards import REWARD_FNS
from areal_grpc.server import ServerOptions, service, start_server
from areal_grpc.tasks import task_dataset

torch.set_num_threads(1)


@contextlib.asynccontextmanager
async def rollout_server() -> AsyncIterator[RolloutClient]:
    engine = HFEngine(ModelConfig(source="builtin:micro", seed=0))
    servicer = RolloutServicer(
        engine, load_tokenizer("builtin:micro"), RolloutServiceConfig(default_max_new_tokens=2)
    )
    running = await start_server(
        [service(servicer, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2)],
        ServerOptions(host="127.0.0.1", port=0),
    )
    client = RolloutClient(running.address)
    try:
        yield client
    finally:
        await client.close()
        await running.stop(0)
        await engine.close()


def parity_reward(prompt, completion, prompt_ids, completion_ids, item) -> float:
    """Deterministic under greedy decoding and different from item to item, even for the
    untrained micro model (which scores 0 on the echo task's own reward)."""
    return float(completion_ids[0] % 2) if completion_ids else 0.0


@pytest.fixture(autouse=True)
def parity(monkeypatch):
    # The servers run in this process: the reward is registered under a short name there.
    monkeypatch.setitem(REWARD_FNS, "parity", parity_reward)


def evaluator(items: list[dict], timeout_s: float = 60.0) -> Evaluator:
    params = struct_pb2.Struct()
    params.update({"reward_fn": "parity"})
    return Evaluator(
        items,
        workflow="rlvr",
        workflow_params=params,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=2),
        episode_timeout_s=timeout_s,
    )


# The built-in echo task's 36 prompts, tagged with two kinds so per-kind scoring shows.
ITEMS = [
    {**item, "kind": "digit" if item["answer"].isdigit() else "letter"}
    for item in task_dataset("echo", "eval")
]


def test_the_score_does_not_depend_on_how_the_items_are_split_over_servers():
    async def scenario():
        async with rollout_server() as a, rollout_server() as b:
            ev = evaluator(ITEMS)
            one = await ev.evaluate([a], step=3)
            two = await ev.evaluate([a, b], step=3)
            # Each item alone, through a fresh single-item evaluator: the per-item scores.
            singles = [(await evaluator([it]).evaluate([b], 0)).accuracy for it in ITEMS]
            return one, two, singles

    one, two, singles = asyncio.run(scenario())
    assert 0 < sum(singles) < len(singles)  # a score that can tell a mix-up
    assert one.prompts == two.prompts == len(ITEMS)
    # Greedy: the same model scores the same, however the items are shared out.
    assert one.accuracy == two.accuracy == sum(singles) / len(singles)
    for kind in ("digit", "letter"):
        mine = [s for s, it in zip(singles, ITEMS, strict=True) if it["kind"] == kind]
        assert one.by_kind[kind] == two.by_kind[kind] == sum(mine) / len(mine)


def test_a_stalled_server_costs_its_share_within_the_episode_deadline_not_the_eval():
    async def scenario():
        async with rollout_server() as live, rollout_server() as frozen:
            await frozen.pause()  # generation waits for a resume that never comes
            started = time.monotonic()
            result = await evaluator(ITEMS, timeout_s=2.0).evaluate([live, frozen], step=1)
            return result, time.monotonic() - started

    result, took = asyncio.run(scenario())
    # The live server's half was scored; the frozen one's was given up after its deadline.
    assert result.prompts == len(ITEMS) // 2
    assert not math.isnan(result.accuracy)
    assert took < 30, took


def test_no_server_or_no_items_is_no_score():
    async def scenario():
        async with rollout_server() as a:
            return await evaluator([]).evaluate([a], 0), await evaluator(ITEMS).evaluate([], 0)

    for result in asyncio.run(scenario()):
        assert math.isnan(result.accuracy) and result.prompts == 0 and result.by_kind == {}
