"""A whole run on SGLang (``python -m areal_grpc.coordinator rollout.engine=sglang``), through
the failures a user can cause: SGLang's scheduler killed, then a rollout server killed.

Each kill lands while the coordinator is paused with steps left that only a rollout server
can feed, so the replacement cannot be skipped by a run that ends first. Neither ends in a
hang: the server whose SGLang died exits (its watchdog), the launcher replaces both, and no
SGLang process of a killed server is left behind.
"""

from __future__ import annotations

import os
import signal

import psutil

from areal_grpc.coordinator.metrics import read_jsonl
from tests.system.vllm_rollout.test_vllm_run import gone, rollout_child, wait_for

STEPS = 12
SGLANG_RUN = (
    "model.source=builtin:tiny",
    "rollout.engine=sglang",
    "rollout.sglang.kv_cache_tokens=4096",
    "rollout.sglang.health_interval_s=1",
    "rollout.sglang.health_timeout_s=10",
)


def sglang_processes(pid: int) -> list[psutil.Process]:
    """SGLang's server, scheduler and detokenizer processes under a rollout server."""
    procs = psutil.Process(pid).children(recursive=True)
    return [p for p in procs if p.name().startswith("sglang") or "sglang" in " ".join(p.cmdline())]


def test_killed_sglang_processes_and_servers_are_replaced_and_the_run_finishes(
    sglang_installed, tmp_path, coordinator_command
):
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out, *coordinator_command.SMALL_RUN, *SGLANG_RUN, f"total_steps={STEPS}"
    )
    coordinator_command.address(proc)
    wait_for(lambda: coordinator_command.trained_steps(out) >= 2, what="two steps")
    wait_for(lambda: rollout_child(out, "rollout-0") is not None, what="mesh.json")
    first = rollout_child(out, "rollout-0")
    assert first is not None
    first_sglang = sglang_processes(first["pid"])
    [scheduler] = [p for p in first_sglang if "scheduler" in p.name()]
    # 1. SGLang's scheduler dies: SGLang ends itself, its rollout server exits and is replaced.
    with coordinator_command.paused(proc.pid, out) as trained:
        assert coordinator_command.needs_rollouts_after(trained, STEPS), trained
        scheduler.send_signal(signal.SIGKILL)
    wait_for(lambda: rollout_child(out, "rollout-1") is not None, what="a replacement")
    second = rollout_child(out, "rollout-1")
    assert second is not None
    wait_for(lambda: len(sglang_processes(second["pid"])) >= 3, what="its SGLang")
    # 2. The rollout server itself is killed as soon as its SGLang runs (a step of its own
    # could come with the run's last, see test_vllm_run.py): its SGLang dies with it.
    with coordinator_command.paused(proc.pid, out) as trained:
        second_sglang = sglang_processes(second["pid"])
        assert coordinator_command.needs_rollouts_after(trained, STEPS), trained
        os.kill(second["pid"], signal.SIGKILL)
    log = coordinator_command.finish(proc, timeout=900)
    assert proc.returncode == 0, log
    assert f"done: {STEPS} steps" in log
    restarts = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "rollout_restart"]
    assert [r["old_address"] for r in restarts] == [first["address"], second["address"]]
    assert all("process is gone" in r["cause"] for r in restarts), restarts
    # The first server said why it went: its watchdog saw SGLang's server end.
    first_log = (out / "logs" / "rollout-0.log").read_text()
    assert "sglang engine failed: its server process" in first_log
    wait_for(
        lambda: gone(first_sglang) and gone(second_sglang), timeout=60, what="SGLang leftovers"
    )
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    groups = [g for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    assert len({g["task_id"] for g in groups}) == len(groups)
