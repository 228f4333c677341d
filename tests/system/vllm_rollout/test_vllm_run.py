"""A whole run on vLLM (``python -m areal_grpc.coordinator rollout.engine=vllm``), through
the failures a user can cause: vLLM's engine process killed, then a rollout server killed.

Each kill lands while the coordinator is paused with steps left that only a rollout server
can feed, so the replacement cannot be skipped by a run that ends first. Neither ends in a
hang: the server whose vLLM died exits (its watchdog), the launcher replaces both, and no
vLLM process of a killed server is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil

from areal_grpc.coordinator.metrics import read_jsonl

STEPS = 12
VLLM_RUN = (
    "model.source=builtin:tiny",
    "rollout.engine=vllm",
    "rollout.vllm.kv_cache_gib=0.25",
    "rollout.vllm.max_model_len=256",
    "rollout.vllm.health_interval_s=1",
    "rollout.vllm.health_timeout_s=10",
)


def wait_for(cond, timeout: float = 600.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.3)


def rollout_child(out: Path, name: str) -> dict | None:
    """``name``'s entry in mesh.json (None until it is listed)."""
    try:
        children = json.loads((out / "mesh.json").read_text())["children"]
    except (OSError, ValueError):
        return None
    return next((c for c in children if c["name"] == name), None)


def vllm_processes(pid: int) -> list[psutil.Process]:
    """vLLM's engine and worker processes under a rollout server."""
    procs = psutil.Process(pid).children(recursive=True)
    return [p for p in procs if p.name().startswith("VLLM::")]


def gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def test_killed_vllm_processes_and_servers_are_replaced_and_the_run_finishes(
    vllm_installed, tmp_path, coordinator_command
):
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out, *coordinator_command.SMALL_RUN, *VLLM_RUN, f"total_steps={STEPS}"
    )
    coordinator_command.address(proc)
    try:
        wait_for(lambda: coordinator_command.trained_steps(out) >= 2, what="two steps")
        first = rollout_child(out, "rollout-0")
        assert first is not None
        first_vllm = vllm_processes(first["pid"])
        [engine_core] = [p for p in first_vllm if "EngineCore" in p.name()]
        # 1. vLLM's engine process dies: its server exits and is replaced.
        with coordinator_command.paused(proc.pid, out) as trained:
            assert coordinator_command.needs_rollouts_after(trained, STEPS), trained
            engine_core.send_signal(signal.SIGKILL)
        wait_for(lambda: rollout_child(out, "rollout-1") is not None, what="a replacement")
        second = rollout_child(out, "rollout-1")
        assert second is not None
        wait_for(lambda: len(vllm_processes(second["pid"])) >= 2, what="its vLLM")
        second_vllm = vllm_processes(second["pid"])
        wait_for(lambda: coordinator_command.trained_steps(out) > trained, what="a step after it")
        # 2. The rollout server itself is killed: its vLLM processes cannot be stopped by it.
        with coordinator_command.paused(proc.pid, out) as trained:
            assert coordinator_command.needs_rollouts_after(trained, STEPS), trained
            os.kill(second["pid"], signal.SIGKILL)
        log = coordinator_command.finish(proc, timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log
    assert f"done: {STEPS} steps" in log
    restarts = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "rollout_restart"]
    assert [r["old_address"] for r in restarts] == [first["address"], second["address"]]
    assert all("process is gone" in r["cause"] for r in restarts), restarts
    # The first server said why it went: its watchdog saw vLLM's engine process die.
    first_log = (out / "logs" / "rollout-0.log").read_text()
    assert "vllm engine failed: its engine process died" in first_log
    # Nothing of either killed server's vLLM is left running.
    wait_for(lambda: gone(first_vllm) and gone(second_vllm), timeout=60, what="vLLM leftovers")
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
