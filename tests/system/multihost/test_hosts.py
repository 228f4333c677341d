"""The mesh across hosts: the coordinator, its trainer ranks and rollout servers in network
namespaces of their own (``tests/support/hosts.py``), each host on a 1 Gbit/s link with its
own shared memory; real processes, real TCP, the same binaries, attached as a user attaches
servers started on other machines. Skipped, saying why, without root or iproute2, except
where AREAL_REQUIRE_HOSTS is set (CI): there they run and fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from areal_servers.trainer.weight_publisher import published_tensors
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from areal_grpc.config import load_config
from areal_grpc.coordinator.mesh import rollout_argv, trainer_argv
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.launch import Child, child_env, start_child, stop_children
from areal_grpc.model import load_model
from areal_grpc.server import sync_channel
from tests.support.hosts import Host, Hosts, hosts, unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(unavailable()) and not os.environ.get("AREAL_REQUIRE_HOSTS"),
        reason=unavailable() or "hosts can be made",
    ),
]

STEPS = 6
RUN = (
    "data.task=echo",
    f"total_steps={STEPS}",
    "staleness.batch_size=4",
    "staleness.group_size=2",
    "staleness.max_staleness=1",
    "rollout.num_servers=2",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "checkpoint.export_hf=false",
    "output.plot=false",
    "output.tensorboard=false",
    "output.log_level=INFO",
    # A test network of one machine; across real machines, security.tls (docs: security).
    "security.allow_plaintext=true",
)


def start_attached(
    hs: Hosts,
    run: Sequence[str],
    out: Path,
    logs: Path,
    rollout_hosts: Sequence[str],
    trainer_host: str,
    children: list[Child],
) -> tuple[list[str], list[str]]:
    """Rollout servers on ``rollout_hosts`` (one per entry, in order) and the trainer ranks on
    ``trainer_host``, as a user starts them on their machines; their addresses. Every child
    is added to ``children`` as it starts (the caller stops them)."""
    rollouts = []
    for i, name in enumerate(rollout_hosts):
        host = hs[name]
        cfg = load_config(None, [*run, f"output.dir={out}", f"launcher.host={host.ip}"])
        argv = host.argv(rollout_argv(cfg, i))
        children.append(start_child(f"rollout-{i}", argv, log_dir=logs, env=child_env()))
        rollouts.append(children[-1].address)
    host = hs[trainer_host]
    cfg = load_config(None, [*run, f"output.dir={out}", f"launcher.host={host.ip}"])
    trainers = []
    for rank in range(cfg.trainer.ranks):
        argv = host.argv(trainer_argv(cfg, rank, 29517))
        children.append(start_child(f"trainer-{rank}", argv, log_dir=logs, env=child_env()))
        trainers.append(children[-1].address)
    return rollouts, trainers


def attach_argv(
    hs: Hosts, host: str, rollouts: Sequence[str], trainers: Sequence[str]
) -> list[str]:
    """The coordinator's overrides to attach to ``rollouts`` and ``trainers`` from ``host``."""
    return [
        "launcher.mode=attach",
        f"launcher.host={hs[host].ip}",
        f"launcher.attach.rollout_addresses=[{','.join(rollouts)}]",
        f"launcher.attach.trainer_addresses=[{','.join(trainers)}]",
    ]


def plans(log: Path) -> list[str]:
    """The weight-sync plans a rollout server's log records (one per update it negotiated)."""
    return [ln for ln in log.read_text().splitlines() if " plan " in ln and "TRANSFER_METHOD" in ln]


def batches(out: Path) -> list[dict]:
    """The run's ``batches.jsonl`` records so far."""
    path = out / "batches.jsonl"
    return read_jsonl(path) if path.exists() else []


