"""Unit tests of the rollout fleet's supervision (requeue, rejoin, a lost fleet), in-process.

The collaborators are fakes (tests/support/fakes.py); the same behaviour through a real
mesh is tested by tests/e2e/coordinator/test_faults.py and test_run.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from areal_grpc.coordinator.rollout_fleet import RolloutFleetLost
from tests.support.coordinator import ECHO_PROMPTS, small_run, trained_groups
from tests.support.fakes import FakeMesh


def trained_items(out: Path) -> list[str]:
    """Item ids of every group the run in ``out`` trained, in order."""
    return [g["item_id"] for g in trained_groups(out)]


def test_a_server_holding_tasks_past_the_episode_timeout_loses_them_to_the_other(tmp_path):
    steps = ECHO_PROMPTS // 2
    cfg = small_run(
        tmp_path,
        f"total_steps={steps}",
        # One batch per version: no prompt of the next epoch is trained before this one ends.
        "staleness.max_staleness=0",
        "fault_tolerance.rollout.episode_timeout_s=0.3",
        "fault_tolerance.rollout.health_interval_s=0",
    )
    mesh = FakeMesh(rollouts=2)
    hung = mesh.rollouts["rollout-0"]
    hung.hold = True

    result, stats = mesh.run(cfg)
    requeued = stats.requeued
    assert result.steps == steps
    items = trained_items(Path(cfg.output.dir))
    # Every prompt of the epoch trained exactly once, though some first went to the hung one.
    assert len(items) == ECHO_PROMPTS and len(set(items)) == ECHO_PROMPTS
    assert hung.received, "the hung server was never given a task"
    assert requeued >= len(set(hung.received)) > 0
    # What the hung server took was trained anyway, made by the other server.
    trained = mesh.trained_task_ids()
    assert set(hung.received) <= set(trained)


def test_a_broken_stream_requeues_its_tasks_and_the_server_rejoins_at_the_run_version(tmp_path):
    steps = 16
    cfg = small_run(tmp_path, f"total_steps={steps}", "fault_tolerance.rollout.health_interval_s=0")
    mesh = FakeMesh(rollouts=2)
    # Long enough for the server to be brought back (after 1 s) before the run ends.
    mesh.ranks["trainer-0"].step_s = 0.15
    flaky = mesh.rollouts["rollout-0"]
    mark: list[int] = []
    held: list[str] = []

    def on_step(record: dict) -> None:
        step = record["step"]
        if step == 2:
            # Tasks pile up on it (answered by nobody) ...
            flaky.hold = True
            mark.append(len(flaky.received))
        elif step == 4:
            # ... until its connection drops: they must go back to the queue.
            held.extend(flaky.received[mark[0] :])
            flaky.hold = False
            flaky.streams[-1].break_()

    result, stats = mesh.run(cfg, on_step=on_step)
    requeued = stats.requeued
    assert result.steps == steps
    assert held, "no task was held by the server before its stream broke"
    assert requeued >= len(set(held))
    trained = mesh.trained_task_ids()
    assert len(trained) == len(set(trained)), Counter(trained).most_common(3)
    # The held tasks were trained after all (re-queued, then made by a live server).
    assert set(held) <= set(trained)
    # A second stream was opened to it: it was brought back, at the version of the sync
    # that let it in, and every later sync reached it.
    assert len(flaky.streams) >= 2
    assert flaky.version == result.version == mesh.rollouts["rollout-1"].version


def test_with_no_server_in_rotation_the_run_fails_naming_the_key(tmp_path):
    cfg = small_run(
        tmp_path,
        "total_steps=50",
        "fault_tolerance.rollout.health_interval_s=0.2",
        "fault_tolerance.rollout.health_timeout_s=0.2",
        "fault_tolerance.rollout.no_server_timeout_s=1",
    )
    mesh = FakeMesh(rollouts=1)

    def on_step(record: dict) -> None:
        if record["step"] == 2:
            mesh.rollouts["rollout-0"].serving = False

    with pytest.raises(RolloutFleetLost, match=r"rollout\.no_server_timeout_s=1"):
        mesh.run(cfg, on_step=on_step)
