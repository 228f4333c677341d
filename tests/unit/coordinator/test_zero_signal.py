"""A run that learns nothing says so: the watch that counts steps in a row whose every group
had equal rewards (zero advantages) and the settings it names (the runs that print its line:
tests/e2e/coordinator/test_zero_signal.py)."""

from __future__ import annotations

from arealgrpc.v1 import trainer_pb2

from areal_grpc.coordinator.pool import Finished, Work
from areal_grpc.coordinator.run_log import SignalWatch, zero_signal_steps
from areal_grpc.trajectory import make_group

WARNING = "no learning signal in steps"


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
