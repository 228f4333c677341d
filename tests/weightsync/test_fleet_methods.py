"""Each method moves a trained 2-rank FSDP2 trainer's weights into 2 rollout servers.

Two real ``areal-trainer`` processes (FSDP2 over gloo) train a step, then the coordinator's
fleet update (``clients.fleet.update_fleet_weights``: pause -> PublishWeights on both ranks ->
confirm -> resume) moves the weights by one method into two real rollout servers. The served
weights must be bit-identical to the trainer's own HF export, and greedy generation must equal
generation from that exported model.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from areal_clients.fleet import update_fleet_weights
from areal_servers.rollout.hf_engine import HFEngine
from safetensors.torch import load_file

from areal_grpc.config import ModelConfig, RolloutConfig

from .conftest import MakeRollout, Trainers, tensor_digest

PROMPT = [5, 17, 42, 99, 7]


def exported_state_dict(path) -> dict:
    out = {}
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def reference_greedy(
    path, prompt: list[int], n: int = 12, device: str = "cpu", model_factory=None
) -> list[int]:
    """Greedy output of an hf engine loaded from the exported directory (or serving the model
    ``model_factory()`` builds, e.g. a base model with an exported adapter)."""

    async def run() -> list[int]:
        from areal_servers.rollout.engine import SamplingConfig

        model = model_factory() if model_factory is not None else None
        engine = HFEngine(ModelConfig(source=str(path)), RolloutConfig(device=device), model=model)
        try:
            result = await engine.generate(
                prompt, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            )
        finally:
            await engine.close()
        return result.output_ids

    return asyncio.run(run())


@pytest.mark.parametrize("method", ["stream", "disk", "distributed", "socket", "shared_memory"])
def test_method_moves_trained_fsdp_weights_into_two_rollout_servers(
    trainers: Trainers, make_rollout: MakeRollout, method: str
) -> None:
    version = trainers.train_step()
    rollouts = [make_rollout(disk_root=trainers.weights_root) for _ in range(2)]
    initial = rollouts[0].digests()

    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses,
            [r.address for r in rollouts],
            methods=(method,),
            timeout_s=120,
        )
    )

    assert result.failed_servers == [], [s.error for s in result.servers]
    assert result.version == version
    assert [s.method for s in result.servers] == [method, method]
    export = trainers.export(f"export-{method}-v{version}")
    expected = {k: tensor_digest(v) for k, v in exported_state_dict(export).items()}
    for r in rollouts:
        served = r.digests()
        assert r.version() == version
        for name, digest in expected.items():
            assert served[name] == digest, name
        # The trained weights really differ from the initial ones.
        assert any(served[k] != initial[k] for k in expected)
        # Resumed: generation works and equals the exported model's.
        assert r.greedy(PROMPT) == reference_greedy(export, PROMPT)


def test_with_no_methods_named_a_cpu_trainer_offers_shared_memory_first_then_distributed(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    """The default order on CPU: servers on the trainer's host map its shared memory; one
    that cannot (another host; here a server that does not take it) joins the weight group."""
    version = trainers.train_step()
    same_host = make_rollout()
    elsewhere = make_rollout(methods=("distributed", "socket", "stream", "disk"))
    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses, [same_host.address, elsewhere.address], timeout_s=120
        )
    )
    assert result.failed_servers == [], [s.error for s in result.servers]
    assert [s.method for s in result.servers] == ["shared_memory", "distributed"]
    export = trainers.export(f"export-default-v{version}")
    expected = {k: tensor_digest(v) for k, v in exported_state_dict(export).items()}
    for r in (same_host, elsewhere):
        assert r.version() == version
        served = r.digests()
        assert all(served[name] == digest for name, digest in expected.items())


def test_distributed_group_is_formed_once_and_reused_by_later_updates(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    rollouts = [make_rollout() for _ in range(2)]
    addresses = [r.address for r in rollouts]
    groups = []
    for _ in range(2):
        version = trainers.train_step()
        result = asyncio.run(
            update_fleet_weights(
                trainers.addresses, addresses, methods=("distributed",), timeout_s=120
            )
        )
        assert result.failed_servers == [], [s.error for s in result.servers]
        assert [r.version() for r in rollouts] == [version, version]
        groups.append([r.weight_sync.group for r in rollouts])
    # The same process-group objects carried the second update: no new rendezvous.
    assert all(g is not None for g in groups[0])
    assert [id(g) for g in groups[1]] == [id(g) for g in groups[0]]
    assert [g.params.rank for g in groups[1]] == [1, 2]
    assert rollouts[0].digests() == rollouts[1].digests()
