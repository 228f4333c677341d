"""A whole run on vLLM (``python -m areal_grpc.coordinator rollout.engine=vllm``), through
the failures a user can cause: vLLM's engine process killed under load, then a rollout server
killed.

Each kill lands while the coordinator is paused, with steps left that only a rollout server
can feed, so the replacement cannot be skipped by a run that ends first (the first with 64
episodes in flight). Neither ends in a hang: the server
whose vLLM died exits, the launcher replaces both, and no vLLM process of a killed server is
left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil

from areal_grpc.coordinator.metrics import read_jsonl

STEPS = 10
# The example's load (8 prompts x 8 samples): at least 64 episodes in flight on the server
# when its engine dies, every one of them failed by vLLM at once.
IN_FLIGHT = 64
BATCH = 64
LOADED = (
    f"total_steps={STEPS}",
    f"staleness.batch_size={BATCH}",
    "rollout.max_concurrent_rollouts=128",
    # Long generations (the random-init model rarely samples its EOS), so that the episodes
    # are still running when the kill lands.
    "rollout.sampling.max_new_tokens=96",
    "rollout.vllm.max_num_seqs=256",
)
VLLM_RUN = (
    "model.source=builtin:tiny",
    "rollout.engine=vllm",
    # fp32: in bf16 vLLM drains its episodes fast enough that 64 in flight were first seen
    # after 6 of the 10 steps (CI), too late for a second kill that needs a rollout server.
    "rollout.dtype=float32",
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


def running_episodes(address: str) -> int:
    """Episodes the rollout server at ``address`` is running now (0 when it does not answer)."""
    from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc

    from areal_grpc.server import sync_channel

    channel = sync_channel(address)
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        st = stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5)
        return st.running_episodes
    except Exception:
        return 0
    finally:
        channel.close()


def test_killed_vllm_processes_and_servers_are_replaced_and_the_run_finishes(
    vllm_installed, tmp_path, coordinator_command
):
    """vLLM's engine process is killed under the example's load (64 episodes in flight, as
    its 8 prompts x 8 samples are), then a rollout server is killed. Not one episode counts as
    failed (the run would stop at fault_tolerance.rollout.max_failed_episodes=64, as it did
    before a dead engine was told apart from the run's own code); every step is trained once,
    on distinct groups."""
    out = tmp_path / "run"
    proc = coordinator_command.start(out, *coordinator_command.SMALL_RUN, *VLLM_RUN, *LOADED)
    coordinator_command.address(proc)
    wait_for(lambda: coordinator_command.trained_steps(out) >= 1, what="a step")
    wait_for(lambda: rollout_child(out, "rollout-0") is not None, what="mesh.json")
    first = rollout_child(out, "rollout-0")
    assert first is not None
    first_vllm = vllm_processes(first["pid"])
    [engine_core] = [p for p in first_vllm if "EngineCore" in p.name()]
    # 1. vLLM's engine process dies under load: its server exits and is replaced.
    wait_for(
        lambda: running_episodes(first["address"]) >= IN_FLIGHT,
        timeout=300,
        what=f"{IN_FLIGHT} episodes in flight",
    )
    with coordinator_command.paused(proc.pid, out) as trained:
        print(f"first kill after {trained} steps")
        assert coordinator_command.needs_rollouts_after(trained, STEPS), trained
        engine_core.send_signal(signal.SIGKILL)
    wait_for(lambda: rollout_child(out, "rollout-1") is not None, what="a replacement")
    second = rollout_child(out, "rollout-1")
    assert second is not None
    wait_for(lambda: len(vllm_processes(second["pid"])) >= 2, what="its vLLM")
    # 2. The rollout server itself is killed as soon as its vLLM runs (its vLLM processes
    # cannot be stopped by it). Not after a step of its own: the groups generated before the
    # first kill feed the trainer meanwhile, and a step from the replacement could come with
    # the run's last (the CI run where this waited for one found 8 of 10 steps trained).
    with coordinator_command.paused(proc.pid, out) as trained:
        second_vllm = vllm_processes(second["pid"])
        print(f"second kill after {trained} steps")
        assert coordinator_command.needs_rollouts_after(trained, STEPS), trained
        os.kill(second["pid"], signal.SIGKILL)
    # (A run still going at the end is stopped by the fixture as Ctrl-C does, with its mesh: a
    # killed coordinator would leave its servers running.)
    log = coordinator_command.finish(proc, timeout=900)
    assert proc.returncode == 0, log
    assert f"done: {STEPS} steps" in log
    assert "episodes in a row failed" not in log
    # No episode was reported FAILED (the coordinator's line), nor failed on the server.
    assert re.search(r"episode \S+ failed on", log) is None
    restarts = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "rollout_restart"]
    assert [r["old_address"] for r in restarts] == [first["address"], second["address"]]
    assert all("process is gone" in r["cause"] for r in restarts), restarts
    # The first server said why it went, once, and failed no episode.
    first_log = (out / "logs" / "rollout-0.log").read_text()
    assert first_log.count("vllm engine failed: its engine process died") == 1
    assert re.search(r"episode \S+ failed:", first_log) is None
    # Nothing of either killed server's vLLM is left running.
    wait_for(lambda: gone(first_vllm) and gone(second_vllm), timeout=60, what="vLLM leftovers")
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    groups = [g for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    assert len({g["task_id"] for g in groups}) == len(groups) == STEPS * BATCH
