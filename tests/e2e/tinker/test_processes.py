"""``python -m areal_grpc.tinker`` never leaves its training service behind: not when it is
stopped while SDK clients hold connections, not when it is killed with SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import tinker

from areal_grpc.launch import Child, stop_children
from tests.support.tinker import start_tinker

MODEL = "builtin:tiny"
KEY = "tml-proc-0123456789abcdefgh"


def start_service(tmp_path: Path, *overrides: str) -> tuple[Child, int]:
    """The service on the tiny model; the pid of its training service child."""
    child = start_tinker(tmp_path, {"proc": KEY}, MODEL, *overrides)
    found = re.search(
        r"lora-training listening on \S+ \(pid (\d+)\)",
        (tmp_path / "logs" / "tinker.log").read_text(),
    )
    assert found, "the training service's start was not logged"
    return child, int(found.group(1))


def gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True  # dead, waiting for init to reap it
        time.sleep(0.1)
    return False


def test_a_stop_with_clients_connected_ends_the_training_service_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    child, service_pid = start_service(tmp_path)
    try:
        client = tinker.ServiceClient(base_url=f"http://{child.address}", api_key=KEY)
        caps = client.get_server_capabilities()
        assert [m.model_name for m in caps.supported_models] == [MODEL]
        started = time.monotonic()
        # The SDK's connection stays open: the stop must not wait for it.
        stop_children([child])
        assert time.monotonic() - started < 12, "the stop waited for the clients' connections"
        assert child.process.returncode == 0
        assert gone_within(service_pid, 10)
    finally:
        stop_children([child])


def test_a_killed_service_takes_its_training_service_with_it(tmp_path: Path):
    child, service_pid = start_service(tmp_path)
    try:
        child.process.send_signal(signal.SIGKILL)
        child.process.wait()
        # Nothing could stop it: the kernel does (PR_SET_PDEATHSIG).
        assert gone_within(service_pid, 10)
    finally:
        stop_children([child])


def test_the_trainer_groups_workers_go_with_the_service_stopped_or_killed(tmp_path: Path):
    """Workers of tinker.trainer_ranks=3: a stop ends them; so does kill -9 of the service
    that started them (and of the entry point above it)."""
    for how in ("stop", "kill"):
        out = tmp_path / how
        out.mkdir()
        child, service_pid = start_service(out, "tinker.trainer_ranks=3")
        try:
            log = (out / "run" / "logs" / "lora-training.log").read_text()
            workers = [
                int(p) for p in re.findall(r"trainer-rank-\d+ listening on \S+ \(pid (\d+)\)", log)
            ]
            assert len(workers) == 2
            if how == "stop":
                stop_children([child])
                assert child.process.returncode == 0
            else:
                os.kill(service_pid, signal.SIGKILL)
            assert all(gone_within(pid, 10) for pid in workers), how
        finally:
            stop_children([child])
