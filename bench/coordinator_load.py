"""CoordinatorService under load: trajectories/s and AcquireRollout latency, 16 producers.

Measured: the real ``CoordinatorServicer`` over a ``WorkPool`` served by a real gRPC server
(``areal_grpc.server.start_server``, loopback, plaintext) in this process, with 16 concurrent
external producers in a separate process (``--producer-procs`` processes, each running its
share of the producers as asyncio tasks, every producer with its own channel). Each producer
loops: ``AcquireRollout`` -> build a valid ``TrajectoryGroup`` of ``--group-size``
trajectories (prompt 8 tokens + 24 generated tokens, per-token versions = the lease's version;
no generation) -> ``SubmitTrajectories`` (one group per call). A refused acquire
(RESOURCE_EXHAUSTED) is counted and retried after 2 ms (not the server's RetryInfo delay,
which would measure the back-off, not the coordinator).

A drainer in the server's process plays the trainer: whenever ``B`` groups are buffered it
takes them (``WorkPool.take_batch``, oldest first, staleness-checked) and bumps the policy
version (``set_version``), which frees the next batch of staleness capacity. So the run goes
through the real admission rule (B = ``--batch-size``, eta = ``--max-staleness``, concurrency
limit ``--max-concurrent``).

Baseline (same run): the same producer loop calling the pool in-process (``pool.acquire`` ->
``pool.submit``, no gRPC, no serialisation), 16 asyncio tasks plus the same drainer.

Proof nothing was lost (both modes): submitted == accepted, every acquired lease id is drained
exactly once (leases acquired == drained + buffered-at-end drained in a final sweep), no
lease expired, no group rejected or dropped as stale.

Latencies are client-side (call start to reply, in the producer process). The loop is closed:
16 producers keep the single Python server saturated, so p50/p99 are mostly queueing behind
the other producers' calls (about producers x 2 calls / server calls per second), not the
cost of one call on an idle server.

Targets. ``coordinator_load``: ratio >= 0.5 (issue 6). ``acquire_p99``: the ratio is gRPC p99 /
in-process p99 and lower is better; target 1000, i.e. with the in-process p99 of ~0.05 ms a
gRPC p99 of about 50 ms at full saturation. Reasoning: a producer takes one lease per group,
and a group's generation takes at least a decode of G samples (tens of ms for the built-in
micro model, seconds for a real LLM), so a lease wait under ~50 ms even at saturation keeps
leasing a small part of a producer's cycle; an in-process call is a dict insert, so a target
near 1 would only measure Python gRPC's fixed per-call cost.

With ``--training-steps N`` (and e.g. ``--producers 32``) a third case runs the real training
loop: a real mesh (one builtin:micro rollout server, two FSDP2 trainer ranks over gloo, the
stream weight sync after every step) and the coordinator's loop with its CoordinatorService in
this process, as ``python -m areal_grpc.coordinator`` runs them. Baseline: N steps fed by the
loop's own dataset rollouts only; measured: N steps (on a fresh mesh) with the producers (in
their own process, synthetic groups as above, but retrying a refused acquire after the
server's RetryInfo delay as a well-behaved producer does) submitting alongside. Value: trajectories
trained per second of loop wall time. Target 0.9: both runs are bound by the training step and
the weight sync, so serving the producers must not slow the loop by more than 10%. Nothing
lost: every accepted external group trained exactly once, still buffered, or dropped as stale
(within the pool's ``dropped_stale`` count); no lease left open.

    .venv/bin/python bench/coordinator_load.py [--duration-s 15] [--producers 16]
    .venv/bin/python bench/coordinator_load.py --producers 32 --batch-size 16 \
        --max-staleness 1 --max-concurrent 32 --group-size 2 --training-steps 6
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing as mp
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from areal_clients.coordinator import CoordinatorClient
from arealgrpc.v1 import common_pb2, coordinator_pb2
from results import result
from teardown import exit_on_sigterm

from areal_grpc.config import load_config
from areal_grpc.coordinator.launcher import start_mesh
from areal_grpc.coordinator.loop import Coordinator
from areal_grpc.coordinator.mesh import Mesh
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.pool import NoCapacity, WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.errors import retry_delay_s
from areal_grpc.server import ServerOptions, start_server

VOCAB = 384
PROMPT_TOKENS = 8
GEN_TOKENS = 24
RETRY_S = 0.002


def make_group(lease_id: str, version: int, group_size: int, k: int) -> common_pb2.TrajectoryGroup:
    """A valid group: ``group_size`` trajectories, prompt + generated tokens at ``version``."""
    group = common_pb2.TrajectoryGroup(task_id=lease_id, group_id=lease_id)
    n = PROMPT_TOKENS + GEN_TOKENS
    for j in range(group_size):
        group.trajectories.add(
            token_ids=[(k * 7 + j * 13 + i) % VOCAB for i in range(n)],
            logprobs=[0.0] * PROMPT_TOKENS + [-1.0] * GEN_TOKENS,
            versions=[-1] * PROMPT_TOKENS + [version] * GEN_TOKENS,
            loss_mask=[False] * PROMPT_TOKENS + [True] * GEN_TOKENS,
            reward=float(j % 2),
            prompt_length=PROMPT_TOKENS,
            task_id=lease_id,
        )
    return group


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``xs``, in the same unit; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def make_pool(args: argparse.Namespace) -> WorkPool:
    return WorkPool(
        args.batch_size,
        args.max_staleness,
        args.max_concurrent,
        lease_ttl_s=120.0,
        vocab_size=VOCAB,
    )


async def drain(pool: WorkPool, batch_size: int, stop: asyncio.Event, out: list[str]) -> None:
    """Takes every full batch and bumps the version (the trainer's part of the loop)."""
    while not stop.is_set():
        batch = pool.take_batch(batch_size, pool.version)
        if batch is None:
            await pool.wait_change(0.05)
            continue
        out.extend(f.work.task_id for f in batch)
        pool.global_step += 1
        pool.set_version(pool.version + 1)


def final_sweep(pool: WorkPool, out: list[str]) -> None:
    """After the producers stopped: drains what is buffered (a last, partial batch)."""
    rest = pool.take_batch(len(pool.buffer), pool.version) if pool.buffer else None
    out.extend(f.work.task_id for f in rest or [])


def check(pool: WorkPool, acquired: list[str], submitted: int, drained: list[str]) -> str:
    counts = Counter(drained)
    st = pool.staleness.stats()
    ok = (
        submitted == st.accepted
        and len(acquired) == len(set(acquired)) == submitted
        and set(counts) == set(acquired)
        and all(c == 1 for c in counts.values())
        and st.rejected == 0
        and pool.stats.dropped_stale == 0
        and not pool.leases
        and not pool.buffer
    )
    return (
        f"leases {len(acquired)} submitted {submitted} accepted {st.accepted} "
        f"drained {len(drained)} (distinct {len(counts)}, max per id "
        f"{max(counts.values(), default=0)}) rejected {st.rejected} "
        f"dropped_stale {pool.stats.dropped_stale} -> {'NOTHING LOST' if ok else 'MISMATCH'}"
    )


# -- in-process baseline -------------------------------------------------------------------


async def run_in_process(args: argparse.Namespace) -> dict[str, Any]:
    pool = make_pool(args)
    stop = asyncio.Event()
    drained: list[str] = []
    acquired: list[str] = []
    acq_ms: list[float] = []
    sub_ms: list[float] = []
    refused = 0
    submitted = 0

    async def producer(p: int) -> None:
        nonlocal refused, submitted
        k = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                lease = pool.acquire(f"producer-{p}", args.group_size)
            except NoCapacity:
                acq_ms.append((time.perf_counter() - t0) * 1e3)
                refused += 1
                await asyncio.sleep(RETRY_S)
                continue
            acq_ms.append((time.perf_counter() - t0) * 1e3)
            lid = lease.work.task_id
            acquired.append(lid)
            group = make_group(lid, lease.version, args.group_size, k)
            k += 1
            t1 = time.perf_counter()
            reason = pool.submit(lid, group, "requests[0]")
            sub_ms.append((time.perf_counter() - t1) * 1e3)
            if reason is None:
                submitted += 1
            # The gRPC producer yields at each await: give the other producers a turn too.
            await asyncio.sleep(0)

    drainer = asyncio.create_task(drain(pool, args.batch_size, stop, drained))
    tasks = [asyncio.create_task(producer(p)) for p in range(args.producers)]
    started = time.perf_counter()
    await asyncio.sleep(args.duration_s)
    stop.set()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    await drainer
    final_sweep(pool, drained)
    return {
        "elapsed": elapsed,
        "submitted": submitted,
        "refused": refused,
        "acq_ms": acq_ms,
        "sub_ms": sub_ms,
        "check": check(pool, acquired, submitted, drained),
        "version": pool.version,
    }


# -- over gRPC -----------------------------------------------------------------------------


def producer_process(
    address: str,
    ids: list[int],
    group_size: int,
    duration_s: float,
    conn: Any,
    stop: Any = None,
    ready: Any = None,
    go: Any = None,
    server_retry: bool = False,
) -> None:
    """Runs producers ``ids`` against ``address`` for ``duration_s`` (or until the
    multiprocessing event ``stop`` is set); sends back records. With ``ready``/``go`` events,
    it sets ``ready`` once started (imports take seconds) and begins when ``go`` is set. A
    refused acquire is retried after ``RETRY_S``, or with ``server_retry`` after the server's
    RetryInfo delay (what a well-behaved producer does)."""

    async def main() -> dict[str, Any]:
        acquired: list[str] = []
        rejected: list[str] = []
        acq_ms: list[float] = []
        sub_ms: list[float] = []
        refused = 0
        submitted = 0
        errors: Counter[str] = Counter()
        if ready is not None and go is not None:
            ready.set()
            await asyncio.to_thread(go.wait)
        deadline = time.perf_counter() + duration_s

        async def producer(p: int) -> None:
            nonlocal refused, submitted
            client = CoordinatorClient(address)
            k = 0
            try:
                while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
                    t0 = time.perf_counter()
                    try:
                        lease = await client.acquire(f"producer-{p}", group_size)
                    except grpc.aio.AioRpcError as exc:
                        acq_ms.append((time.perf_counter() - t0) * 1e3)
                        delay = RETRY_S
                        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            refused += 1
                            if server_retry:
                                delay = retry_delay_s(exc)
                                delay = RETRY_S if delay is None else delay
                        else:
                            errors[exc.code().name] += 1
                        await asyncio.sleep(delay)
                        continue
                    acq_ms.append((time.perf_counter() - t0) * 1e3)
                    acquired.append(lease.lease_id)
                    group = make_group(lease.lease_id, lease.policy_version, group_size, k)
                    k += 1
                    t1 = time.perf_counter()
                    reply = await client.submit([(lease.lease_id, group)])
                    sub_ms.append((time.perf_counter() - t1) * 1e3)
                    submitted += reply.accepted_groups
                    for r in reply.rejections:
                        errors[f"rejected: {r.reason[:40]}"] += 1
                        rejected.append(r.lease_id)
            finally:
                await client.close()

        started = time.perf_counter()
        await asyncio.gather(*(producer(p) for p in ids))
        return {
            "elapsed": time.perf_counter() - started,
            "acquired": acquired,
            "rejected": rejected,
            "acq_ms": acq_ms,
            "sub_ms": sub_ms,
            "refused": refused,
            "submitted": submitted,
            "errors": dict(errors),
        }

    conn.send(asyncio.run(main()))
    conn.close()


async def run_grpc(args: argparse.Namespace) -> dict[str, Any]:
    pool = make_pool(args)
    servicer = CoordinatorServicer(pool)
    server = await start_server(
        [servicer.as_service()],
        ServerOptions(host="127.0.0.1", port=0),
    )
    servicer.start()
    stop = asyncio.Event()
    drained: list[str] = []
    drainer = asyncio.create_task(drain(pool, args.batch_size, stop, drained))
    ctx = mp.get_context("spawn")
    procs = []
    pipes = []
    try:
        n = args.producer_procs
        for i in range(n):
            recv, send = ctx.Pipe(duplex=False)
            ids = list(range(i, args.producers, n))
            proc = ctx.Process(
                target=producer_process,
                args=(server.address, ids, args.group_size, args.duration_s, send),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            pipes.append(recv)
        results = [await asyncio.to_thread(r.recv) for r in pipes]
        for proc in procs:
            await asyncio.to_thread(proc.join, 10.0)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        stop.set()
        await drainer
        await servicer.stop()
        await server.stop(0)
    final_sweep(pool, drained)
    acquired = [lid for r in results for lid in r["acquired"]]
    submitted = sum(r["submitted"] for r in results)
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    return {
        "elapsed": max(r["elapsed"] for r in results),
        "submitted": submitted,
        "refused": sum(r["refused"] for r in results),
        "acq_ms": [x for r in results for x in r["acq_ms"]],
        "sub_ms": [x for r in results for x in r["sub_ms"]],
        "check": check(pool, acquired, submitted, drained)
        + (f"; errors {dict(errors)}" if errors else ""),
        "version": pool.version,
    }


# -- with the training loop ----------------------------------------------------------------


def start_training_mesh(args: argparse.Namespace, out: Path) -> tuple[Any, Mesh]:
    """The run's config and a real mesh: one builtin:micro rollout server, two FSDP2 ranks."""
    cfg = load_config(
        None,
        [
            f"output.dir={out}",
            "data.task=echo",
            f"total_steps={args.training_steps}",
            f"staleness.batch_size={args.batch_size}",
            f"staleness.group_size={args.group_size}",
            f"staleness.max_staleness={args.max_staleness}",
            f"rollout.max_concurrent_rollouts={args.max_concurrent}",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            "checkpoint.export_hf=false",
            "weight_sync.methods=[stream]",
            "output.plot=false",
            "output.tensorboard=false",
            "output.progress_bar=false",
        ],
    )
    return cfg, start_mesh(cfg, out / "logs")


async def run_training(
    args: argparse.Namespace, cfg: Any, mesh: Mesh, out: Path, producers: int
) -> dict[str, Any]:
    """``args.training_steps`` steps of the real loop (in this process, with its
    CoordinatorService) fed by its own rollouts plus ``producers`` external producers in a
    separate process; trained trajectories/s over the loop's wall time."""
    cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(out)))
    coordinator = Coordinator(cfg, mesh.rollout_addresses, mesh.trainer_addresses, out)
    servicer = CoordinatorServicer(coordinator.pool)
    for i, a in enumerate(mesh.rollout_addresses):
        servicer.add_local_worker(coordinator_pb2.WORKER_ROLE_ROLLOUT, a, f"rollout-{i}")
    server = await start_server(
        [servicer.as_service()],
        ServerOptions(host="127.0.0.1", port=0),
    )
    servicer.start()
    ctx = mp.get_context("spawn")
    stop, go = ctx.Event(), ctx.Event()
    procs = []
    pipes = []
    readies = []
    results: list[dict[str, Any]] = []
    try:
        n = args.producer_procs if producers else 0
        for i in range(n):
            recv, send = ctx.Pipe(duplex=False)
            ids = list(range(i, producers, n))
            ready = ctx.Event()
            proc = ctx.Process(
                target=producer_process,
                args=(server.address, ids, args.group_size, 3600.0, send, stop, ready, go, True),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            pipes.append(recv)
            readies.append(ready)
        # The producers start with the loop, not seconds later (their process imports first).
        for ready in readies:
            assert await asyncio.to_thread(ready.wait, 120.0), "a producer process did not start"
        go.set()
        started = time.perf_counter()
        result = await coordinator.run()
        elapsed = time.perf_counter() - started
        stop.set()
        results = [await asyncio.to_thread(r.recv) for r in pipes]
        for proc in procs:
            await asyncio.to_thread(proc.join, 10.0)
    finally:
        stop.set()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        await servicer.stop()
        await server.stop(0)
        await coordinator.close()
    pool = coordinator.pool
    trained = [g for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    external = Counter(g["task_id"] for g in trained if g["producer"].startswith("external:"))
    buffered = {f.work.task_id for f in pool.buffer}
    accepted = {lid for r in results for lid in r["acquired"]} - {
        lid for r in results for lid in r["rejected"]
    }
    submitted = sum(r["submitted"] for r in results)
    lost = accepted - set(external) - buffered
    ok = (
        result.steps == args.training_steps
        and all(c == 1 for c in external.values())
        and set(external) <= accepted
        and len(lost) <= pool.stats.dropped_stale
        and not pool.leases
    )
    return {
        "elapsed": elapsed,
        "trained_traj": len(trained) * args.group_size,
        "external_groups": len(external),
        "submitted": submitted,
        "refused": sum(r["refused"] for r in results),
        "acq_ms": [x for r in results for x in r["acq_ms"]],
        "sub_ms": [x for r in results for x in r["sub_ms"]],
        "check": (
            f"{result.steps} steps, {len(trained)} groups trained ({len(external)} external, "
            f"each once), external accepted {submitted}, buffered {len(buffered & accepted)}, "
            f"dropped as stale {len(lost)} (pool dropped_stale {pool.stats.dropped_stale}) -> "
            f"{'NOTHING LOST' if ok else 'MISMATCH'}"
        ),
    }


def report_training(name: str, r: dict[str, Any]) -> float:
    traj_s = r["trained_traj"] / r["elapsed"]
    print(
        f"{name}: {r['trained_traj']} trajectories trained in {r['elapsed']:.1f} s = "
        f"{traj_s:.1f} traj/s; {r['refused']} refused acquires"
    )
    if r["acq_ms"]:
        print(
            f"  AcquireRollout ms p50 {pct(r['acq_ms'], 0.5):.3f} "
            f"p99 {pct(r['acq_ms'], 0.99):.3f} (n={len(r['acq_ms'])}); SubmitTrajectories ms "
            f"p50 {pct(r['sub_ms'], 0.5):.3f} p99 {pct(r['sub_ms'], 0.99):.3f} "
            f"(n={len(r['sub_ms'])})"
        )
    print(f"  {r['check']}")
    return traj_s


def report(name: str, r: dict[str, Any], group_size: int) -> float:
    traj_s = r["submitted"] * group_size / r["elapsed"]
    print(
        f"{name}: {r['submitted']} groups ({r['submitted'] * group_size} trajectories) in "
        f"{r['elapsed']:.1f} s = {traj_s:.0f} traj/s, {r['version']} versions, "
        f"{r['refused']} refused acquires"
    )
    print(
        f"  AcquireRollout ms p50 {pct(r['acq_ms'], 0.5):.3f} p99 {pct(r['acq_ms'], 0.99):.3f} "
        f"max {max(r['acq_ms'], default=float('nan')):.3f} (n={len(r['acq_ms'])}); "
        f"SubmitTrajectories ms p50 {pct(r['sub_ms'], 0.5):.3f} "
        f"p99 {pct(r['sub_ms'], 0.99):.3f} (n={len(r['sub_ms'])})"
    )
    print(f"  {r['check']}")
    return traj_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=16)
    parser.add_argument("--producer-procs", type=int, default=1, help="processes for producers")
    parser.add_argument("--duration-s", type=float, default=15.0, help="per mode")
    parser.add_argument("--batch-size", type=int, default=32, help="B: groups per version")
    parser.add_argument("--max-staleness", type=int, default=2, help="eta")
    parser.add_argument("--max-concurrent", type=int, default=64, help="concurrency limit C")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group")
    parser.add_argument(
        "--training-steps",
        type=int,
        default=0,
        help="also run the real training loop this many steps fed by the producers (0: off)",
    )
    args = parser.parse_args()
    if args.training_steps > 0:
        signal.signal(signal.SIGTERM, exit_on_sigterm)
    print(
        f"{args.producers} producers, B={args.batch_size} eta={args.max_staleness} "
        f"C={args.max_concurrent} G={args.group_size}, {args.duration_s:.0f} s per mode"
    )
    base = asyncio.run(run_in_process(args))
    base_traj = report("in-process", base, args.group_size)
    meas = asyncio.run(run_grpc(args))
    meas_traj = report("gRPC", meas, args.group_size)
    base_p99 = pct(base["acq_ms"], 0.99)
    meas_p99 = pct(meas["acq_ms"], 0.99)
    result("coordinator_load", meas_traj, "traj/s", base_traj, "0.5")
    result("acquire_p99", meas_p99, "ms", base_p99, "1000")
    if args.training_steps > 0:
        measured: dict[int, float] = {}
        with tempfile.TemporaryDirectory(prefix="coordinator-load-") as tmp:
            # A fresh mesh per case: both start at version 0 (a new run attached to trainers
            # already at version V would be admitted (eta + V + 1) * B prompts at once).
            for producers, name in [
                (0, "loop, own rollouts only"),
                (args.producers, f"loop + {args.producers} external producers"),
            ]:
                out = Path(tmp) / f"producers-{producers}"
                cfg, mesh = start_training_mesh(args, out)
                try:
                    r = asyncio.run(run_training(args, cfg, mesh, out / "run", producers))
                finally:
                    mesh.stop()
                measured[producers] = report_training(name, r)
        own_traj, ext_traj = measured[0], measured[args.producers]
        result("coordinator_load_training", ext_traj, "traj/s", own_traj, "0.9")


if __name__ == "__main__":
    main()
