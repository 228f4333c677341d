"""Why SGLang's CPU launch carries the stand-ins of servers/rollout/sglang_cpu: without each,
SGLang's own venv (./scripts/setup --sglang) cannot import what its server imports on a CPU.
(With both it imports and serves: every other test here.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from areal_servers.rollout.sglang_server import STAND_INS, sglang_python

from areal_grpc.config import SglangSettings

# A module SGLang's CPU scheduler imports, which reaches both.
SCHEDULER_IMPORT = "import sglang.srt.mem_cache.allocation"


def run_in_sglang(code: str, path: Path | None) -> subprocess.CompletedProcess[str]:
    """``code`` in SGLang's venv on its CPU platform, ``path`` alone on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if path is not None:
        env["PYTHONPATH"] = str(path)
    python = sglang_python(SglangSettings())
    return subprocess.run(
        [python, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_without_either_stand_in_sglangs_cpu_path_does_not_import(sglang_installed, tmp_path):
    bare = run_in_sglang(SCHEDULER_IMPORT, None)
    assert bare.returncode != 0
    assert "operator torchvision::nms does not exist" in bare.stderr
    # With torchvision's schemas declared, the kernel package is missing next.
    shutil.copy(STAND_INS / "sitecustomize.py", tmp_path / "sitecustomize.py")
    schemas_only = run_in_sglang(SCHEDULER_IMPORT, tmp_path)
    assert schemas_only.returncode != 0
    assert "No module named 'sgl_kernel'" in schemas_only.stderr
