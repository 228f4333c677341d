"""End to end: ``python -m areal_grpc.coordinator`` on a real mesh of subprocesses.

Rollout servers and trainer ranks are our real servers (builtin:micro, FSDP2 over gloo),
weights move through the real fleet weight sync, and the coordinator runs as its own process
exactly as a user starts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from areal_clients.coordinator import CoordinatorClient
from areal_clients.rollout import RolloutClient
from arealgrpc.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)

from areal_grpc.config import load_config
from areal_grpc.coordinator.launcher import start_mesh
from areal_grpc.coordinator.mesh import Mesh
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.data import load_file, write_arithmetic
from areal_grpc.errors import retry_delay_s
from areal_grpc.model import load_tokenizer
from areal_grpc.server import sync_channel
from tests.support.coordinator import alive, mesh_children

pytestmark = pytest.mark.slow

ECHO_PROMPTS = 36  # the built-in "echo" task: one epoch is 36 prompts


def wait_for(predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


def rollout_version(address: str) -> int:
    with sync_channel(address) as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        return stub.GetRolloutStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=10
        ).policy_version


def trained_items(out: Path) -> dict[int, list[str]]:
    """Step -> item ids trained, the last record of each step winning (a resumed run
    re-trains the steps after its checkpoint)."""
    steps: dict[int, list[str]] = {}
    for rec in read_jsonl(out / "batches.jsonl"):
        steps[rec["step"]] = [g["item_id"] for g in rec["groups"]]
    return steps


def test_attach_mode_run_trains_every_prompt_once_within_the_staleness_bound(
    tmp_path, coordinator_command
):
    eta, batch, steps = 1, 4, 9
    overrides = [
        "data.task=echo",
        f"total_steps={steps}",
        f"staleness.batch_size={batch}",
        "staleness.group_size=2",
        f"staleness.max_staleness={eta}",
        "rollout.num_servers=2",
        "eval.every_steps=4",
        f"weight_sync.disk_root={tmp_path / 'weights'}",
        "checkpoint.every_steps=0",
        # fp32 on both sides, for the gap below (bf16's: tests/e2e/trainer/test_precision.py).
        "rollout.dtype=float32",
        "trainer.mixed_precision=off",
    ]
    out = tmp_path / "run"
    # The servers' root is the run's output directory: there the coordinator's checkpoints
    # and export go.
    cfg = load_config(None, [*overrides, f"output.dir={out}"])
    mesh: Mesh = start_mesh(cfg, tmp_path / "mesh-logs")
    try:
        proc = coordinator_command.start(
            out,
            *overrides,
            "launcher.mode=attach",
            f"launcher.attach.rollout_addresses=[{','.join(mesh.rollout_addresses)}]",
            f"launcher.attach.trainer_addresses=[{','.join(mesh.trainer_addresses)}]",
        )
        log = coordinator_command.finish(proc)
        assert proc.returncode == 0, log
        # Every rollout server was brought to the final version by the fleet weight sync.
        assert [rollout_version(a) for a in mesh.rollout_addresses] == [steps, steps]
    finally:
        mesh.stop()

    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert [r["version"] for r in train] == list(range(1, steps + 1))
    assert all(r["sequences"] == batch * 2 for r in train)
    # The train/rollout log-prob gap, on the tokens the trained weights sampled: fp32 on both
    # sides and the same weights, so float rounding of other kernels (~1e-6 here) only.
    measured = [r for r in train if r["logp_gap_tokens"] > 0]
    assert measured, "no step trained a token its own weights sampled"
    assert max(r["logp_gap_max"] for r in measured) < 1e-4
    assert all(0 <= r["logp_gap_kl"] < 1e-8 for r in measured)
    # Each group's two samples share their prompt, which the trainer computed once (its
    # log-probs, above, are those of the packed forward).
    assert all(0 < r["prefix_sharing_ratio"] < 1 for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4, 8, 9]
    # Greedy eval over the whole eval split, spread over both servers.
    assert all(r["eval_prompts"] == ECHO_PROMPTS for r in evals)
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in evals)

    batches = read_jsonl(out / "batches.jsonl")
    task_ids = [g["task_id"] for b in batches for g in b["groups"]]
    assert len(task_ids) == len(set(task_ids)) == steps * batch  # nothing trained twice
    # 9 x 4 = 36 = one epoch: every prompt of the split exactly once.
    items = [g["item_id"] for b in batches for g in b["groups"]]
    assert sorted(items) == sorted(f"echo-train-{i}" for i in range(ECHO_PROMPTS))
    for b in batches:
        # b["version"] is the trainer's version at the step: no trained token is older
        # than eta versions behind it.
        assert all(g["min_version"] >= b["version"] - eta for g in b["groups"]), b
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "model" / "config.json").is_file()
    assert "done: 9 steps, version 9" in log

    # What each step trained on, readable: its first output.rollouts_per_step (2) groups.
    files = sorted((out / "rollouts").glob("step-*.jsonl"))
    assert [p.name for p in files] == [f"step-{s:06d}.jsonl" for s in range(steps)]
    for path, b in zip(files, batches, strict=True):
        samples = read_jsonl(path)
        assert len(samples) == 2 * 2  # 2 groups x group_size 2
        assert {r["task_id"] for r in samples} <= {g["task_id"] for g in b["groups"]}
        for r in samples:
            assert r["version"] == b["version"] and r["finish_reason"] in ("stop", "length")
            assert len(r["completion_ids"]) == len(r["versions"]) == len(r["logprobs"]) > 0
            assert all(b["version"] - eta <= v <= b["version"] for v in r["versions"])
    shown = subprocess.run(
        [sys.executable, "-m", "areal_grpc.inspect", str(out), "-n", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    tokenizer = load_tokenizer(cfg.model.source)
    last = read_jsonl(files[-1])[-3:]
    for r in last:
        assert (
            repr(tokenizer.decode(r["completion_ids"], skip_special_tokens=False)) in shown.stdout
        )
    assert shown.stdout.count(f"step {steps - 1}  version {steps - 1}  reward ") == 3
    # The text is the tokenizer's; the advantage the trainer's (GRPO centres each group's).
    for path in files:
        samples = read_jsonl(path)
        for r in samples:
            assert r["prompt"] == tokenizer.decode(r["prompt_ids"], skip_special_tokens=False)
            assert r["completion"] == tokenizer.decode(
                r["completion_ids"], skip_special_tokens=False
            )
        for task in {r["task_id"] for r in samples}:
            advantages = [r["advantage"] for r in samples if r["task_id"] == task]
            assert sum(advantages) == pytest.approx(0.0, abs=1e-4), advantages


def test_killed_run_resumes_with_the_same_prompts_in_the_same_order(tmp_path, coordinator_command):
    # 20 steps x 2 prompts cross the 36-prompt epoch; the kill comes soon after the first
    # checkpoint (step 2), long before the end.
    steps = 20
    overrides = [
        "data.task=echo",
        f"total_steps={steps}",
        "staleness.batch_size=2",
        "staleness.group_size=2",
        "staleness.max_staleness=0",
        "eval.every_steps=0",
        "checkpoint.every_steps=2",
        "checkpoint.export_hf=false",
        "output.plot=false",
    ]
    reference = tmp_path / "uninterrupted"
    proc = coordinator_command.start(reference, *overrides)
    log = coordinator_command.finish(proc)
    assert proc.returncode == 0, log
    # eta = 0 is synchronous: every step trains samples of exactly the weights it updates.
    for b in read_jsonl(reference / "batches.jsonl"):
        assert all(g["min_version"] == g["head_version"] == b["version"] for g in b["groups"])

    out = tmp_path / "killed"
    proc = coordinator_command.start(out, *overrides)
    # Kill the coordinator (no clean-up of any kind) once a checkpoint is committed.
    wait_for(lambda: (out / "checkpoints" / "latest").is_file())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for child in mesh_children(out):
        with_pid = child["pid"]
        if alive(with_pid):
            os.kill(with_pid, signal.SIGKILL)
    killed_at = max(trained_items(out))
    assert killed_at < steps - 1

    proc = coordinator_command.start(out, *overrides, resume=True)
    log = coordinator_command.finish(proc)
    assert proc.returncode == 0, log
    assert "resumed from step " in log
    assert trained_items(out) == trained_items(reference)
    assert len(trained_items(out)) == steps
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    # The records of the redone steps were replaced, not duplicated.
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert (train[-1]["step"], train[-1]["version"]) == (steps, steps)

    # So were the samples of the redone steps: the same prompts as the uninterrupted run's.
    def sampled(run: Path) -> list[list[str]]:
        files = sorted((run / "rollouts").glob("step-*.jsonl"))
        return [sorted({r["task_id"] for r in read_jsonl(p)}) for p in files]

    assert sampled(out) == sampled(reference) and len(sampled(out)) == steps


def test_ctrl_c_stops_the_run_and_every_child(tmp_path, coordinator_command):
    out = tmp_path / "run"
    proc = coordinator_command.start(out, "total_steps=100000", "eval.every_steps=0")
    wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size)
    children = mesh_children(out)
    assert len(children) == 3
    proc.send_signal(signal.SIGINT)
    log = coordinator_command.finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, log
    assert "mesh stopped cleanly" in log
    for child in children:
        wait_for(lambda pid=child["pid"]: not alive(pid), timeout=30)


def test_bad_config_names_the_key(tmp_path, coordinator_command):
    for override, key in [
        ("trainer.optimizer.lr=-1", "trainer.optimizer.lr"),
        ("trainer.ppo.n_minibatches=0", "trainer.ppo.n_minibatches"),
        ("no_such.key=1", "no_such"),
    ]:
        code, log = coordinator_command.run(tmp_path, override, timeout=60)
        assert code == 2, log
        assert f"config error: {key}:" in log, log


def test_launch_problems_exit_with_one_line_naming_the_cause(tmp_path, coordinator_command):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    no_config = tmp_path / "empty-model"
    no_config.mkdir()
    bad_config = tmp_path / "bad-model"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            # Found before anything starts: status 2 and the key.
            ([f"output.dir={blocker / 'run'}"], 2, "config error: output.dir: cannot write"),
            # 192.0.2.1 is TEST-NET-1 (RFC 5737): never a local address.
            (["launcher.host=192.0.2.1"], 2, "config error: launcher.host: cannot listen on"),
            (
                [f"launcher.coordinator_port={port}"],
                2,
                f"config error: launcher.coordinator_port: cannot listen on 127.0.0.1:{port}",
            ),
            ([f"model.source={no_config}"], 2, "config error: model.source:"),
            # Found by a server as it starts: its own last error line, status 1.
            (
                [f"model.source={bad_config}"],
                1,
                "error: rollout-0 did not start (exit code 1): ValueError: Unrecognized model",
            ),
        ]
        for overrides, want_code, want_line in cases:
            # A case's own output.dir comes after the default one, and wins.
            code, log = coordinator_command.run(tmp_path / "run", *overrides, timeout=120)
            assert code == want_code, log
            assert want_line in log, log
            assert "Traceback" not in log, log


def test_a_dead_rollout_server_loses_no_work_and_a_registered_one_joins(
    tmp_path, coordinator_command
):
    eta, batch, steps, group_size = 1, 2, 40, 2
    overrides = [
        "data.task=echo",
        f"total_steps={steps}",
        f"staleness.batch_size={batch}",
        f"staleness.group_size={group_size}",
        f"staleness.max_staleness={eta}",
        "rollout.num_servers=3",
        "eval.every_steps=0",
        f"weight_sync.disk_root={tmp_path / 'weights'}",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "output.plot=false",
    ]
    out = tmp_path / "run"
    cfg = load_config(None, [*overrides, f"output.dir={out}"])
    mesh = start_mesh(cfg, tmp_path / "mesh-logs")
    doomed, newcomer = mesh.children[1], mesh.children[2]
    try:
        proc = coordinator_command.start(
            out,
            *overrides,
            "rollout.num_servers=2",
            "launcher.mode=attach",
            "launcher.coordinator_port=0",
            f"launcher.attach.rollout_addresses=[{','.join(mesh.rollout_addresses[:2])}]",
            f"launcher.attach.trainer_addresses=[{','.join(mesh.trainer_addresses)}]",
        )
        address = coordinator_command.address(proc)
        metrics = out / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and metrics.read_text().count('"train"') >= 2)
        doomed.process.kill()
        with sync_channel(address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)

            def health() -> dict[str, bool]:
                status = stub.GetCoordinatorStatus(
                    coordinator_pb2.GetCoordinatorStatusRequest(), timeout=30
                )
                return {w.address: w.healthy for w in status.workers}

            # The coordinator notices the dead server and takes it out of rotation.
            wait_for(lambda: health()[doomed.address] is False)
            # The live server stays (or, if the failed update took it out too, comes back).
            wait_for(lambda: health()[mesh.rollout_addresses[0]] is True)
            reply = stub.RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(
                    role=coordinator_pb2.WORKER_ROLE_ROLLOUT, address=newcomer.address
                ),
                timeout=30,
            )
            assert reply.worker_id
        log = coordinator_command.finish(proc)
        assert proc.returncode == 0, log
        # The newcomer was brought level by the weight syncs and served the run.
        assert rollout_version(newcomer.address) == steps
    finally:
        mesh.stop()

    batches = read_jsonl(out / "batches.jsonl")
    seqs = [g["seq"] for b in batches for g in b["groups"]]
    assert len(seqs) == len(set(seqs)) == steps * batch  # nothing trained twice
    # Nothing lost: every prompt up to the last few handed out was trained (work that was
    # running on the dead server went back to the queue and was trained later).
    outstanding = (eta + 1) * batch
    assert set(range(steps * batch - outstanding)) <= set(seqs)
    for b in batches:
        assert all(g["min_version"] >= b["version"] - eta for g in b["groups"]), b


def rollout_status(address: str) -> coordinator_pb2.GetCoordinatorStatusResponse:
    with sync_channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        return stub.GetCoordinatorStatus(coordinator_pb2.GetCoordinatorStatusRequest(), timeout=30)


def kill_rollout_0_after(
    command,
    proc: subprocess.Popen[str],
    out: Path,
    steps: int,
    total_steps: int,
    sig: signal.Signals = signal.SIGKILL,
) -> tuple[int, list[dict]]:
    """Sends ``sig`` to the rollout-0 child once ``steps`` steps are recorded; (pid, children).

    The run's coordinator (``proc``, started by ``command``, the ``coordinator_command``
    fixture) is paused meanwhile, so the run of ``total_steps`` still needs a rollout server
    afterwards however loaded the machine is.
    """
    wait_for(lambda: command.trained_steps(out) >= steps)
    children = mesh_children(out)
    pid = next(c["pid"] for c in children if c["name"] == "rollout-0")
    with command.paused(proc.pid, out) as trained:
        assert command.needs_rollouts_after(trained, total_steps), trained
        os.kill(pid, sig)
    return pid, children


@pytest.mark.parametrize(
    ("sig", "extra", "cause"),
    [
        (signal.SIGKILL, (), "process is gone"),
        # Frozen, not dead: replaced once out of rotation for
        # fault_tolerance.rollout.replace_after_s.
        (
            signal.SIGSTOP,
            (
                "fault_tolerance.rollout.replace_after_s=3",
                "fault_tolerance.rollout.health_interval_s=1",
                "fault_tolerance.rollout.health_timeout_s=1",
            ),
            "out of rotation for 3 s",
        ),
    ],
    ids=["killed", "frozen"],
)
def test_a_killed_rollout_server_is_restarted_and_the_run_finishes(
    tmp_path, coordinator_command, sig, extra, cause
):
    steps = 30
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out, *coordinator_command.SMALL_RUN, f"total_steps={steps}", *extra
    )
    address = coordinator_command.address(proc)
    pid, children = kill_rollout_0_after(coordinator_command, proc, out, 3, steps, sig)
    old = next(c["address"] for c in children if c["name"] == "rollout-0")

    def restarted() -> bool:
        status = rollout_status(address)
        [worker] = [w for w in status.workers if w.role == coordinator_pb2.WORKER_ROLE_ROLLOUT]
        return (
            status.rollout_restarts == 1
            and worker.restarts == 1
            and worker.address != old
            and worker.rollout_state == coordinator_pb2.ROLLOUT_SERVER_STATE_SERVING
        )

    # The replacement is listed under the same worker, serving, before the run ends. A server
    # frozen in the middle of a weight transfer holds that update until a keepalive ping goes
    # unanswered (10 + 5 s), hence the margin.
    wait_for(restarted, timeout=180)
    log = coordinator_command.finish(proc, timeout=120)
    assert proc.returncode == 0, log
    assert f"rollout server restarted: {old} -> " in log
    # The lost server's request stream ended cleanly (grpc/grpc#29518 left its feeder task
    # pending, and asyncio logged it as destroyed at garbage collection).
    assert "Task was destroyed but it is pending" not in log, log
    [record] = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "rollout_restart"]
    assert record["old_address"] == old and record["restarts"] == 1
    assert cause in record["cause"]
    # mesh.json names the replacement (a new child), not the dead one.
    now = json.loads((out / "mesh.json").read_text())
    assert now["rollout"] == [record["new_address"]]
    [child] = [c for c in now["children"] if c["name"].startswith("rollout-")]
    assert (child["name"], child["address"]) == ("rollout-1", record["new_address"])
    assert not alive(pid)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["rollout_restarts"] == 1


def test_with_no_restarts_left_a_run_without_rollout_servers_fails_naming_the_key(
    tmp_path, coordinator_command
):
    timeout_s = 5
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out,
        *coordinator_command.SMALL_RUN,
        "total_steps=100000",
        "fault_tolerance.rollout.max_restarts=0",
        f"fault_tolerance.rollout.no_server_timeout_s={timeout_s}",
    )
    _, children = kill_rollout_0_after(coordinator_command, proc, out, 2, 100000)
    killed_at = time.monotonic()
    log = coordinator_command.finish(proc, timeout=120)
    took = time.monotonic() - killed_at
    assert proc.returncode == 1, log
    assert "no rollout server in rotation" in log
    [error] = [line for line in log.splitlines() if line.startswith("error: ")]
    assert f"fault_tolerance.rollout.no_server_timeout_s={timeout_s}" in error
    # Not before the timeout (finish()'s own deadline is what catches a hang).
    assert took >= timeout_s, took
    for child in children:
        wait_for(lambda pid=child["pid"]: not alive(pid), timeout=30)


def test_config_file_and_overrides_reach_the_run(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("total_steps: 7\nstaleness:\n  batch_size: 5\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_grpc.coordinator",
            "--config",
            str(path),
            "--print-config",
            "staleness.batch_size=3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    cfg = load_config(None, [])
    printed = out.stdout
    assert "total_steps: 7" in printed and "batch_size: 3" in printed
    assert f"max_staleness: {cfg.staleness.max_staleness}" in printed


def test_an_external_producer_trains_through_a_lease_in_a_running_loop(
    tmp_path, coordinator_command
):
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out,
        "data.task=echo",
        "total_steps=60",
        "staleness.batch_size=2",
        "staleness.group_size=2",
        "staleness.max_staleness=1",
        "eval.every_steps=0",
        "checkpoint.export_hf=false",
        "output.plot=false",
    )
    address = coordinator_command.address(proc)
    tokenizer = load_tokenizer("builtin:micro")

    async def agent() -> str:
        client = CoordinatorClient(address)
        while True:
            try:
                lease = await client.acquire("agent-1", group_size=2)
                break
            except grpc.aio.AioRpcError as exc:
                # A busy run says when to come back.
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                delay = retry_delay_s(exc)
                assert delay is not None, exc
                await asyncio.sleep(delay)
        rollout = RolloutClient(lease.rollout_address)
        ids = tokenizer.encode("q=", add_special_tokens=False)
        reply = await rollout.generate(
            ids, common_pb2.SamplingParams(n_samples=2, max_new_tokens=2, temperature=1.0)
        )
        group = common_pb2.TrajectoryGroup(task_id=lease.lease_id, group_id=lease.lease_id)
        for c in reply.completions:
            n = len(c.output_ids)
            text = tokenizer.decode(c.output_ids, skip_special_tokens=True)
            group.trajectories.add(
                token_ids=[*ids, *c.output_ids],
                logprobs=[0.0] * len(ids) + list(c.output_logprobs),
                versions=[-1] * len(ids) + list(c.output_versions),
                loss_mask=[False] * len(ids) + [True] * n,
                reward=1.0 if text.startswith("q") else 0.0,
                prompt_length=len(ids),
                task_id=lease.lease_id,
            )
        submitted = await client.submit([(lease.lease_id, group)])
        assert submitted.accepted_groups == 1, submitted
        await rollout.close()
        await client.close()
        return lease.lease_id

    lease_id = asyncio.run(agent())
    log = coordinator_command.finish(proc)
    assert proc.returncode == 0, log
    groups = [g for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    trained = [g for g in groups if g["task_id"] == lease_id]
    # Trained exactly once, like a dataset prompt (it has no dataset position).
    assert len(trained) == 1 and trained[0]["seq"] == -1


def test_a_gsm8k_file_run_scores_held_out_items_overall_and_per_kind(tmp_path, coordinator_command):
    # The real-data path end to end: JSONL files from the arithmetic generator, the gsm8k
    # reward, the held-out file as the eval split.
    train, test = write_arithmetic(tmp_path / "data", n_train=40, n_test=12, seed=3)
    out = tmp_path / "run"
    code, log = coordinator_command.run(
        out,
        *coordinator_command.SMALL_RUN,
        "data.task=gsm8k",
        f"data.path={train}",
        f"data.eval_path={test}",
        "rollout.reward=gsm8k",
        "total_steps=2",
        "eval.every_steps=2",
    )
    assert code == 0, log
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    held_out = load_file(str(test), "data.eval_path")
    kinds = {item["kind"] for item in held_out}
    for r in evals:
        assert r["eval_prompts"] == len(held_out)
        by_kind = r["accuracy_by_kind"]
        assert set(by_kind) == kinds
        # The overall accuracy is the per-kind accuracies weighted by their item counts.
        weighted = sum(by_kind[k] * sum(i["kind"] == k for i in held_out) for k in kinds) / len(
            held_out
        )
        assert abs(weighted - r["accuracy"]) < 1e-9
    trained = [g["item_id"] for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    train_ids = {i["id"] for i in load_file(str(train), "data.path")}
    assert trained and set(trained) <= train_ids
