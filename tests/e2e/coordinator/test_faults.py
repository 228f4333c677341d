"""Failure injection: a trainer rank killed mid-run, a rollout server that stops answering.

The mesh is real (rollout servers and FSDP2 trainer ranks over gloo as subprocesses, started
by the local launcher); the coordinator's loop runs in this process so that the test can act
at an exact step and read the run's state afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from areal_clients.rollout import RolloutClient
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

from areal_grpc.config import RunConfig, TrainerConfig
from areal_grpc.coordinator.dataloader import PromptLoader
from areal_grpc.coordinator.launcher import start_mesh
from areal_grpc.coordinator.loop import Coordinator, RunResult, TrainerGroupFailed
from areal_grpc.coordinator.mesh import Mesh, trainer_argv
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.errors import field_violations
from areal_grpc.launch import start_child, stop_children
from areal_grpc.ports import free_port
from areal_grpc.server import ServerOptions, aio_channel, service, start_server
from areal_grpc.trajectory import make_group
from tests.support.coordinator import ECHO_PROMPTS, small_run, trained_groups


@contextlib.contextmanager
def local_mesh(cfg: RunConfig, tmp_path: Path) -> Iterator[Mesh]:
    mesh = start_mesh(cfg, tmp_path / "logs")
    try:
        yield mesh
    finally:
        for child in mesh.children:
            # A stopped process ignores SIGTERM until continued: never leave one behind.
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.process.pid, signal.SIGCONT)
        mesh.stop()


def trainer_pids(mesh: Mesh) -> list[int]:
    return [c.process.pid for c in mesh.children if c.name.startswith("trainer-")]


async def served_versions(addresses: Sequence[str]) -> list[int]:
    versions = []
    for a in addresses:
        client = RolloutClient(a)
        versions.append((await client.status(timeout_s=10)).policy_version)
        await client.close()
    return versions


def run_to_the_end(
    cfg: RunConfig,
    mesh: Mesh,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    restart_trainers: Callable[[Sequence[str]], Awaitable[list[str]]] | None = None,
) -> tuple[RunResult, list[int]]:
    """A Coordinator over ``mesh``, run to its end: (result, versions the servers serve)."""

    async def scenario() -> tuple[RunResult, list[int]]:
        coord = Coordinator(
            cfg,
            mesh.rollout_addresses,
            mesh.trainer_addresses,
            Path(cfg.output.dir),
            on_step=on_step,
            restart_trainers=restart_trainers,
        )
        try:
            result = await coord.run()
            return result, await served_versions(mesh.rollout_addresses)
        finally:
            await coord.close()

    return asyncio.run(scenario())


# -- a trainer rank dies ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "cause"),
    [
        pytest.param(signal.SIGKILL, "Connection", id="killed"),
        # Frozen, not dead: nothing breaks, only its health check tells.
        pytest.param(signal.SIGSTOP, "health check", id="frozen"),
    ],
)
def test_a_lost_trainer_rank_restarts_the_group_from_the_checkpoint_and_the_run_finishes(
    tmp_path, sig, cause
):
    steps = ECHO_PROMPTS // 2  # batch 2: one epoch exactly
    cfg = small_run(
        tmp_path,
        f"total_steps={steps}",
        "checkpoint.every_steps=3",
        "fault_tolerance.trainer.health_interval_s=1",
        "fault_tolerance.trainer.health_timeout_s=2",
    )
    out = Path(cfg.output.dir)
    with local_mesh(cfg, tmp_path) as mesh:
        first_pids = trainer_pids(mesh)

        def kill_after_step_4(record: dict[str, Any]) -> None:
            # Step 4 is past the checkpoint of step 3: step 4 must be redone.
            if record["step"] == 4 and record["trainer_restarts"] == 0:
                victim = next(c for c in mesh.children if c.name == "trainer-1")
                victim.process.send_signal(sig)

        async def restart(addresses: Sequence[str]) -> list[str]:
            return await asyncio.to_thread(mesh.restart_trainers, cfg)

        result, served = run_to_the_end(cfg, mesh, kill_after_step_4, restart)
        new_pids = trainer_pids(mesh)

    assert result.steps == steps and result.trainer_restarts == 1
    # A whole new group (the survivor's process group was broken too).
    assert len(new_pids) == 2 and not set(new_pids) & set(first_pids)
    records = read_jsonl(out / "metrics.jsonl")
    [recovery] = [r for r in records if r["kind"] == "recovery"]
    assert recovery["step"] == 3 and recovery["failed_at_step"] == 4
    assert cause in recovery["cause"]
    train = [r for r in records if r["kind"] == "train"]
    # Steps after the checkpoint were redone; their first records were replaced.
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert [r["trainer_restarts"] for r in train] == [0] * 3 + [1] * (steps - 3)
    # The restored group went on above every version the rollout server had served (4),
    # which refuses older weights; it serves the run's final version.
    versions = [r["version"] for r in train]
    assert versions[:3] == [1, 2, 3] and recovery["version"] > 4
    assert versions[3:] == list(range(recovery["version"] + 1, recovery["version"] + steps - 2))
    assert served == [result.version] == [versions[-1]]
    # Every prompt of the epoch trained exactly once in the final accounting.
    groups = trained_groups(out)
    assert sorted(g["item_id"] for g in groups) == sorted(
        f"echo-train-{i}" for i in range(ECHO_PROMPTS)
    )
    for b in read_jsonl(out / "batches.jsonl"):
        assert all(g["min_version"] >= b["version"] - 1 for g in b["groups"]), b


@pytest.mark.slow
def test_a_rank_that_dies_while_no_rollout_server_serves_is_found_when_one_rejoins(tmp_path):
    """The only rollout server freezes (out of rotation), a trainer rank dies, the server
    thaws: with no step running, only its rejoin reaches the ranks. Its weight update must
    find the lost rank (and the run recover) instead of waiting in the survivor's collective
    until weight_sync.timeout_s (seen in CI: the run stalled for minutes)."""
    steps = ECHO_PROMPTS // 2
    cfg = small_run(
        tmp_path,
        f"total_steps={steps}",
        "checkpoint.every_steps=3",
        "fault_tolerance.trainer.health_interval_s=1",
        "fault_tolerance.trainer.health_timeout_s=2",
        "fault_tolerance.rollout.health_interval_s=1",
        "fault_tolerance.rollout.health_timeout_s=2",
        "weight_sync.timeout_s=600",
    )
    out = Path(cfg.output.dir)
    fired: list[bool] = []
    with local_mesh(cfg, tmp_path) as mesh:
        rollout = next(c for c in mesh.children if c.name.startswith("rollout-"))
        trainer = next(c for c in mesh.children if c.name == "trainer-1")

        def chaos() -> None:
            rollout.process.send_signal(signal.SIGSTOP)
            time.sleep(5.0)  # its health checks fail: out of rotation, no batch comes
            trainer.process.send_signal(signal.SIGKILL)
            time.sleep(1.0)
            rollout.process.send_signal(signal.SIGCONT)

        def after_step_4(record: dict[str, Any]) -> None:
            if record["step"] == 4 and not fired:
                fired.append(True)
                threading.Thread(target=chaos, daemon=True).start()

        async def restart(addresses: Sequence[str]) -> list[str]:
            return await asyncio.to_thread(mesh.restart_trainers, cfg)

        result, served = run_to_the_end(cfg, mesh, after_step_4, restart)

    assert fired and result.steps == steps and result.trainer_restarts == 1
    [recovery] = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "recovery"]
    assert recovery["failed_at_step"] >= 4
    assert served == [result.version]


@pytest.mark.slow
def test_a_rank_dying_during_the_restart_leads_to_another_restart_not_a_failed_run(tmp_path):
    steps = ECHO_PROMPTS // 2
    cfg = small_run(
        tmp_path,
        f"total_steps={steps}",
        "checkpoint.every_steps=3",
        # The second group never forms (a rank is gone). Not the timeout: a restarted rank
        # that refuses connections fails the group at once (the test's own timeout is 300 s).
        "fault_tolerance.trainer.restart_timeout_s=600",
    )
    out = Path(cfg.output.dir)
    with local_mesh(cfg, tmp_path) as mesh:
        restarts: list[list[int]] = []

        def kill_after_step_4(record: dict[str, Any]) -> None:
            if record["step"] == 4 and record["trainer_restarts"] == 0:
                next(c for c in mesh.children if c.name == "trainer-1").process.kill()

        async def restart(addresses: Sequence[str]) -> list[str]:
            new = await asyncio.to_thread(mesh.restart_trainers, cfg)
            restarts.append(trainer_pids(mesh))
            if len(restarts) == 1:
                # The first new group loses a rank before it is restored: a second failure.
                next(c for c in mesh.children if c.name == "trainer-1").process.kill()
            return new

        result, _ = run_to_the_end(cfg, mesh, kill_after_step_4, restart)

    assert result.steps == steps and result.trainer_restarts == 2
    assert len(restarts) == 2 and not set(restarts[0]) & set(restarts[1])
    records = read_jsonl(out / "metrics.jsonl")
    [recovery] = [r for r in records if r["kind"] == "recovery"]
    assert recovery["restarts"] == 2 and recovery["failed_at_step"] == 4
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    groups = trained_groups(out)
    assert sorted(g["item_id"] for g in groups) == sorted(
        f"echo-train-{i}" for i in range(ECHO_PROMPTS)
    )


@pytest.mark.slow
def test_a_trainer_failure_before_any_checkpoint_fails_the_run_clearly(tmp_path):
    cfg = small_run(tmp_path, "total_steps=6", "checkpoint.every_steps=0")
    with local_mesh(cfg, tmp_path) as mesh:

        def kill(record: dict[str, Any]) -> None:
            if record["step"] == 1:
                next(c for c in mesh.children if c.name == "trainer-0").process.kill()

        async def restart(addresses: Sequence[str]) -> list[str]:
            raise AssertionError("nothing to restore: the group must not be restarted")

        with pytest.raises(TrainerGroupFailed, match="before the first checkpoint"):
            run_to_the_end(cfg, mesh, kill, restart)


@pytest.mark.slow
def test_under_attach_mode_the_run_waits_for_the_group_its_supervisor_restarts(tmp_path):
    steps = 12
    cfg = small_run(tmp_path, f"total_steps={steps}", "checkpoint.every_steps=3")
    out = Path(cfg.output.dir)
    with local_mesh(cfg, tmp_path) as mesh:
        old = sorted(
            (c for c in mesh.children if c.name.startswith("trainer-")), key=lambda c: c.name
        )
        supervisor: list[threading.Thread] = []

        def restart_like_torchrun() -> None:
            # What an external supervisor does when a rank dies: the whole group goes and
            # comes back on the same addresses, rendezvousing afresh.
            old[1].process.wait()
            stop_children([old[0]], grace_s=5.0)
            port = free_port()
            for rank, child in enumerate(old):
                argv = trainer_argv(cfg, rank, port)
                argv[argv.index("--port") + 1] = child.address.rsplit(":", 1)[1]
                new = start_child(child.name, argv, log_dir=tmp_path / "logs")
                mesh.children[mesh.children.index(child)] = new

        def kill_after_step_4(record: dict[str, Any]) -> None:
            if record["step"] == 4 and not supervisor:
                old[1].process.kill()
                supervisor.append(threading.Thread(target=restart_like_torchrun))
                supervisor[0].start()

        try:
            # No restart hook: the coordinator waits for the ranks at the same addresses.
            result, served = run_to_the_end(cfg, mesh, kill_after_step_4)
        finally:
            for t in supervisor:
                t.join()

    assert result.steps == steps and result.trainer_restarts == 1
    assert served == [result.version]
    [recovery] = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "recovery"]
    assert recovery["step"] == 3 and recovery["trainer_addresses"] == [c.address for c in old]
    seqs = [g["seq"] for g in trained_groups(out)]
    assert len(seqs) == len(set(seqs)) == steps * 2


# -- a rollout server stalls -----------------------------------------------------------------


async def wait_until(
    predicate: Callable[[], object],
    what: str,
    run: asyncio.Task[Any] | None = None,
    timeout_s: float = 120.0,
    poll_s: float = 0.1,
) -> None:
    """Polls ``predicate``; fails on ``timeout_s``, or at once when ``run`` has ended."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if run is not None and run.done():
            outcome = run.exception() or f"{run.result().steps} steps done"
            raise AssertionError(f"the run ended before {what}: {outcome!r}")
        assert asyncio.get_running_loop().time() < deadline, f"not reached: {what}"
        await asyncio.sleep(poll_s)