def wait_for(proc: subprocess.Popen[str], done: Callable[[], bool], timeout: float) -> None:
    """Until ``done()``, while the run ``proc`` goes on; AssertionError past ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, "the run ended"
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.2)


def cut_off(host: Host, seconds: float, out: Path) -> tuple[int, int]:
    """Takes ``host`` off the network for ``seconds``, then back; the run's recorded steps
    (``batches.jsonl``) when it went and when it came back."""
    host.cut()
    cut_at = len(batches(out))
    time.sleep(seconds)
    restored_at = len(batches(out))
    host.restore()
    return cut_at, restored_at


def test_hosts_reach_each_other_over_their_links_and_keep_their_shared_memory_apart() -> None:
    with hosts(["a", "b"]) as hs:
        a, b = hs["a"], hs["b"]
        mark = "areal-hosts-test"
        write = f"open('/dev/shm/{mark}', 'w').write('x')"
        subprocess.run(a.argv([sys.executable, "-c", write]), check=True)
        seen = {
            h.name: subprocess.run(
                h.argv(["ls", "/dev/shm"]), capture_output=True, text=True, check=True
            ).stdout.split()
            for h in (a, b)
        }
        assert mark in seen["a"] and mark not in seen["b"]
        serve = (
            f"import socket; s = socket.create_server(('{b.ip}', 7001)); print('up', flush=True);"
            " c, _ = s.accept(); c.sendall(c.recv(64))"
        )
        server = subprocess.Popen(b.argv([sys.executable, "-c", serve]), stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None and server.stdout.readline() == b"up\n"
            echo = (
                f"import socket; c = socket.create_connection(('{b.ip}', 7001), timeout=10);"
                " c.sendall(b'ping'); print(c.recv(64).decode())"
            )
            got = subprocess.run(
                a.argv([sys.executable, "-c", echo]), capture_output=True, text=True, timeout=30
            )
            assert got.stdout.strip() == "ping", got.stderr
        finally:
            server.kill()
        # Cut off, b is unreachable; restored, it is reachable again.
        b.cut()
        probe = f"import socket; socket.create_connection(('{b.ip}', 7002), timeout=2)"
        cut = subprocess.run(a.argv([sys.executable, "-c", probe]), capture_output=True, text=True)
        assert "timed out" in cut.stderr
        b.restore()
        back = subprocess.run(a.argv([sys.executable, "-c", probe]), capture_output=True, text=True)
        assert "Connection refused" in back.stderr  # b answers: nothing listens on 7002


def test_a_run_across_three_hosts_trains_every_step_once_and_syncs_weights_over_the_links(
    tmp_path: Path, coordinator_command
) -> None:
    """Coordinator and two trainer ranks on "head", one rollout server on each of two rollout
    hosts: every step is trained and recorded once, every rollout server ends at the last
    version, and the weights crossed the links (shared memory, offered first, is declined by
    the other hosts)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    children: list[Child] = []
    with hosts(["head", "rollout-a", "rollout-b"]) as hs:
        head = hs["head"]
        try:
            rollouts, trainers = start_attached(
                hs, RUN, out, logs, ["rollout-a", "rollout-b"], "head", children
            )
            assert all(a.startswith(head.ip) for a in trainers)
            attach = attach_argv(hs, "head", rollouts, trainers)
            proc = coordinator_command.start(out, *RUN, *attach, on=head.argv)
            log = coordinator_command.finish(proc, timeout=280)
            assert proc.returncode == 0, log[-3000:]
        finally:
            stop_children(children)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    batches = read_jsonl(out / "batches.jsonl")
    assert len(batches) == STEPS and len({b["step"] for b in batches}) == STEPS
    groups = [g["task_id"] for b in batches for g in b["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * 4  # no group trained twice
    for i in range(2):
        log_file = logs / f"rollout-{i}.log"
        planned = plans(log_file)
        assert len(planned) >= STEPS, log_file.read_text()[-2000:]
        assert not any("SHARED_MEMORY" in line for line in planned), planned
        assert f"serves policy version {STEPS}" in log_file.read_text()


def test_a_rollout_host_cut_off_mid_run_leaves_rotation_and_rejoins_at_the_latest_version(
    tmp_path: Path, coordinator_command
) -> None:
    """rollout-b's link goes down for 30 s after step 5: the run goes on on rollout-a; when the
    link is back, rollout-b produces groups again, at the latest weights. Every step is
    recorded once and no group is trained twice."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    run = [r for r in RUN if not r.startswith("total_steps=")] + [
        "total_steps=100000",  # stopped by the test (SIGTERM) once rollout-b is back
        "fault_tolerance.rollout.health_interval_s=1",
        "fault_tolerance.rollout.health_timeout_s=2",
    ]
    children: list[Child] = []
    with hosts(["head", "rollout-a", "rollout-b"]) as hs:
        head, cut_host = hs["head"], hs["rollout-b"]
        try:
            rollouts, trainers = start_attached(
                hs, run, out, logs, ["rollout-a", "rollout-b"], "head", children
            )
            attach = attach_argv(hs, "head", rollouts, trainers)
            proc = coordinator_command.start(out, *run, *attach, on=head.argv)

            wait_for(proc, lambda: len(batches(out)) >= 5, 120)
            cut_at, restored_at = cut_off(cut_host, 30, out)

            def back() -> list[dict]:
                return [
                    g
                    for b in batches(out)[restored_at:]
                    for g in b["groups"]
                    if g["producer"] == rollouts[1]
                ]

            wait_for(proc, lambda: len(back()) > 0, 120)
            proc.send_signal(signal.SIGTERM)
            log = coordinator_command.finish(proc, timeout=120)
            assert proc.returncode == 143, log[-3000:]
        finally:
            stop_children(children)
    assert restored_at > cut_at + 5, (cut_at, restored_at)  # the run went on on rollout-a
    recorded = batches(out)
    during = [g for b in recorded[cut_at + 2 : restored_at] for g in b["groups"]]
    assert during and all(g["producer"] == rollouts[0] for g in during)
    # Back at the latest weights: what rollout-b produced after the cut was generated by
    # versions at most max_staleness (1) behind the step that trained it.
    for b in recorded[restored_at:]:
        for g in b["groups"]:
            if g["producer"] == rollouts[1]:
                assert g["head_version"] >= b["version"] - 1, (b["step"], g)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    assert [b["step"] for b in recorded] == list(range(len(recorded)))
    groups = [g["task_id"] for b in recorded for g in b["groups"]]
    assert len(groups) == len(set(groups))
    # Nothing issued during the cut was lost: every task up to the ones trained when the link
    # came back was trained (tasks still running at the SIGTERM may be missing after them).
    seqs = {g["seq"] for b in recorded for g in b["groups"]}
    upto = max(g["seq"] for g in recorded[restored_at]["groups"])
    assert set(range(upto)) <= seqs


def test_a_trainer_host_cut_off_mid_run_recovers_as_a_restarted_group(
    tmp_path: Path, coordinator_command
) -> None:
    """The trainer ranks' host goes off the network for 20 s after step 12: the group fails
    its health check during the step, as a killed rank does, and when the link is back the
    same ranks (attach mode: nobody restarts them) are taken up again from the checkpoint of
    step 10, above every version served. The steps after the checkpoint are redone and
    recorded once; every task issued was trained once in the final accounting."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    run = [r for r in RUN if not r.startswith(("total_steps=", "checkpoint.", "rollout.num"))] + [
        "total_steps=100000",
        "rollout.num_servers=1",
        "checkpoint.every_steps=5",
        "checkpoint.export_hf=false",
        "fault_tolerance.trainer.health_interval_s=1",
        "fault_tolerance.trainer.health_timeout_s=2",
    ]
    children: list[Child] = []
    with hosts(["head", "trainers", "rollout-a"]) as hs:
        head, trainer_host = hs["head"], hs["trainers"]
        try:
            rollouts, trainers = start_attached(
                hs, run, out, logs, ["rollout-a"], "trainers", children
            )
            attach = attach_argv(hs, "head", rollouts, trainers)
            proc = coordinator_command.start(out, *run, *attach, on=head.argv)

            wait_for(proc, lambda: len(batches(out)) >= 12, 120)
            cut_at, restored_at = cut_off(trainer_host, 20, out)
            wait_for(proc, lambda: len(batches(out)) > restored_at + 10, 180)
            proc.send_signal(signal.SIGTERM)
            log = coordinator_command.finish(proc, timeout=120)
            assert proc.returncode == 143, log[-3000:]
        finally:
            stop_children(children)
    assert restored_at == cut_at  # no step without the trainers
    records = read_jsonl(out / "metrics.jsonl")
    [recovery] = [r for r in records if r["kind"] == "recovery"]
    assert recovery["step"] == 10 and recovery["failed_at_step"] > 10
    assert "health check" in recovery["cause"]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    assert [r["trainer_restarts"] for r in train] == [0] * 10 + [1] * (len(train) - 10)
    versions = [r["version"] for r in train]
    assert versions[:10] == list(range(1, 11)) and recovery["version"] >= cut_at
    assert versions[10:] == list(
        range(recovery["version"] + 1, recovery["version"] + len(train) - 9)
    )
    recorded = batches(out)
    assert [b["step"] for b in recorded] == list(range(len(recorded)))
    groups = [g["task_id"] for b in recorded for g in b["groups"]]
    assert len(groups) == len(set(groups))
    seqs = {g["seq"] for b in recorded for g in b["groups"]}
    upto = max(g["seq"] for g in recorded[cut_at + 5]["groups"])
    assert set(range(upto)) <= seqs, sorted(set(range(upto)) - seqs)


def test_an_update_crosses_each_link_once_and_the_servers_of_a_host_take_it_from_its_relay(
    tmp_path: Path, coordinator_command
) -> None:
    """Three rollout servers on one host and one on another: each update reaches the first
    host once, into one server that writes it into its shared memory, and the other two load
    it from there by SHARED_MEMORY; the lone server gets its own copy. Every server ends at
    the last version, serving the same weights (equal greedy completions), and the trainer
    sent two copies per step, not four."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    # fp32 weights: one copy's bytes are the model's parameters times 4.
    run = [r for r in RUN if not r.startswith("rollout.num_servers=")] + [
        "rollout.num_servers=4",
        "rollout.dtype=float32",
    ]
    children: list[Child] = []
    with hosts(["head", "rollout-a", "rollout-b"]) as hs:
        try:
            rollouts, trainers = start_attached(
                hs, run, out, logs, ["rollout-a"] * 3 + ["rollout-b"], "head", children
            )
            attach = attach_argv(hs, "head", rollouts, trainers)
            proc = coordinator_command.start(out, *run, *attach, on=hs["head"].argv)
            log = coordinator_command.finish(proc, timeout=280)
            assert proc.returncode == 0, log[-3000:]
            completions = {a: greedy(a) for a in rollouts}
        finally:
            stop_children(children)
    planned = [plans(logs / f"rollout-{i}.log") for i in range(4)]
    for i in range(4):
        assert f"serves policy version {STEPS}" in (logs / f"rollout-{i}.log").read_text()
    # On rollout-a one server received every update over the link and relayed it; the two
    # others took every one by SHARED_MEMORY from it (a plan per update; each server's first
    # plan of an update is the plain one the sender then replaces).
    relayed = [sum("relayed into /dev/shm/" in ln for ln in p) for p in planned]
    shared = [sum("TRANSFER_METHOD_SHARED_MEMORY" in ln for ln in p) for p in planned]
    leader = next(i for i in range(3) if relayed[i])
    assert relayed[leader] >= STEPS and shared[leader] == 0, (relayed, shared)
    for i in set(range(3)) - {leader}:
        assert relayed[i] == 0 and shared[i] == STEPS, (relayed, shared)
    assert relayed[3] == shared[3] == 0, (relayed, shared)
    assert len(set(map(tuple, completions.values()))) == 1, completions
    # Two copies left the trainer per step: the relay's and rollout-b's.
    model = load_model(load_config(None, list(run)).model.source)
    one_copy = sum(t.numel() * t.element_size() for _, t in published_tensors(model))
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["sync_bytes"] for r in train] == [one_copy] * STEPS
    assert [r["sync_sent_bytes"] for r in train] == [2 * one_copy] * STEPS


def greedy(address: str) -> list[int]:
    """A greedy completion from the rollout server at ``address``."""
    with sync_channel(address) as channel:
        reply = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
            rollout_pb2.GenerateRequest(
                input_ids=[5, 17, 42, 99, 7],
                sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8),
            ),
            timeout=60,
        )
    return list(reply.completions[0].output_ids)
