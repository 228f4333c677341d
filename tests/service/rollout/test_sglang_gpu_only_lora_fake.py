"""LoRA on the ``sglang`` engine, against a fake SGLang HTTP server: SGLang serves LoRA
adapters on a GPU only (its CPU path pins host memory in its LoRA layers), so this checks the
protocol SGLang documents for them: each update a peft directory loaded with
``/load_lora_adapter`` as ``areal-v<version>``, generation naming it in ``lora_path``, and
``/unload_lora_adapter`` once no request uses the one it replaced. Everything else of the
engine is tested against SGLang's real server (tests/system/sglang_rollout)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.sglang_engine import SGLangEngine
from areal_servers.rollout.sglang_server import launch_argv
from peft import PeftModel

from areal_grpc.config import LoraSettings, SglangSettings
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.model import load_model
from tests.support.sglang import FakeSGLangHTTP


async def test_sglang_gpu_only_lora_fake_server_loads_an_adapter_per_version(tmp_path):
    """Requests name the adapter they were sent with and carry its version; a replaced adapter
    is unloaded (and its directory removed) only once its last request has finished."""
    fake = FakeSGLangHTTP()
    lora = LoraSettings(rank=4, alpha=8.0)
    engine = SGLangEngine(
        "builtin:micro", SglangSettings(weights_dir=str(tmp_path)), url=fake.url, lora=lora
    )
    try:
        await engine.start()
        cfg = SamplingConfig(temperature=0.0, max_new_tokens=1)
        model = load_model("builtin:micro", lora=lora)
        adapters = {n: torch.randn_like(p) for n, p in model.named_parameters() if p.requires_grad}
        # Before any update the base model serves (LoRA's B starts at zero): no lora_path.
        first = await engine.generate([3], cfg)
        assert "lora_path" not in fake.bodies("/generate")[0] and first.output_versions == [0]
        # A full state dict is not an adapter update: refused before SGLang hears of it.
        with pytest.raises(ValueError, match="unknown tensors"):
            await engine.load_weights(load_model("builtin:micro").state_dict(), 1)
        assert fake.bodies("/load_lora_adapter") == []
        with pytest.raises(PreconditionError, match="LoRA"):
            await engine.load_weight_files([tmp_path / "x.safetensors"], 1)

        await engine.load_weights(adapters, 1)
        assert fake.bodies("/load_lora_adapter") == [
            {"lora_name": "areal-v1", "lora_path": str(tmp_path / "lora-v1")}
        ]
        served = PeftModel.from_pretrained(load_model("builtin:micro"), str(tmp_path / "lora-v1"))
        for name, tensor in served.named_parameters():
            if "lora_" in name:
                assert tensor.equal(adapters[name]), name

        fake.hold, fake.generating = True, threading.Event()
        in_flight = asyncio.create_task(engine.generate([4], cfg))
        await asyncio.to_thread(fake.generating.wait, 30)
        assert fake.bodies("/generate")[-1]["lora_path"] == "areal-v1"
        await engine.load_weights({n: t + 1 for n, t in adapters.items()}, 2)
        await engine.settle()
        # areal-v1 still has a request in flight: it stays loaded.
        assert fake.bodies("/unload_lora_adapter") == [] and (tmp_path / "lora-v1").is_dir()
        fake.release.set()
        result = await in_flight
        await engine.settle()
        assert result.output_versions == [1]  # the version of the adapter it ran on
        assert fake.bodies("/unload_lora_adapter") == [{"lora_name": "areal-v1"}]
        assert not (tmp_path / "lora-v1").exists() and (tmp_path / "lora-v2").is_dir()
        fake.hold = False
        latest = await engine.generate([5], cfg)
        assert fake.bodies("/generate")[-1]["lora_path"] == "areal-v2"
        assert latest.output_versions == [2]
    finally:
        await engine.close()
        fake.close()


def test_sglang_gpu_only_lora_launch_enables_lora_for_the_run_adapters():
    argv = launch_argv(
        "python", "/m", 30000, SglangSettings(), gpu=True, lora=LoraSettings(rank=16, alpha=32.0)
    )
    i = argv.index("--enable-lora")
    want = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"]
    assert argv[i : i + 5] == want


async def test_a_launched_sglang_on_a_cpu_refuses_lora_naming_the_setting():
    engine = SGLangEngine("builtin:micro", lora=LoraSettings(rank=4))
    engine.gpu = False
    with pytest.raises(FieldError) as info:
        await engine.start()
    assert info.value.field == "model.lora.rank"
    await engine.close()
