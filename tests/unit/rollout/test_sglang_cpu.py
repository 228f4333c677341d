"""The import stand-ins of SGLang's CPU path (servers/rollout/sglang_cpu), each in a Python of
its own with the stand-ins on its path, as the SGLang server a rollout server launches has
them; and the launched server's command line. (That SGLang itself imports and serves with
them: tests/system/sglang_rollout.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from areal_servers.rollout.sglang_server import STAND_INS, launch_argv, launch_env, sglang_python

from areal_grpc.config import SglangSettings
from areal_grpc.errors import FieldError


def run_with_stand_ins(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(STAND_INS)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_assign_req_to_token_pool_cpu_writes_each_requests_slots_into_its_row():
    out = run_with_stand_ins(
        """
import json, torch
from sgl_kernel import assign_req_to_token_pool_cpu
table = torch.full((4, 8), -1, dtype=torch.int32)
# Request row 2 takes slots [2, 5) and row 0 slots [0, 2) (a new one): 5 slots in all.
assign_req_to_token_pool_cpu(
    torch.tensor([2, 0]), table, torch.tensor([2, 0]), torch.tensor([5, 2]),
    torch.tensor([40, 41, 42, 50, 51], dtype=torch.int64), 8,
)
print(json.dumps(table.tolist()))
"""
    )
    table = json.loads(out)
    want = [[-1] * 8 for _ in range(4)]
    want[2][2:5] = [40, 41, 42]
    want[0][0:2] = [50, 51]
    assert table == want


def test_every_other_kernel_name_and_submodule_imports_and_raises_naming_itself():
    out = run_with_stand_ins(
        """
import json
import sgl_kernel
from sgl_kernel.kvcacheio import transfer_kv_per_layer
from sgl_kernel.scalar_type import scalar_types
constant = scalar_types.uint4b8
said = []
for call in (lambda: sgl_kernel.fused_add_rmsnorm(1), lambda: transfer_kv_per_layer(), constant):
    try:
        call()
        said.append("no error")
    except NotImplementedError as exc:
        said.append(str(exc))
print(json.dumps(said))
"""
    )
    said = json.loads(out)
    names = [
        "sgl_kernel.fused_add_rmsnorm",
        "sgl_kernel.kvcacheio.transfer_kv_per_layer",
        "sgl_kernel.scalar_type.scalar_types.uint4b8",
    ]
    for message, name in zip(said, names, strict=True):
        assert message.startswith(f"{name}: SGLang's CPU kernel package is not installed"), said


def test_sitecustomize_declares_torchvisions_nms_schemas_at_start_up():
    out = run_with_stand_ins(
        """
import torch
print(torch.ops.torchvision.nms.default._schema)
print(torch.ops.torchvision.qnms.default._schema)
"""
    )
    assert "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor" in out
    assert "torchvision::qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor" in out


def test_a_cpu_launch_takes_sglangs_cpu_path_with_the_stand_ins_and_fp32():
    argv = launch_argv("py", "/model", 30000, SglangSettings(kv_cache_tokens=2048), gpu=False)
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    joined = " ".join(argv)
    for flag in (
        "--dtype float32",
        "--attention-backend torch_native",
        "--device cpu",
        "--max-total-tokens 2048",
        "--skip-tokenizer-init",
        "--sleep-on-idle",
    ):
        assert flag in joined, flag
    env = launch_env(gpu=False)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(STAND_INS)
    gpu = launch_argv("py", "/model", 30000, SglangSettings(), dtype="bfloat16", gpu=True)
    assert "--device" not in gpu and "--attention-backend" not in gpu
    assert gpu[gpu.index("--dtype") + 1] == "bfloat16"
    assert launch_env(gpu=True).get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def test_a_python_without_sglang_is_refused_naming_the_setting(tmp_path):
    # A Python whose `import sglang` probe fails: sglang's find_spec comes back None.
    bare = tmp_path / "python"
    bare.write_text("#!/bin/sh\nexit 1\n")
    bare.chmod(0o755)
    with pytest.raises(FieldError) as info:
        sglang_python(SglangSettings(python=str(bare)))
    assert info.value.field == "rollout.sglang.python"
    assert "./scripts/setup --sglang" in str(info.value)
    with pytest.raises(FieldError) as missing:
        sglang_python(SglangSettings(python=str(tmp_path / "no-python")))
    assert missing.value.field == "rollout.sglang.python"
