"""Load: 32 concurrent external producers feed a real training run; nothing is lost.

The mesh is real (``start_mesh``: a builtin:micro rollout server and two FSDP2 trainer ranks
over gloo, as subprocesses; the fleet weight sync after every step). The coordinator's loop
and its ``CoordinatorService`` run in this process on one event loop, as
``python -m areal_grpc.coordinator`` runs them, so the test can read the work pool's state
when the run is over. Alongside the run's own dataset rollouts, 32 producers (asyncio tasks,
each with its own channel and ``CoordinatorClient``) loop: ``AcquireRollout`` (on
RESOURCE_EXHAUSTED: wait the server's RetryInfo delay) -> a synthetic group (no generation:
prompt and generated token ids in the vocabulary, every generated token at the lease's
version) -> ``SubmitTrajectories``. The loop trains ``STEPS`` steps on whatever is oldest.

Checked: every lease submitted exactly once, and submitted == accepted + rejected (each
rejection with a reason naming the field); every accepted group trained exactly once, or
still buffered at the end, or dropped as too stale (no more than the pool's
``dropped_stale`` counter; external groups cannot be regenerated, dataset ones are re-queued);
the staleness counters agree with what was trained and buffered; the staleness bound held
for every trained group; the run and every child exit cleanly. Throughput and latency
percentiles are printed (``-s``), not asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from areal_clients.coordinator import CoordinatorClient
from arealgrpc.v1 import common_pb2, coordinator_pb2

from areal_grpc.config import load_config
from areal_grpc.coordinator.launcher import start_mesh
from areal_grpc.coordinator.loop import Coordinator
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.errors import retry_delay_s
from areal_grpc.server import ServerOptions, start_server

pytestmark = pytest.mark.slow

PRODUCERS = 32
STEPS = 6
BATCH = 16  # groups per step
ETA = 1
GROUP = 2  # trajectories per group
PROMPT_TOKENS = 8
GEN_TOKENS = 8
VOCAB = 384  # builtin:micro


def synthetic_group(lease: coordinator_pb2.RolloutLease, k: int) -> common_pb2.TrajectoryGroup:
    """A valid group for ``lease``: every generated token at the lease's policy version."""
    lid = lease.lease_id
    group = common_pb2.TrajectoryGroup(task_id=lid, group_id=lid)
    n = PROMPT_TOKENS + GEN_TOKENS
    for j in range(GROUP):
        group.trajectories.add(
            token_ids=[3 + (k * 7 + j * 13 + i) % (VOCAB - 3) for i in range(n)],
            logprobs=[0.0] * PROMPT_TOKENS + [-1.0] * GEN_TOKENS,
            versions=[-1] * PROMPT_TOKENS + [lease.policy_version] * GEN_TOKENS,
            loss_mask=[False] * PROMPT_TOKENS + [True] * GEN_TOKENS,
            reward=float(j % 2),  # a non-uniform group: non-zero advantages
            prompt_length=PROMPT_TOKENS,
            task_id=lid,
            group_id=lid,
        )
    return group


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass
class Tally:
    """What the producers saw."""

    leased: list[str] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    refused: int = 0
    acquire_ms: list[float] = field(default_factory=list)  # granted calls
    refused_ms: list[float] = field(default_factory=list)
    submit_ms: list[float] = field(default_factory=list)


async def producer(p: int, address: str, stop: asyncio.Event, tally: Tally) -> None:
    """Leases, builds and submits groups until ``stop``; a lease taken is always submitted."""
    client = CoordinatorClient(address)
    k = 0
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                lease = await client.acquire(f"load-{p}", GROUP)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                tally.refused_ms.append((time.perf_counter() - t0) * 1e3)
                tally.refused += 1
                delay = retry_delay_s(exc)
                assert delay is not None, exc
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                continue
            tally.acquire_ms.append((time.perf_counter() - t0) * 1e3)
            tally.leased.append(lease.lease_id)
            group = synthetic_group(lease, k)
            k += 1
            t1 = time.perf_counter()
            reply = await client.submit([(lease.lease_id, group)])
            tally.submit_ms.append((time.perf_counter() - t1) * 1e3)
            tally.submitted.append(lease.lease_id)
            if reply.accepted_groups:
                tally.accepted.append(lease.lease_id)
            for r in reply.rejections:
                tally.rejected[r.lease_id] = r.reason
    finally:
        await client.close()


@dataclass
class Outcome:
    """The run's result, the producers' tally and the pool's state at the end."""

    steps: int
    elapsed_s: float
    tally: Tally
    buffered: list[tuple[str, str]]  # (task id, producer) still in the buffer
    open_leases: int
    running: int
    accepted: int  # staleness counters
    rejected: int
    dropped_stale: int
    requeued: int
    rejected_reasons: Counter[str]


