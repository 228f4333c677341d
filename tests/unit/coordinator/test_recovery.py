"""Unit tests of checkpoints, resume and trainer-group recovery, in-process.

The collaborators are fakes (tests/support/fakes.py); the same behaviour through a real
mesh is tested by tests/e2e/coordinator/test_faults.py (a lost rank) and test_run.py (a
killed run resumed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.trainer_group import TrainerGroupFailed
from tests.support.coordinator import ECHO_PROMPTS, small_run, trained_groups
from tests.support.fakes import FakeMesh


def run(mesh: FakeMesh, cfg: Any, resume: bool = False) -> Any:
    return mesh.run(cfg, resume=resume)[0]


def records(cfg: Any, kind: str) -> list[dict]:
    return [r for r in read_jsonl(Path(cfg.output.dir) / "metrics.jsonl") if r["kind"] == kind]


def trained_items(cfg: Any) -> list[str]:
    return [g["item_id"] for g in trained_groups(Path(cfg.output.dir))]


def test_a_failed_step_restarts_the_group_from_the_checkpoint_and_redoes_what_followed(tmp_path):
    steps = ECHO_PROMPTS // 2
    cfg = small_run(
        tmp_path,
        f"total_steps={steps}",
        "staleness.max_staleness=0",
        "checkpoint.every_steps=4",
    )
    mesh = FakeMesh(rollouts=2, ranks=2)
    for rank in mesh.ranks.values():
        rank.fail_at_steps = {6}

    result = run(mesh, cfg)

    assert result.steps == steps and result.trainer_restarts == 1 and mesh.restarts == 1
    [recovery] = records(cfg, "recovery")
    assert recovery["step"] == 4 and recovery["failed_at_step"] == 6
    assert recovery["cause"].startswith("UNAVAILABLE")
    # The ranks restored the checkpoint of step 4 and went on above every version the
    # rollout servers had served (6: they refuse weights that are not newer).
    for rank in mesh.ranks.values():
        [(path, floor)] = rank.loads
        assert path.endswith("step-000004/trainer") and floor == 7
    train = records(cfg, "train")
    # Steps 5 and 6 were redone; their first records were replaced.
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert [r["trainer_restarts"] for r in train] == [0] * 4 + [1] * (steps - 4)
    assert [r["version"] for r in train][4:] == list(range(8, 8 + steps - 4))
    # Every prompt of the epoch trained exactly once in the final accounting, and every
    # server was brought to the final version.
    assert sorted(trained_items(cfg)) == sorted(f"echo-train-{i}" for i in range(ECHO_PROMPTS))
    assert [s.version for s in mesh.rollouts.values()] == [result.version] * 2


def test_a_group_failure_before_the_first_checkpoint_fails_the_run_naming_the_key(tmp_path):
    cfg = small_run(tmp_path, "total_steps=6", "checkpoint.every_steps=0")
    mesh = FakeMesh()
    mesh.ranks["trainer-0"].fail_at_steps = {2}
    with pytest.raises(TrainerGroupFailed, match=r"before the first checkpoint.*every_steps=0"):
        run(mesh, cfg)
    assert mesh.restarts == 0


def test_restarts_stop_at_trainer_max_restarts(tmp_path):
    cfg = small_run(
        tmp_path,
        "total_steps=10",
        "checkpoint.every_steps=2",
        "fault_tolerance.trainer.max_restarts=1",
    )
    mesh = FakeMesh()
    # Fails at step 3 (restored to 2, redone), then at step 5: the second failure is one
    # restart too many.
    mesh.ranks["trainer-0"].fail_at_steps = {3, 5}
    with pytest.raises(
        TrainerGroupFailed,
        match=r"after 1 restart\(s\) \(fault_tolerance\.trainer\.max_restarts=1\)",
    ):
        run(mesh, cfg)
    assert mesh.restarts == 1


def test_resume_goes_on_from_the_checkpoint_with_the_prompts_not_yet_trained(tmp_path):
    # The first run stops at step 8, its last checkpoint; the second goes on to 18 (one epoch).
    first = small_run(tmp_path, "total_steps=8", "checkpoint.every_steps=4")
    mesh = FakeMesh()
    run(mesh, first)
    served_before = [s.version for s in mesh.rollouts.values()]
    syncs_before = len(mesh.syncs)
    received_before = {a: len(s.received) for a, s in mesh.rollouts.items()}

    second = small_run(tmp_path, f"total_steps={ECHO_PROMPTS // 2}", "checkpoint.every_steps=4")
    result = run(mesh, second, resume=True)

    assert result.steps == ECHO_PROMPTS // 2
    rank = mesh.ranks["trainer-0"]
    [(path, floor)] = rank.loads
    assert path.endswith("step-000008/trainer") and floor == max(served_before) + 1
    # The servers were given the restored weights before any rollout of the second run.
    resumed_sync = mesh.syncs[syncs_before]
    assert resumed_sync[1] == floor
    for a, server in mesh.rollouts.items():
        assert min(server.received_at[received_before[a] :]) >= floor
    # Steps 9.. only, and the metrics of both runs read as one run.
    assert [step for step, _ in rank.trained[8:]] == list(range(8, ECHO_PROMPTS // 2))
    assert [r["step"] for r in records(second, "train")] == list(range(1, ECHO_PROMPTS // 2 + 1))
    # Across both runs every prompt of the epoch was trained exactly once.
    assert sorted(trained_items(second)) == sorted(f"echo-train-{i}" for i in range(ECHO_PROMPTS))