@pytest.mark.slow
@pytest.mark.parametrize(
    "detection",
    [
        pytest.param(
            [
                "fault_tolerance.rollout.health_interval_s=0.5",
                "fault_tolerance.rollout.health_timeout_s=1",
            ],
            id="health",
        ),
        # No health checks: the episode deadline alone must notice.
        pytest.param(
            [
                "fault_tolerance.rollout.health_interval_s=0",
                "fault_tolerance.rollout.episode_timeout_s=5",
            ],
            id="deadline",
        ),
    ],
)
def test_a_stalled_rollout_server_loses_its_work_to_the_other_and_rejoins(tmp_path, detection):
    steps = ECHO_PROMPTS  # batch 2: two epochs
    cfg = small_run(
        tmp_path,
        f"total_steps={steps}",
        "rollout.num_servers=2",
        # Synchronous: while the frozen server holds a prompt of the batch, the step cannot
        # finish, so nothing but the watchdog can take its work away.
        "staleness.max_staleness=0",
        "checkpoint.every_steps=0",
        "weight_sync.timeout_s=20",
        *detection,
    )
    out = Path(cfg.output.dir)
    with local_mesh(cfg, tmp_path) as mesh:
        frozen = next(c for c in mesh.children if c.name == "rollout-1")
        live = next(c for c in mesh.children if c.name == "rollout-0")

        async def scenario() -> tuple[Any, dict[str, Any], list[int]]:
            coord = Coordinator(cfg, mesh.rollout_addresses, mesh.trainer_addresses, out)
            seen: dict[str, Any] = {}
            run = asyncio.create_task(coord.run())
            try:

                def in_rotation(address: str) -> bool:
                    report = coord.rollout_report(address)
                    return report is not None and report.state == "serving"

                def step() -> int:
                    return coord.pool.global_step

                await wait_until(
                    lambda: step() >= 2 and coord.pool.running_on(frozen.address),
                    "a task on the server to freeze",
                    run,
                    # A task stays on a server for a few ms. Polled every 0.1 s, the first one
                    # seen could come late in the run, which then ended before the server was
                    # back (seen in CI).
                    poll_s=0.001,
                )
                # No await in between: the tasks it holds now are the ones frozen with it.
                seen["frozen_tasks"] = coord.pool.running_on(frozen.address)
                os.kill(frozen.process.pid, signal.SIGSTOP)
                await wait_until(lambda: not in_rotation(frozen.address), "frozen server out", run)
                seen["out_at"] = step()
                # Nothing of ours is left waiting on the frozen server...
                seen["running_on_frozen"] = coord.pool.running_on(frozen.address)
                # ...and training goes on with the other server alone.
                await wait_until(lambda: step() >= seen["out_at"] + 3, "progress without it", run)
                seen["live_in_rotation"] = in_rotation(live.address)
                os.kill(frozen.process.pid, signal.SIGCONT)
                await wait_until(lambda: in_rotation(frozen.address), "frozen server back", run)
                seen["back_at"] = step()
                result = await run
                return result, seen, await served_versions(mesh.rollout_addresses)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(frozen.process.pid, signal.SIGCONT)
                if not run.done():
                    run.cancel()
                with contextlib.suppress(BaseException):
                    await run
                await coord.close()

        result, seen, served = asyncio.run(scenario())

    assert result.steps == steps
    assert seen["running_on_frozen"] == [] and seen["live_in_rotation"]
    assert seen["back_at"] < steps
    # Brought level when it came back: both servers serve the final version.
    assert served == [result.version, result.version] == [steps, steps]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    groups = trained_groups(out)
    # The prompts it held were trained (elsewhere), once.
    task_ids = [g["task_id"] for g in groups]
    assert len(task_ids) == len(set(task_ids))
    assert set(seen["frozen_tasks"]) <= set(task_ids)
    # Nothing lost or duplicated: both epochs, every prompt exactly once in each.
    for epoch in (0, 1):
        items = sorted(g["item_id"] for g in groups if g["epoch"] == epoch)
        assert items == sorted(f"echo-train-{i}" for i in range(ECHO_PROMPTS)), epoch
    for b in read_jsonl(out / "batches.jsonl"):
        assert all(g["min_version"] == b["version"] for g in b["groups"]), b