async def run_with_producers(cfg, rollout_addresses, trainer_addresses, out: Path) -> Outcome:
    """The run's loop and service in this event loop, with ``PRODUCERS`` producers."""
    coordinator = Coordinator(cfg, rollout_addresses, trainer_addresses, out)
    servicer = CoordinatorServicer(coordinator.pool)
    for i, a in enumerate(rollout_addresses):
        servicer.add_local_worker(coordinator_pb2.WORKER_ROLE_ROLLOUT, a, f"rollout-{i}")
    server = await start_server(
        [servicer.as_service()],
        ServerOptions(host="127.0.0.1", port=0),
    )
    servicer.start()
    stop = asyncio.Event()
    tally = Tally()
    started = time.perf_counter()
    tasks = [
        asyncio.create_task(producer(p, server.address, stop, tally)) for p in range(PRODUCERS)
    ]
    try:
        result = await coordinator.run()
    finally:
        stop.set()
        # A producer's exception fails the test here.
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        await servicer.stop()
        await server.stop(0)
        await coordinator.close()
    pool = coordinator.pool
    st = pool.staleness.stats()
    return Outcome(
        steps=result.steps,
        elapsed_s=elapsed,
        tally=tally,
        buffered=[(f.work.task_id, f.work.producer) for f in pool.buffer],
        open_leases=len(pool.leases),
        running=st.running,
        accepted=st.accepted,
        rejected=st.rejected,
        dropped_stale=pool.stats.dropped_stale,
        requeued=pool.stats.requeued,
        rejected_reasons=Counter(pool.stats.rejected_reasons),
    )


def test_32_external_producers_feed_a_training_run_and_nothing_is_lost(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"output.dir={out}",
            "data.task=echo",
            f"total_steps={STEPS}",
            f"staleness.batch_size={BATCH}",
            f"staleness.group_size={GROUP}",
            f"staleness.max_staleness={ETA}",
            # Room for every producer to hold a lease at once.
            f"rollout.max_concurrent_rollouts={PRODUCERS}",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            "checkpoint.export_hf=false",
            "weight_sync.methods=[stream]",
            "output.plot=false",
            "output.tensorboard=false",
            "output.progress_bar=false",
        ],
    )
    mesh = start_mesh(cfg, tmp_path / "logs")
    try:
        outcome = asyncio.run(
            run_with_producers(cfg, mesh.rollout_addresses, mesh.trainer_addresses, out)
        )
    finally:
        codes = mesh.stop()
    assert all(code == 0 for code in codes.values()), codes
    assert outcome.steps == STEPS

    t = outcome.tally
    # Every lease was submitted exactly once, and each submission was accepted or rejected
    # with a reason that names the field.
    assert len(t.leased) == len(set(t.leased)) and sorted(t.submitted) == sorted(t.leased)
    accepted = set(t.accepted)
    assert len(accepted) == len(t.accepted)
    assert not accepted & set(t.rejected)
    assert len(t.submitted) == len(accepted) + len(t.rejected)
    assert all(r.startswith(("group.trajectories", "lease_id")) for r in t.rejected.values())
    stale_rejections = sum("first generated token" in r for r in t.rejected.values())
    assert stale_rejections == outcome.rejected_reasons["stale submission"]
    assert outcome.open_leases == 0

    batches = read_jsonl(out / "batches.jsonl")
    assert [b["step"] for b in batches] == list(range(STEPS))
    assert all(len(b["groups"]) == BATCH for b in batches)
    trained = [g for b in batches for g in b["groups"]]
    trained_ids = [g["task_id"] for g in trained]
    assert len(trained_ids) == len(set(trained_ids))  # nothing trained twice
    for b in batches:
        assert all(g["min_version"] >= b["version"] - ETA for g in b["groups"]), b
    external = {g["task_id"] for g in trained if g["producer"].startswith("external:")}
    buffered_external = {tid for tid, prod in outcome.buffered if prod.startswith("external:")}
    # Nothing appears from nowhere, nothing is in two places.
    assert external <= accepted and buffered_external <= accepted
    assert not external & buffered_external
    assert external, "no external group was trained"
    # Nothing lost: an accepted group that was neither trained nor is still buffered can only
    # have been dropped as too stale, which the pool counts.
    dropped_external = accepted - external - buffered_external
    assert len(dropped_external) <= outcome.dropped_stale
    dataset_dropped = outcome.dropped_stale - len(dropped_external)
    assert dataset_dropped <= outcome.requeued  # dataset groups dropped go back to the queue
    # The staleness counters agree: accepted = trained + buffered (drops moved to rejected).
    assert outcome.accepted == len(trained) + len(outcome.buffered)
    assert outcome.running == 0

    traj_s = len(accepted) * GROUP / outcome.elapsed_s
    print(
        f"\nload: {PRODUCERS} producers, {STEPS} steps of B={BATCH} groups (eta {ETA}) in "
        f"{outcome.elapsed_s:.1f} s: {len(t.leased)} leases, {len(accepted)} accepted "
        f"({traj_s:.1f} trajectories/s), {len(t.rejected)} rejected, {t.refused} refused "
        f"acquires; trained {len(external)} external + {len(trained) - len(external)} dataset "
        f"groups; buffered {len(buffered_external)} external; dropped as stale "
        f"{len(dropped_external)} external + {dataset_dropped} dataset"
    )
    print(
        f"load: AcquireRollout granted ms p50 {pct(t.acquire_ms, 0.5):.2f} "
        f"p99 {pct(t.acquire_ms, 0.99):.2f} (n={len(t.acquire_ms)}), refused ms p50 "
        f"{pct(t.refused_ms, 0.5):.2f} p99 {pct(t.refused_ms, 0.99):.2f} "
        f"(n={len(t.refused_ms)}); SubmitTrajectories ms p50 {pct(t.submit_ms, 0.5):.2f} "
        f"p99 {pct(t.submit_ms, 0.99):.2f} (n={len(t.submit_ms)})"
    )
