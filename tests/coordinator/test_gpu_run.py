"""``python -m areal_grpc.coordinator`` on a GPU machine (skipped cleanly without CUDA).

The built-in default picks its devices itself: rollout servers on the GPU, and trainer ranks on
the GPUs when there is one per rank (FSDP2 over nccl), else on the CPU (over gloo) with a
warning. NCCL cannot put two ranks on one GPU, so on a single GPU the weights reach the servers
by the next offered method.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and -m gpu)"),
]

STEPS = 6


def run(out: Path, *overrides: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_grpc.coordinator",
            f"output.dir={out}",
            "output.progress_bar=false",
            f"total_steps={STEPS}",
            "eval.every_steps=3",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def trained_steps(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_default_run_trains_on_the_gpu(tmp_path: Path, ranks: int) -> None:
    out = tmp_path / f"ranks{ranks}"
    text = run(out, f"trainer.ranks={ranks}")
    steps = trained_steps(out)
    assert len(steps) == STEPS
    logs = out / "logs"
    assert "on cuda" in (logs / "rollout-0.log").read_text()
    trainer0 = (logs / "trainer-0.log").read_text()
    if torch.cuda.device_count() >= ranks:
        assert f"trainer rank 0/{ranks} ready (nccl" in trainer0
    else:
        assert f"trainer rank 0/{ranks} ready (gloo" in trainer0
        assert "training on the CPU" in text
    # Every step's weights reached the server: it serves the last version.
    assert f"policy version {STEPS}" in (logs / "rollout-0.log").read_text()
