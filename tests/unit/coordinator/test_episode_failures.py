"""Episodes that fail (a reward function or workflow raising) against the run's progress, on
fakes (tests/support/fakes.py): an error on every episode stops the run with that error,
instead of going through the dataset forever; an error now and then is survived. Through a
real mesh: tests/e2e/test_guides.py."""

from __future__ import annotations

import itertools

import pytest
from arealgrpc.v1 import rollout_pb2

from areal_grpc.coordinator.rollout_fleet import EpisodesFailing
from tests.support import fakes
from tests.support.coordinator import small_run, trained_groups
from tests.support.fakes import FakeMesh

# fault_tolerance.rollout.max_failed_episodes for these runs (the default, 64, takes longer).
BOUND = 16


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
        mesh.run(
            small_run(
                tmp_path, "total_steps=5", f"fault_tolerance.rollout.max_failed_episodes={BOUND}"
            )
        )
    assert f"{BOUND} episodes in a row failed in the run's own code" in str(err.value)
    # It stopped soon after the bound: what was in flight then, not the dataset.
    sent = sum(len(s.received) for s in mesh.rollouts.values())
    assert BOUND <= sent < 2 * BOUND


def test_an_error_now_and_then_does_not_stop_the_run(tmp_path, monkeypatch):
    # Every other episode fails: far more failures than the bound in all, never that many
    # in a row.
    flips = itertools.cycle([True, False])
    answer_failed_when(monkeypatch, lambda: next(flips))
    steps = 2 * BOUND  # 2 groups a step: twice as many failures as the bound over the run
    mesh = FakeMesh(rollouts=1)
    mesh.run(
        small_run(
            tmp_path,
            f"total_steps={steps}",
            f"fault_tolerance.rollout.max_failed_episodes={BOUND}",
        )
    )
    assert len(trained_groups(tmp_path / "run")) == 2 * steps
