"""The Node agent (clients/node-agent, on the generated TypeScript stubs) against our servers.

Everything is real and on loopback: a rollout server process (builtin:micro), a
CoordinatorService (in-process over a WorkPool, the ``areal-coordinator`` entry point, or the
full training loop), and the agent run with ``node`` exactly as a user runs it. The agent
takes leases, generates at the lease's rollout server, scores its samples itself and submits
typed TrajectoryGroups; these tests check that the coordinator took them as sent.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from arealgrpc.v1 import coordinator_pb2, coordinator_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from areal_grpc import tracing
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import RETRY_AFTER_S, CoordinatorServicer
from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from areal_grpc.server import BackgroundServer, ServerOptions, sync_channel
from tests.support.paths import ROOT

NODE = shutil.which("node")
AGENT = ROOT / "clients/node-agent/dist/clients/node-agent/src/main.js"
VOCAB = 384  # builtin:micro's byte vocabulary
EOS = 1

pytestmark = pytest.mark.skipif(
    NODE is None, reason="node is not on PATH: the Node agent needs Node.js 20+"
)


def byte_ids(text: str) -> list[int]:
    """The built-in byte tokenizer: UTF-8 bytes + 3."""
    return [b + 3 for b in text.encode()]


@pytest.fixture(scope="module")
def _build(node_modules: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Compiles the agent with the pinned TypeScript in the background, so the rollout
    server starts meanwhile."""
    proc = subprocess.Popen(["npm", "run", "--silent", "build"], cwd=ROOT)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def agent(_build: subprocess.Popen[bytes]) -> Path:
    """The compiled agent's entry point."""
    assert _build.wait(timeout=180) == 0, "npm run build (tsc) failed"
    assert AGENT.is_file()
    return AGENT


@pytest.fixture(scope="module")
def rollout(
    _build: subprocess.Popen[bytes], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Child]:
    """A real rollout server serving builtin:micro at version 0."""
    argv = python_module_argv("areal_servers.rollout", "--port", "0", "model.source=builtin:micro")
    child = start_child("rollout", argv, log_dir=tmp_path_factory.mktemp("rollout-logs"))
    yield child
    stop_children([child])


