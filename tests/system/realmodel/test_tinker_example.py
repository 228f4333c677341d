"""The documented Tinker example, as the guide runs it: ``python -m areal_grpc.tinker`` on its
default model (SmolLM2-135M-Instruct), then ``examples/tinker_sft.py`` through the SDK."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from areal_grpc.launch import python_module_argv, start_child, stop_children
from tests.support.paths import ROOT


def test_the_tinker_example_learns_its_fact_on_the_default_service(
    real_model_dir: str, tmp_path: Path
):
    """The example's loss per answer token falls over its 12 steps and the saved sampler
    answers with the fact it was taught (docs/guides/tinker.md)."""
    child = start_child(
        "tinker",
        python_module_argv("areal_grpc.tinker", f"output.dir={tmp_path / 'run'}"),
        log_dir=tmp_path / "logs",
    )
    try:
        log = (tmp_path / "logs" / "tinker.log").read_text()
        # Printed before LISTENING, which start_child waits for.
        key = re.search(r"TENANT default key (tml-\S+)", log)
        assert key, log
        env = {
            **os.environ,
            "TINKER_BASE_URL": f"http://{child.address}",
            "TINKER_API_KEY": key.group(1),
            "TINKER_TELEMETRY": "0",
        }
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "tinker_sft.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        losses = [float(x) for x in re.findall(r"loss per answer token ([\d.]+)", done.stdout)]
        assert len(losses) == 12 and losses[-1] < 0.1 * losses[0], done.stdout
        assert "Heliotrope" in done.stdout.splitlines()[-1], done.stdout
    finally:
        stop_children([child])
