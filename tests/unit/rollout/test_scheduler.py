"""The hf engine's scheduler on its own: rounds driven by the test (no decode thread), the way
the engine's loop drives them, over the built-in micro model."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import torch
from areal_servers.rollout.engine import FinishReason, SamplingConfig, TokenEvent
from areal_servers.rollout.scheduler import Request, Scheduler

from areal_grpc.model import load_model

_ids = itertools.count()


@pytest.fixture(scope="module")
def model():
    m = load_model("builtin:micro", seed=0)
    m.eval()
    m.requires_grad_(False)
    return m


def scheduler(model, *, max_running: int = 8, max_batch_tokens: int | None = None) -> Scheduler:
    return Scheduler(
        model,
        torch.device("cpu"),
        threading.Condition(),
        max_running=max_running,
        max_batch_tokens=max_batch_tokens,
        seed=0,
    )


def request(prompt: list[int], **sampling) -> Request:
    params = SamplingConfig(ignore_eos=True, **{"max_new_tokens": 8, **sampling})
    req = Request(
        rid=next(_ids),
        prompt=prompt,
        params=params,
        loop=asyncio.get_running_loop(),
        queue=asyncio.Queue(),
        stop_ids=frozenset(params.stop_token_ids),
    )
    if params.seed is not None:
        req.generator = torch.Generator().manual_seed(params.seed)
    return req


def submit(s: Scheduler, *reqs: Request) -> None:
    with s.cond:
        for r in reqs:
            s.submit_locked(r)


async def round_(s: Scheduler, version: int = 0) -> list[Request]:
    """One round of the engine's loop (without pause handling); returns who was admitted."""
    with s.cond:
        s.drop_finished_locked()
        admitted = s.admit_locked()
    with torch.no_grad():
        if admitted:
            s.prefill(admitted, version)
        with s.cond:
            s.joined_locked()
        s.decode(version)
    await asyncio.sleep(0)  # delivers the events the round sent (call_soon_threadsafe)
    return admitted


def events(req: Request) -> list[TokenEvent]:
    out = []
    while not req.queue.empty():
        ev = req.queue.get_nowait()
        assert isinstance(ev, TokenEvent), ev
        out.append(ev)
    return out


def tokens(evs: list[TokenEvent]) -> list[int]:
    return [t for ev in evs for t in ev.token_ids]


async def test_a_seeded_request_admitted_mid_batch_gets_the_tokens_it_gets_alone(model):
    """Joining a batch that already decodes (left padding, a longer neighbour) changes
    neither the tokens of a seeded request nor, beyond float noise, their log-probs."""
    alone = scheduler(model)
    a = request([5, 6, 7], temperature=1.0, max_new_tokens=10, seed=11)
    submit(alone, a)
    while not a.done:
        await round_(alone)
    want = events(a)

    s = scheduler(model)
    long = request([9, 8, 7, 6, 5, 4], temperature=1.0, max_new_tokens=40)
    submit(s, long)
    for _ in range(5):
        await round_(s)
    b = request([5, 6, 7], temperature=1.0, max_new_tokens=10, seed=11)
    submit(s, b)
    assert await round_(s) == [b]
    with s.cond:
        assert s.running_locked() == 2
    while not b.done:
        await round_(s)
    got = events(b)
    assert tokens(got) == tokens(want) and len(tokens(got)) == 10
    assert got[-1].finish == want[-1].finish == FinishReason.LENGTH
    assert torch.allclose(
        torch.tensor([lp for ev in got for lp in ev.logprobs]),
        torch.tensor([lp for ev in want for lp in ev.logprobs]),
        atol=1e-4,
    )
    assert not long.done  # still decoding: b left the batch, long stays


async def test_the_kv_budget_holds_a_request_back_until_a_row_finishes(model):
    """Budget 40 slots: rows of 4 + 16 and 4 + 6 fit (2 x 20), a third 4 + 16 (3 x 20) waits
    in the queue, and joins the round after the short row finished."""
    s = scheduler(model, max_batch_tokens=40)
    short = request([1, 2, 3, 4], max_new_tokens=6)
    long = request([1, 2, 3, 5], max_new_tokens=16)
    waiting = request([1, 2, 3, 6], max_new_tokens=16)
    submit(s, short, long, waiting)
    assert await round_(s) == [short, long]
    while not short.done:
        with s.cond:
            assert list(s.pending) == [waiting] and s.in_flight_locked() == 2
        assert events(waiting) == []
        await round_(s)
    assert len(tokens(events(short))) == 6
    assert await round_(s) == [waiting]
    while not (long.done and waiting.done):
        await round_(s)
    assert len(tokens(events(long))) == len(tokens(events(waiting))) == 16


async def test_interrupting_ends_live_rows_with_their_partial_output(model):
    """An interrupt (the engine's pause) ends every live row INTERRUPTED after the tokens it
    already had, counts only those (not a cancelled row) and empties the batch."""
    s = scheduler(model)
    reqs = [request([3, 4, 5 + i], max_new_tokens=50) for i in range(3)]
    submit(s, *reqs)
    for _ in range(4):
        await round_(s)
    s.cancel(reqs[2])
    with s.cond:
        assert s.running_locked() == 2
        assert s.interrupt_all_locked() == 2
        assert not s.has_work_locked() and s.in_flight_locked() == 0
    await asyncio.sleep(0)
    for r in reqs[:2]:
        evs = events(r)
        assert len(tokens(evs)) == 5  # one from the prefill, one per decode step after it
        assert evs[-1].finish == FinishReason.INTERRUPTED
    assert FinishReason.INTERRUPTED not in [ev.finish for ev in events(reqs[2])]


async def test_a_cancelled_row_leaves_the_batch_and_its_cache_columns_go_with_it(model):
    """A cancelled row leaves at the next round; the padding it alone needed is trimmed, and
    the row that stays decodes on as it would have."""
    s = scheduler(model)
    stays = request([7, 8], temperature=0.0, max_new_tokens=12)
    leaves = request([1, 2, 3, 4, 5, 6], temperature=0.0, max_new_tokens=12)
    submit(s, stays, leaves)
    await round_(s)
    with s.cond:
        assert s.batch.mask is not None and s.batch.mask.shape == (2, 7)
    s.cancel(leaves)
    await round_(s)
    with s.cond:
        assert s.batch.requests == [stays]
        assert s.batch.mask is not None and bool(s.batch.mask.all())
    while not stays.done:
        await round_(s)

    alone = scheduler(model)
    again = request([7, 8], temperature=0.0, max_new_tokens=12)
    submit(alone, again)
    while not again.done:
        await round_(alone)
    assert tokens(events(stays)) == tokens(events(again))
