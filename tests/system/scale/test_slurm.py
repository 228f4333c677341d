"""``launcher.mode=slurm`` against a real one-node Slurm (Debian's slurm-wlm with munge).

The module's fixture starts munged, slurmctld and slurmd as root with a generated key and
config in a scratch directory (`.ci/run` installs the packages with apt) and stops them
afterwards; without the binaries or root the tests skip and say why. The runs are the
default built-in run: under ``salloc`` (exit code and the steps), with one step killed
(restarted inside the allocation), and submitted with the submit helper, then ``scancel``led
(nothing of the run is left).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
# Beside the suite's small run (CoordinatorCommand.SMALL_RUN in tests/support/coordinator.py,
# from the fixture).
SLURM = ("launcher.mode=slurm", "output.progress_bar=false")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster on this machine; the environment its clients need."""
    missing = [n for n in (*DAEMONS, *CLIENTS) if _which(n) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing; .ci/run installs "
            "slurm-wlm and munge with apt)"
        )
    if os.geteuid() != 0:
        pytest.skip("the one-node cluster's daemons run as root here")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o700)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge" / "munge.sock"
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=areal-test",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={sock}",
                f"StateSaveLocation={d / 'state'}",
                f"SlurmdSpoolDir={d / 'spool'}",
                f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                f"SlurmdPidFile={d / 'slurmd.pid'}",
                f"SlurmctldLogFile={d / 'slurmctld.log'}",
                f"SlurmdLogFile={d / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SwitchType=switch/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "JobAcctGatherType=jobacct_gather/none",
                "KillWait=5",
                f"NodeName={host} CPUs={os.cpu_count() or 2} State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        env.pop(name, None)
    munge_pid = d / "munge" / "munged.pid"
    subprocess.run(
        [
            _which("munged"),
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={munge_pid}",
            f"--log-file={d / 'munge' / 'munged.log'}",
            f"--seed-file={d / 'munge' / 'seed'}",
            "--force",
        ],
        check=True,
        timeout=30,
    )
    subprocess.run([_which("slurmctld"), "-i"], env=env, check=True, timeout=30)
    subprocess.run([_which("slurmd")], env=env, check=True, timeout=30)

    def idle() -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() == "idle"

    try:
        _wait(idle, 60, "the node to be idle")
    except AssertionError:
        _stop(d, env)
        pytest.skip(f"the Slurm daemons did not come up: see {d}")
    yield env
    _stop(d, env)


def _stop(d: Path, env: dict[str, str]) -> None:
    subprocess.run(["scancel", "--user=root"], env=env, timeout=30, check=False)
    for pid_file in (d / "slurmd.pid", d / "slurmctld.pid", d / "munge" / "munged.pid"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie no one reaped yet is gone as a process.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _queue(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %j %T"], env=env, capture_output=True, text=True, timeout=10
    )
    return [line for line in out.stdout.splitlines() if line.strip()]


def _coordinator(small: tuple[str, ...], out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal_grpc.coordinator",
        f"output.dir={out}",
        *SLURM,
        *small,
        *extra,
    ]


def test_the_default_run_under_salloc_starts_its_servers_as_job_steps(
    slurm, tmp_path, coordinator_command
):
    small = coordinator_command.SMALL_RUN
    out = tmp_path / "run"
    proc = subprocess.run(
        ["salloc", "--nodes=1", "--quiet", *_coordinator(small, out, "total_steps=3")],
        env={**slurm, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: 3 steps, version 3" in proc.stdout
    mesh = json.loads((out / "mesh.json").read_text())
    assert sorted(c["name"] for c in mesh["children"]) == ["rollout-0", "trainer-0", "trainer-1"]
    # Each server is a step of the one job: "<job>.<step>", distinct steps.
    steps = [c["step"] for c in mesh["children"]]
    assert all(re.fullmatch(r"\d+\.\d+", s) for s in steps), steps
    assert len({s.split(".")[0] for s in steps}) == 1 and len(set(steps)) == 3
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    # salloc returns once its command exits; slurmctld completes the job just after.
    _wait(lambda: _queue(slurm) == [], 60, "the allocation to leave the queue")
    # Outside an allocation the mode is refused, naming it.
    refused = subprocess.run(
        _coordinator(small, tmp_path / "refused"),
        env=slurm,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "launcher.mode" in refused.stderr


def test_a_killed_step_is_restarted_inside_the_allocation(slurm, tmp_path, coordinator_command):
    small = coordinator_command.SMALL_RUN
    out = tmp_path / "run"
    # Room for the steps a fast machine trains between the second one and the pause below.
    steps = 20
    proc = subprocess.Popen(
        ["salloc", "--nodes=1", "--quiet", *_coordinator(small, out, f"total_steps={steps}")],
        env={**slurm, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait(lambda: coordinator_command.trained_steps(out) >= 2, 180, "two steps")
        # The coordinator (salloc's child), stopped at once, then the rollout server's own
        # process inside its step (their command lines name this run).
        [coordinator] = subprocess.run(
            ["pgrep", "-f", f"^{sys.executable} -m areal_grpc.coordinator output.dir={out}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        # Killed while the coordinator stands still: at a known step, with steps left that
        # only a rollout server can feed, so the launcher must replace it (however loaded the
        # machine is, the run cannot end first).
        with coordinator_command.paused(int(coordinator), out) as trained:
            assert coordinator_command.needs_rollouts_after(trained, steps), trained
            victim = subprocess.run(
                ["pgrep", "-f", f"areal_servers.rollout.*{out}"], capture_output=True, text=True
            ).stdout.split()
            assert victim, "no rollout server process found"
            for pid in victim:
                os.kill(int(pid), signal.SIGKILL)
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log
    assert "rollout server restarted: " in log
    restarts = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "rollout_restart"]
    assert len(restarts) == 1
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    # Every step recorded once, and trained on distinct groups (nothing trained twice).
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    seqs = [g["seq"] for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    assert len(seqs) == len(set(seqs)) == steps * 2
    _wait(lambda: _queue(slurm) == [], 60, "the allocation to leave the queue")


def test_a_submitted_run_is_stopped_by_scancel_with_nothing_left(
    slurm, tmp_path, coordinator_command
):
    out = tmp_path / "run"
    submit = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_grpc.coordinator.submit",
            f"output.dir={out}",
            *SLURM,
            *coordinator_command.SMALL_RUN,
            "total_steps=100000",
            "launcher.slurm.time=00:10:00",
        ],
        env=slurm,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.split()[1]
    assert (out / "submit.sbatch").read_text().startswith("#!/bin/bash\n#SBATCH --job-name=")

    def serving() -> bool:
        mesh = out / "mesh.json"
        return mesh.is_file() and len(json.loads(mesh.read_text())["children"]) == 3

    _wait(serving, 180, "the job's mesh")
    pids = [c["pid"] for c in json.loads((out / "mesh.json").read_text())["children"]]
    assert any(line.split()[0] == job for line in _queue(slurm))
    subprocess.run(["scancel", job], env=slurm, check=True, timeout=30)
    _wait(lambda: _queue(slurm) == [], 90, "an empty queue")
    _wait(lambda: not any(_alive(p) for p in pids), 60, "the steps' processes to end")
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == [], left