def run_agent(agent: Path, coordinator: str, *args: str, timeout: float = 60) -> tuple:
    """Runs the agent to completion: (exit code, JSON lines of stdout, stderr)."""
    proc = subprocess.run(
        [NODE, str(agent), "--coordinator", coordinator, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines, proc.stderr


def coordinator_stub(
    address: str,
) -> tuple[grpc.Channel, coordinator_pb2_grpc.CoordinatorServiceStub]:
    channel = sync_channel(address)
    return channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel)


def register_rollout(stub: coordinator_pb2_grpc.CoordinatorServiceStub, address: str) -> None:
    stub.RegisterWorker(
        coordinator_pb2.RegisterWorkerRequest(
            role=coordinator_pb2.WORKER_ROLE_ROLLOUT, address=address, worker_id="rollout-0"
        ),
        timeout=10,
    )


def test_agent_groups_reach_the_coordinator_buffer_as_typed_trajectories(rollout, agent):
    episodes, group_size = 3, 4
    # The in-process coordinator traces (in memory), so each lease has a trace context that
    # the agent must hand on.
    spans = InMemorySpanExporter()
    tracing.init_tracing("areal-test", SimpleSpanProcessor(spans))
    pool = WorkPool(8, 0, vocab_size=VOCAB)
    servicer = CoordinatorServicer(pool)
    bg = BackgroundServer(
        [servicer.as_service()],
        ServerOptions(host="127.0.0.1", port=0),
    )
    running = bg.start()

    async def start_sweeper() -> None:
        servicer.start()

    async def snapshot() -> list:
        await servicer.stop()
        return [(f.work.task_id, f.work.producer, f.group) for f in pool.buffer]

    try:
        bg.call(start_sweeper())
        channel, stub = coordinator_stub(running.address)
        with channel:
            register_rollout(stub, rollout.address)
            code, lines, stderr = run_agent(
                agent,
                running.address,
                f"--episodes={episodes}",
                f"--group-size={group_size}",
                "--producer-id=node-test",
            )
            assert code == 0, stderr
            status = stub.GetCoordinatorStatus(coordinator_pb2.GetCoordinatorStatusRequest())
        buffered = bg.call(snapshot())
    finally:
        bg.stop()
        tracing.shutdown_tracing()

    # One JSON line per episode, each the coordinator's reply: the group was accepted.
    assert len(lines) == episodes
    assert all(line["response"] == {"acceptedGroups": 1} for line in lines), lines
    assert all(line["rollout_address"] == rollout.address for line in lines)
    lease_ids = [line["lease_id"] for line in lines]
    assert len(set(lease_ids)) == episodes
    assert status.accepted == episodes and status.running == 0 and status.rejected == 0

    # The buffer holds exactly the agent's groups, under its leases, in submission order.
    assert [task_id for task_id, _, _ in buffered] == lease_ids
    assert all(producer == "external:node-test" for _, producer, _ in buffered)
    for line, (lease_id, _, group) in zip(lines, buffered, strict=True):
        prompt = byte_ids(line["prompt"])
        assert line["prompt"].endswith("=") and line["answer"] == line["prompt"][0]
        assert group.task_id == lease_id and group.group_id
        assert len(group.trajectories) == group_size
        rewards = []
        for traj in group.trajectories:
            p = traj.prompt_length
            n = len(traj.token_ids) - p
            assert p == len(prompt) and list(traj.token_ids[:p]) == prompt
            assert 1 <= n <= 2  # the agent's default max_new_tokens
            assert all(0 <= t < VOCAB for t in traj.token_ids)
            assert list(traj.logprobs[:p]) == [0.0] * p
            assert all(lp <= 0.0 for lp in traj.logprobs[p:])
            assert list(traj.versions) == [-1] * p + [0] * n  # the server serves version 0
            assert list(traj.loss_mask) == [False] * p + [True] * n
            assert traj.task_id == lease_id and traj.group_id == group.group_id
            # The agent's own reward: the first generated token is the answer letter.
            first = traj.token_ids[p]
            assert traj.reward == (1.0 if first == byte_ids(line["answer"])[0] else 0.0)
            if traj.token_ids[-1] == EOS:
                assert traj.finish_reason == 1  # FINISH_REASON_STOP
            rewards.append(traj.reward)
        assert line["rewards"] == rewards

    # Tracing: every trajectory carries its lease's context (the coordinator's lease span),
    # so the coordinator's submission span is that span's child, in the lease's trace.
    finished = spans.get_finished_spans()
    for line, (lease_id, _, group) in zip(lines, buffered, strict=True):
        (lease_span,) = [
            s
            for s in finished
            if s.name == "coordinator.lease" and s.attributes[tracing.TASK_ID] == lease_id
        ]
        ctx = lease_span.context
        assert line["trace_id"] == format(ctx.trace_id, "032x")
        expected = [f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"]  # trace id, parent id
        carried = [t.trace_context.traceparent.split("-")[1:3] for t in group.trajectories]
        assert carried == [expected] * group_size
        assert lease_span.attributes[tracing.PRODUCER_ID] == "node-test"
        (submitted,) = [
            s
            for s in finished
            if s.name == "coordinator.submit_group" and s.attributes[tracing.TASK_ID] == lease_id
        ]
        assert submitted.parent.span_id == ctx.span_id
        assert submitted.context.trace_id == ctx.trace_id


def test_agent_backs_off_while_no_capacity_and_fails_when_none_comes(rollout, agent, tmp_path):
    # areal-coordinator as a user starts it: batch 1, eta 0 allows one rollout in total.
    argv = python_module_argv(
        "areal_grpc.coordinator.serve",
        "--port",
        "0",
        "staleness.batch_size=1",
        "staleness.max_staleness=0",
    )
    coord = start_child("coordinator", argv, log_dir=tmp_path)
    try:
        channel, stub = coordinator_stub(coord.address)
        with channel:
            register_rollout(stub, rollout.address)
            # Someone else holds the only slot: the agent is refused until it is given back.
            held = stub.AcquireRollout(
                coordinator_pb2.AcquireRolloutRequest(producer_id="holder", group_size=1)
            ).lease
            proc = subprocess.Popen(
                [NODE, str(agent), "--coordinator", coord.address, "--group-size", "2"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(1.5)
            assert proc.poll() is None, proc.communicate()
            stub.ReleaseRollout(coordinator_pb2.ReleaseRolloutRequest(lease_id=held.lease_id))
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            # It waited as long as the server's RetryInfo said, then took the freed slot.
            assert f"retrying in {int(RETRY_AFTER_S * 1000)} ms" in err
            (line,) = [json.loads(x) for x in out.splitlines()]
            assert line["response"] == {"acceptedGroups": 1}
            status = stub.GetCoordinatorStatus(coordinator_pb2.GetCoordinatorStatusRequest())
            assert status.accepted == 1 and status.capacity == 0

            # Nothing trains here, so capacity never returns: the agent gives up, non-zero.
            code, lines, stderr = run_agent(agent, coord.address, "--acquire-timeout-s", "1")
            assert code == 1 and lines == []
            assert "no rollout capacity" in stderr
    finally:
        stop_children([coord])


@pytest.mark.slow
def test_a_training_run_trains_on_the_agent_groups(agent, tmp_path, coordinator_command):
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out,
        *coordinator_command.SMALL_RUN,
        # Longer than the test needs: it stops the run (Ctrl-C) once the agent's groups are
        # trained, so how fast Node starts cannot race a fixed step count.
        "total_steps=100000",
        "staleness.max_staleness=2",
    )
    address = coordinator_command.address(proc)
    # Keep draining the run's output so it never blocks on a full pipe.
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True)
    drain.start()
    code, lines, stderr = run_agent(agent, address, "--episodes=2", "--group-size=2")
    assert code == 0, stderr
    lease_ids = {line["lease_id"] for line in lines}

    def trained_ids() -> set[str]:
        path = out / "batches.jsonl"
        return (
            {g["task_id"] for b in read_jsonl(path) for g in b["groups"]}
            if path.exists()
            else set()
        )

    deadline = time.monotonic() + 120
    while not lease_ids <= trained_ids() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, "".join(rest)  # Ctrl-C: every child stopped
    drain.join(timeout=10)

    assert [line["response"] for line in lines] == [{"acceptedGroups": 1}] * 2
    trained = [g for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    mine = [g for g in trained if g["task_id"] in lease_ids]
    # Each of the agent's groups was trained exactly once, as external work (no dataset seq).
    assert sorted(g["task_id"] for g in mine) == sorted(lease_ids)
    assert all(g["seq"] == -1 for g in mine)
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert steps and [r["step"] for r in steps] == list(range(1, len(steps) + 1))
