"""LoRA weight updates: a 2-rank FSDP2 trainer group with adapters publishes only them, by
each method, into a rollout server that keeps its base weights and serves the adapters
bit-exact (its greedy output equals the exported adapter loaded over the base model)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from areal_clients.fleet import update_fleet_weights
from peft import PeftModel
from safetensors.torch import load_file

from areal_grpc.config import LoraSettings
from areal_grpc.model import load_model

from .conftest import MODEL, MakeRollout, Trainers, start_trainers, stop_trainers, tensor_digest
from .test_fleet_methods import reference_greedy

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
    result = asyncio.run(
        update_fleet_weights(
            lora_trainers.addresses, [rollout.address], methods=(method,), timeout_s=120
        )
    )
    assert result.failed_servers == [], [s.error for s in result.servers]
    assert result.version == version == rollout.version()
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
