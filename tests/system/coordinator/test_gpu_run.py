"""``python -m areal_grpc.coordinator`` on a GPU machine (skipped cleanly without CUDA).

The built-in default picks its devices itself: rollout servers on the GPU, and trainer ranks on
the GPUs when there is one per rank (FSDP2 over nccl), else on the CPU (over gloo) with a
warning. NCCL cannot put two ranks on one GPU, so on a single GPU the weights reach the servers
by the next offered method.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and -m gpu)"),
]

STEPS = 6


def trained_steps(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_default_run_trains_on_the_gpu(tmp_path: Path, ranks: int, coordinator_command) -> None:
    out = tmp_path / f"ranks{ranks}"
    code, text = coordinator_command.run(
        out, f"total_steps={STEPS}", "eval.every_steps=3", f"trainer.ranks={ranks}", timeout=280
    )
    assert code == 0, text[-3000:]
    steps = trained_steps(out)
    assert len(steps) == STEPS
    # Shared prefixes (on by default) are computed once on the GPU too, over nccl with 2 ranks.
    assert all(0 < s["prefix_sharing_ratio"] < 1 for s in steps), steps
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
