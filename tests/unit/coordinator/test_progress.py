"""The run's progress display: the rich bar carries the train/rollout gap, the plain lines keep
their documented form."""

from __future__ import annotations

import io

import pytest

from areal_grpc.coordinator.__main__ import Progress


def test_the_bar_shows_the_latest_measured_gap_and_plain_lines_keep_their_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bar = Progress(True)
    bar.start(0, 3)
    try:
        bar._bar.console.file = io.StringIO()  # off the terminal
        bar.update({"step": 1, "reward_mean": 0.5, "version": 1, "step_s": 1.0})
        assert bar._bar.tasks[0].fields["gap"] == "-"
        record = {"step": 2, "reward_mean": 0.5, "version": 2, "step_s": 1.0}
        bar.update({**record, "logp_gap_mean": 1.6e-4})
        # A step that trained no fresh token measures no gap: the last one stays shown.
        bar.update({"step": 3, "reward_mean": 0.6, "version": 3, "step_s": 1.0})
        assert bar._bar.tasks[0].fields["gap"] == "1.6e-04"
    finally:
        bar.stop()
    plain = Progress(False)
    plain.update({**record, "logp_gap_mean": 1.6e-4, "eval_accuracy": 0.25})
    assert capsys.readouterr().out == "step 2: reward 0.500 eval 0.250 version 2 1.00 s/step\n"