# -- the pool's side of it (no mesh) ---------------------------------------------------------


def _group(task_id: str, version: int = 0) -> common_pb2.TrajectoryGroup:
    return make_group(task_id, [1.0], versions=version)


def _pool() -> WorkPool:
    items = [{"prompt": f"{c}=", "answer": c, "id": c} for c in "abcdef"]
    return WorkPool(2, 1, 8, PromptLoader(items, shuffle=False, seed=0), vocab_size=384)


def test_a_late_result_from_a_server_the_task_was_taken_from_is_not_counted():
    pool = _pool()
    work = pool.claim("stalled:1")
    assert work is not None
    assert pool.requeue(work.task_id, "stalled:1")
    again = pool.claim("live:2")
    assert again is not None and again.task_id == work.task_id
    # The stalled server wakes up and reports: ignored, the live server's claim stands.
    assert not pool.finish(work.task_id, _group(work.task_id), "stalled:1")
    assert not pool.requeue(work.task_id, "stalled:1")
    assert not pool.reject(work.task_id, "late", "stalled:1")
    assert pool.running_on("live:2") == [work.task_id]
    assert pool.finish(work.task_id, _group(work.task_id), "live:2")
    assert [f.work.task_id for f in pool.buffer] == [work.task_id]
    st = pool.staleness.stats()
    assert (st.running, st.accepted) == (0, 1)


