"""LoRA weight updates: a 2-rank FSDP2 trainer group with adapters publishes only them, by
each method, into a rollout server that keeps its base weights and serves the adapters
bit-exact (its greedy output equals the exported adapter loaded over the base model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from areal_servers.rollout.sglang_engine import SGLangEngine
from peft import PeftModel
from safetensors.torch import load_file

from areal_grpc.config import LoraSettings, SglangSettings
from areal_grpc.model import load_model
from tests.support.sglang import FakeSGLangHTTP
from tests.support.weightsync import (
    MODEL,
    MakeRollout,
    Trainers,
    publish,
    reference_greedy,
    start_trainers,
    stop_trainers,
    tensor_digest,
)

LORA = LoraSettings(rank=4, alpha=8.0)
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def lora_trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    t = start_trainers(
        tmp_path_factory.mktemp("lora-trainers"),
        extra=(f"model.lora.rank={LORA.rank}", f"model.lora.alpha={LORA.alpha}"),
    )
    yield t
    stop_trainers(t)


def served_name(saved: str) -> str:
    """peft saves adapter weights without the adapter's name ("default") in the key."""
    return saved.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"
    )


@pytest.mark.parametrize("method", ["stream", "disk", "distributed"])
def test_lora_update_moves_only_the_adapters_bit_exact(
    lora_trainers: Trainers, make_rollout: MakeRollout, method: str
) -> None:
    version = lora_trainers.train_step()
    rollout = make_rollout(disk_root=lora_trainers.weights_root, lora=LORA)
    initial = rollout.digests()
    result = publish(lora_trainers, [rollout], (method,))
    assert result.version == version
    export = lora_trainers.export(f"lora-{method}-v{version}")
    adapter = load_file(str(export / "adapter_model.safetensors"))
    served = rollout.digests()
    assert adapter and all("lora_" in k for k in adapter)
    for name, tensor in adapter.items():
        assert served[served_name(name)] == tensor_digest(tensor), name
    # Only the adapters travelled: their bytes, and the base weights are untouched.
    assert result.total_bytes == sum(t.numel() * t.element_size() for t in adapter.values())
    base = [k for k in initial if "lora_" not in k]
    assert base and all(served[k] == initial[k] for k in base)
    assert any(served[served_name(k)] != initial[served_name(k)] for k in adapter)
    base_and_adapter = lambda: PeftModel.from_pretrained(load_model(MODEL), str(export))  # noqa: E731
    assert rollout.greedy(PROMPT) == reference_greedy(MODEL, PROMPT, model_factory=base_and_adapter)


def test_a_full_update_into_a_lora_server_is_refused_by_name(make_rollout: MakeRollout) -> None:
    """A server with adapters needs them in every update: a state dict of the plain model
    (no adapters, other names) is refused naming the tensors, and the served weights stay."""
    rollout = make_rollout(lora=LORA)
    before = rollout.digests()
    plain = load_model(MODEL).state_dict()

    async def load() -> None:
        await rollout.engine.load_weights(plain, 1)

    with pytest.raises(ValueError, match="unknown tensors"):
        rollout.server.call(load())
    assert rollout.digests() == before and rollout.version() == 0
    # The adapters alone are accepted.
    lora_only = {
        n: torch.zeros_like(p) for n, p in rollout.engine.model.named_parameters() if "lora_" in n
    }

    async def load_adapters() -> None:
        await rollout.engine.load_weights(lora_only, 1)

    rollout.server.call(load_adapters())
    assert rollout.version() == 1


@pytest.mark.parametrize("method", ["stream", "disk"])
def test_lora_update_into_sglang_gpu_only_fake_http_loads_each_version_as_a_peft_adapter(
    lora_trainers: Trainers, make_rollout: MakeRollout, tmp_path: Path, method: str
) -> None:
    """SGLang serves LoRA on a GPU only, so a fake HTTP server records what it is sent (SGLang's
    documented LoRA protocol): each update is a peft directory loaded by /load_lora_adapter as
    "areal-v<version>", bit-exact with the trainer's exported adapter; generation names it in
    ``lora_path``; the adapter it replaces is unloaded and its directory removed. Distributed
    is declined (SGLang's weight groups carry no adapters), so the next offer is used."""
    fake = FakeSGLangHTTP()
    adapters = tmp_path / "adapters"
    engine = SGLangEngine(MODEL, SglangSettings(weights_dir=str(adapters)), url=fake.url, lora=LORA)
    rollout = make_rollout(disk_root=lora_trainers.weights_root, engine=engine)
    try:
        rollout.greedy(PROMPT, n=1)
        assert "lora_path" not in fake.posts[-1][1]
        names = []
        for _ in range(2):
            version = lora_trainers.train_step()
            fake.posts.clear()
            result = publish(lora_trainers, [rollout], ("distributed", method))
            assert result.servers[0].method == method and result.version == version
            name = f"areal-v{version}"
            loads = [body for path, body in fake.posts if path == "/load_lora_adapter"]
            assert loads == [{"lora_name": name, "lora_path": str(adapters / f"lora-v{version}")}]
            export = lora_trainers.export(f"lora-sglang-{method}-v{version}")
            served = load_file(str(adapters / f"lora-v{version}" / "adapter_model.safetensors"))
            wanted = load_file(str(export / "adapter_model.safetensors"))
            assert served.keys() == wanted.keys()
            assert all(served[k].equal(wanted[k]) for k in wanted)
            config = json.loads((adapters / f"lora-v{version}" / "adapter_config.json").read_text())
            exported = json.loads((export / "adapter_config.json").read_text())
            for key in ("r", "lora_alpha", "peft_type"):
                assert config[key] == exported[key], key
            # SGLang matches modules by their last name (q_proj, ...), as the config gives them.
            leaves = {m.rsplit(".", 1)[-1] for m in exported["target_modules"]}
            assert sorted(config["target_modules"]) == sorted(leaves)
            rollout.greedy(PROMPT, n=1)
            assert fake.posts[-1] == ("/generate", {**fake.posts[-1][1], "lora_path": name})
            names.append(name)
        rollout.server.call(engine.settle())
        assert [b for p, b in fake.posts if p == "/unload_lora_adapter"] == [
            {"lora_name": names[0]}
        ]
        assert sorted(p.name for p in adapters.iterdir()) == [f"lora-v{version}"]
        # SGLang never got a full-model update.
        assert not [p for p, _ in fake.posts if p.startswith("/update_weights")]
    finally:
        fake.close()
