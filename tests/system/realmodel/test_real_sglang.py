"""The real-model example (``examples/smollm2_arith.yaml``: SmolLM2-135M-Instruct, GRPO on the
arithmetic mix) with ``rollout.engine=sglang``: a real SGLang server (its CPU path here)
generates, the FSDP2 trainer trains, and every step's weights reach SGLang."""

from __future__ import annotations

import subprocess
import sys

from areal_grpc.coordinator.metrics import read_jsonl
from tests.support.paths import ROOT

STEPS = 3


def test_the_real_model_example_runs_on_sglang(
    sglang_installed, real_model_dir, tmp_path, coordinator_command
):
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "areal_grpc.data", "arith", "--out", str(data)],
        check=True,
        timeout=300,
    )
    out = tmp_path / "run"
    code, log = coordinator_command.run(
        out,
        "rollout.engine=sglang",
        f"total_steps={STEPS}",
        f"data.path={data / 'train.jsonl'}",
        f"data.eval_path={data / 'test.jsonl'}",
        "eval.max_prompts=8",
        timeout=1500,
        config=ROOT / "examples" / "smollm2_arith.yaml",
    )
    assert code == 0, log
    assert f"done: {STEPS} steps, version {STEPS}" in log
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # Each step trained a full batch of SGLang's samples (8 prompts x 8), from the versions
    # the staleness rule allows (max_staleness 0: the one just published).
    batches = read_jsonl(out / "batches.jsonl")
    assert [len(b["groups"]) for b in batches] == [8] * STEPS
    for b in batches:
        assert all(g["min_version"] >= b["version"] for g in b["groups"]), b
    rollout_log = (out / "logs" / "rollout-0.log").read_text()
    assert "sglang engine: " in rollout_log and "(launched)" in rollout_log