def test_reset_to_a_checkpoint_mid_run_forgets_later_work_and_keeps_the_capacity():
    pool = _pool()
    for _ in range(3):
        w = pool.claim("s")
        assert w is not None
        pool.finish(w.task_id, _group(w.task_id))
    state = json.loads(json.dumps(pool.state_dict()))
    capacity = pool.capacity()
    # Work after the checkpoint: a batch trained, more claimed and leased.
    assert pool.take_batch(2, 0) is not None
    pool.set_version(1)
    pool.claim("s")
    pool.acquire("agent", 2)
    pool.reset_to(state, version=5)
    assert pool.version == 5 and not pool.running and not pool.leases
    assert [f.work.task_id for f in pool.buffer] == ["p0", "p1", "p2"]
    # The jump from version 0 to 5 does not hand out five extra batches of capacity.
    assert pool.capacity() == capacity
    # The restored loader hands out the prompt after the checkpoint's again.
    w = pool.claim("s")
    assert w is not None and w.task_id == "p3"


def test_load_checkpoint_continues_from_min_policy_version_and_names_a_bad_one(tmp_path):
    async def scenario() -> None:
        servicer = TrainerService(
            TrainerServiceConfig(
                trainer=TrainerConfig(fsdp=False, device="cpu"),
                distributed=False,
                path_roots=(str(tmp_path),),
            )
        )
        running = await start_server(
            [service(servicer, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)],
            ServerOptions(host="127.0.0.1", port=0),
        )
        channel = aio_channel(running.address)
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        try:
            path = str(tmp_path / "ck")
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=path), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LoadCheckpoint(
                    trainer_pb2.LoadCheckpointRequest(path=path, min_policy_version=-1), timeout=60
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [f for f, _ in field_violations(err.value)] == ["min_policy_version"]
            # The checkpoint's weights under a version the rollout servers have not served.
            raised = await stub.LoadCheckpoint(
                trainer_pb2.LoadCheckpointRequest(path=path, min_policy_version=7), timeout=60
            )
            status = await stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)
            assert raised.policy_version == status.policy_version == 7
            assert status.ready and not status.broken_reason
            # 0 (unset) keeps the checkpoint's own version.
            kept = await stub.LoadCheckpoint(
                trainer_pb2.LoadCheckpointRequest(path=path), timeout=60
            )
            assert kept.policy_version == 0
        finally:
            await channel.close()
            await running.stop(0)
            servicer.close()

    asyncio.run(scenario())
