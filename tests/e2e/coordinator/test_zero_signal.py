"""A run that learns nothing says so: when every group's rewards are equal for several steps
in a row, every advantage is 0, and the run prints one line saying that and which settings
give groups a signal. Real runs (``python -m areal_grpc.coordinator`` as a subprocess, real
servers on loopback); the watch itself: tests/unit/coordinator/test_zero_signal.py."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai

from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.run_log import ZERO_SIGNAL_STEPS

WARNING = "no learning signal in steps"


WARNING = "no learning signal in steps"


def warnings(out: str) -> list[str]:
    return [line for line in out.splitlines() if WARNING in line]


def test_a_greedy_run_learns_nothing_and_says_so_once_naming_the_settings(
    tmp_path: Path, coordinator_command
) -> None:
    """Temperature 0: the samples of a prompt are all alike, so every group's rewards are
    equal and the trainer reports advantages of exactly 0. After 3 such steps the run says
    so, once per 3, naming the settings that help; its metrics count 0 groups with a signal."""
    out = tmp_path / "run"
    code, log = coordinator_command.run(
        out, *coordinator_command.SMALL_RUN, "total_steps=4", "rollout.sampling.temperature=0"
    )
    assert code == 0, log
    (line,) = warnings(log)
    assert f"{WARNING} 1-3 (3 in a row)" in line
    assert "reward was constant within every group" in line and "nothing was learned" in line
    for setting in (
        "staleness.group_size",
        "rollout.sampling.temperature",
        "rollout.workflow_params.accept=nonuniform",
    ):
        assert setting in line, line
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["signal_groups"] for r in steps] == [0, 0, 0, 0]


def test_gateway_sessions_of_one_reply_teach_nothing_and_the_run_says_why(
    tmp_path: Path, coordinator_command
) -> None:
    """``data.task=external``: an agent that opens sessions with ``group_size`` 1 (one reply
    each) under the default GRPO group centring: every reply is centred on itself. The run
    says so after 3 steps, naming sessions of one sample and what to send instead."""
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out,
        *coordinator_command.SMALL_RUN,
        "data.task=external",
        f"total_steps={ZERO_SIGNAL_STEPS}",
        "gateway.enabled=true",
    )
    coordinator_command.address(proc)
    assert proc.stdout is not None
    seen: list[str] = []
    line = proc.stdout.readline()
    while line and not line.startswith("GATEWAY"):
        seen.append(line)
        line = proc.stdout.readline()
    base = line.split()[1].removesuffix("/v1")
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    drain.start()
    for _ in range(ZERO_SIGNAL_STEPS * 2):  # staleness.batch_size=2 sessions a step
        while (
            r := httpx.post(f"{base}/rl/sessions", json={"group_size": 1}, timeout=30)
        ).status_code == 429:
            pass
        sid = r.json()["session_id"]
        c = openai.OpenAI(
            base_url=f"{base}/v1", api_key="x", max_retries=0, default_headers={"X-Session-Id": sid}
        )
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "a="}])
        reply = httpx.post(f"{base}/rl/sessions/{sid}/reward", json={"reward": 1.0}, timeout=30)
        assert reply.json()["accepted"] is True, reply.text
    assert proc.wait(timeout=120) == 0
    drain.join(timeout=10)
    (line,) = warnings("".join(seen + rest))
    assert "2 of 2 groups had one sample" in line and "group_size 1" in line, line
    assert "more samples per session" in line and "partial credit" in line, line
