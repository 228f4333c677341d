"""output.wandb: a real run's metrics and samples in Weights & Biases, offline (no network),
read back with W&B's own reader of its run files (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_grpc.coordinator.metrics import SAMPLE_COLUMNS, read_jsonl

pytestmark = pytest.mark.slow

STEPS = 3


def inspect(run_dir: Path, *flags: str) -> str:
    """What ``wandb leet inspect`` prints for the run in ``run_dir``."""
    argv = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(run_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows the run logged, in order."""
    records = [json.loads(line) for line in inspect(run_dir).splitlines() if line.strip()]
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def test_a_run_with_wandb_logs_each_steps_metrics_and_samples_table(
    tmp_path: Path, coordinator_command
) -> None:
    # No skip without wandb (the dev extra installs it): the run then fails, naming output.wandb.
    out = tmp_path / "run"
    code, log = coordinator_command.run(
        out,
        *coordinator_command.SMALL_RUN,
        f"total_steps={STEPS}",
        "output.wandb=true",
        "output.wandb_name=tiny-echo",
        # W&B's own variables apply where the config leaves a setting null.
        env={"WANDB_MODE": "offline", "WANDB_PROJECT": "from-env"},
        unset_env=("WANDB_DIR", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_API_KEY"),
    )
    assert code == 0, log
    # Without WANDB_DIR, W&B's files go under output.dir.
    (run_dir,) = (out / "wandb").glob("offline-run-*")

    summary = json.loads(inspect(run_dir, "--summary"))
    assert (summary["project"], summary["name"], summary["state"]) == (
        "from-env",
        "tiny-echo",
        "finished",
    )
    assert summary["config"]["total_steps"] == STEPS

    rows = history(run_dir)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    logged = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in logged] == [r["step"] for r in train]
    for want, got in zip(train, logged, strict=True):
        numbers = {
            f"train/{k}": v
            for k, v in want.items()
            if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        assert {k: got[k] for k in numbers} == numbers

    # Each step's samples: a table at the step they were trained in, holding the records of
    # rollouts/step-<s>.jsonl.
    tables = [r for r in rows if r.get("samples._type") == "table-file"]
    assert [r["step"] for r in tables] == list(range(1, STEPS + 1))
    for row in tables:
        written = read_jsonl(out / "rollouts" / f"step-{row['step'] - 1:06d}.jsonl")
        table = json.loads((run_dir / "files" / row["samples.path"]).read_text())
        assert table["columns"] == list(SAMPLE_COLUMNS)
        assert row["samples.nrows"] == len(table["data"]) == len(written) > 0
        for cells, record in zip(table["data"], written, strict=True):
            shown = dict(zip(SAMPLE_COLUMNS, cells, strict=True))
            assert (shown["task_id"], shown["reward"], shown["completion"]) == (
                record["task_id"],
                record["reward"],
                record["completion"],
            )
