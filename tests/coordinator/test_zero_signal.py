"""A run that learns nothing says so: when every group's rewards are equal for several steps
in a row, every advantage is 0, and the run prints one line saying that and which settings
give groups a signal. Real runs (``python -m areal_grpc.coordinator`` as a subprocess, real
servers on loopback) and the trainer's own advantage statistics."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
from arealgrpc.v1 import trainer_pb2

from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.pool import Finished, Work
from areal_grpc.coordinator.run_log import ZERO_SIGNAL_STEPS, SignalWatch, zero_signal_steps
from areal_grpc.trajectory import make_group

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


def _finished(rewards: list[float]) -> Finished:
    return Finished(Work(0, "t"), make_group("t", rewards), 0, len(rewards))


def test_the_watch_counts_steps_in_a_row_and_a_step_with_a_signal_resets_it() -> None:
    """The trainer's advantage statistics decide (a KL penalty, say, leaves advantages with
    equal rewards); without them, equal rewards in every group do."""
    watch = SignalWatch(external=False)
    flat = trainer_pb2.StepStats(extra={"advantage_mean": 0.0, "advantage_std": 0.0})
    moving = trainer_pb2.StepStats(extra={"advantage_mean": 0.0, "advantage_std": 0.7})
    same = [_finished([1.0, 1.0]), _finished([0.0, 0.0])]
    assert watch.step(1, flat, same) is None and watch.step(2, flat, same) is None
    assert watch.step(3, moving, same) is None  # the trainer saw a signal: the count restarts
    assert [watch.step(s, flat, same) for s in (4, 5)] == [None, None]
    line = watch.step(6, flat, same)
    assert line is not None and line.startswith(f"{WARNING} 4-6 (3 in a row)")
    assert watch.step(7, trainer_pb2.StepStats(), [_finished([1.0, 0.0])]) is None
    assert watch.streak == 0
    assert [watch.step(s, trainer_pb2.StepStats(), same) for s in (8, 9, 10)][-1] is not None


def test_a_solved_task_is_told_apart_from_a_missing_signal() -> None:
    """Every sample at the best reward the run has seen (after steps that saw lower ones):
    the line says the task looks solved instead of suggesting settings."""
    watch = SignalWatch(external=True)
    flat = trainer_pb2.StepStats(extra={"advantage_mean": 0.0, "advantage_std": 0.0})
    learning = trainer_pb2.StepStats(extra={"advantage_mean": 0.0, "advantage_std": 0.5})
    assert watch.step(1, learning, [_finished([0.0, 1.0])]) is None
    solved = [_finished([1.0, 1.0]), _finished([1.0, 1.0])]
    lines = [watch.step(s, flat, solved) for s in (2, 3, 4)]
    assert lines[:2] == [None, None] and lines[2] is not None
    assert "looks solved" in lines[2] and "What helps" not in lines[2]
    # All wrong is no solution: the settings that help are named.
    stuck = SignalWatch(external=True)
    lines = [stuck.step(s, flat, [_finished([0.0, 0.0])]) for s in (1, 2, 3)]
    assert lines[2] is not None and "What helps" in lines[2] and "solved" not in lines[2]


def test_a_long_run_waits_longer_before_it_says_so() -> None:
    """The quick start (400 steps) often starts with a few steps without a single right
    sample and learns anyway: it says so after 8 steps in a row, the examples after 3."""
    assert [zero_signal_steps(n) for n in (8, 24, 150, 400)] == [3, 3, 3, 8]
