"""Episodes that fail (a reward function or workflow raising) against the run's progress, on
fakes (tests/support/fakes.py): an error on every episode stops the run with that error,
instead of going through the dataset forever; an error now and then is survived. Through a
real mesh: tests/e2e/test_guides.py."""

from __future__ import annotations

import itertools

import pytest
from arealgrpc.v1 import rollout_pb2

from areal_grpc.coordinator.rollout_fleet import FAILED_IN_A_ROW, EpisodesFailing
from tests.support import fakes
from tests.support.coordinator import small_run, trained_groups
from tests.support.fakes import FakeMesh


def answer_failed_when(monkeypatch: pytest.MonkeyPatch, fails) -> None:
    """The fake servers answer FAILED (KeyError, as a raising reward does) where ``fails()``."""
    accept = fakes.FakeStream.submit

    def submit(self: fakes.FakeStream, task: rollout_pb2.EpisodeTask) -> None:
        if task.eval or not fails():
            accept(self, task)
            return
        self.server.received.append(task.task_id)
        self._out.put_nowait(
            rollout_pb2.RunEpisodesResponse(
                task_id=task.task_id,
                outcome=rollout_pb2.EPISODE_OUTCOME_FAILED,
                reason="KeyError: 'no_such_key'",
            )
        )

    monkeypatch.setattr(fakes.FakeStream, "submit", submit)


def test_an_error_on_every_episode_stops_the_run_naming_it(tmp_path, monkeypatch):
    answer_failed_when(monkeypatch, lambda: True)
    mesh = FakeMesh(rollouts=2)
    with pytest.raises(EpisodesFailing, match=r"KeyError: 'no_such_key'") as err:
        mesh.run(small_run(tmp_path, "total_steps=5"))
    assert f"{FAILED_IN_A_ROW} episodes in a row failed" in str(err.value)
    # It stopped soon after the bound: what was in flight then, not the dataset.
    sent = sum(len(s.received) for s in mesh.rollouts.values())
    assert FAILED_IN_A_ROW <= sent < 2 * FAILED_IN_A_ROW


def test_an_error_now_and_then_does_not_stop_the_run(tmp_path, monkeypatch):
    # Every other episode fails: far more failures than the bound in all, never that many
    # in a row.
    flips = itertools.cycle([True, False])
    answer_failed_when(monkeypatch, lambda: next(flips))
    steps = FAILED_IN_A_ROW  # 2 groups a step: as many failures as the bound over the run
    mesh = FakeMesh(rollouts=1)
    mesh.run(small_run(tmp_path, f"total_steps={steps}"))
    assert len(trained_groups(tmp_path / "run")) == 2 * steps
