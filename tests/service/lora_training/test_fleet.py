"""LoraTrainingService sampling on a rollout fleet (tinker.rollout_addresses): every sampler
checkpoint is loaded on the fleet's rollout server as a named adapter, and sample calls go
there, naming it. Real gRPC on loopback both ways: the training service over its engine
(builtin:tiny), a rollout server over an hf engine on the same base model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from areal_servers.lora_training.engine import LoraEngine
from areal_servers.lora_training.fleet import SamplerFleet
from areal_servers.lora_training.service import LoraTrainingServicer, Tenants, name_key
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.service import RolloutServicer
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from arealgrpc.v1 import lora_training_pb2 as pb
from arealgrpc.v1 import lora_training_pb2_grpc as pb_grpc

from areal_grpc.config import ModelConfig, RolloutConfig, TinkerConfig
from areal_grpc.model import load_tokenizer
from areal_grpc.server import BackgroundServer, service, sync_channel
from tests.service.lora_training.test_service import KEYS, MODEL, SEQ, auth, create, ok, step

torch.set_num_threads(1)


@dataclass
class Mesh:
    servicer: LoraTrainingServicer
    channel: grpc.Channel
    rollout: rollout_pb2_grpc.RolloutServiceStub

    def stub(self) -> pb_grpc.LoraTrainingServiceStub:
        return pb_grpc.LoraTrainingServiceStub(self.channel)

    def fleet_status(self) -> rollout_pb2.GetRolloutStatusResponse:
        return self.rollout.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    engine = HFEngine(ModelConfig(source=MODEL, seed=0), RolloutConfig(device="cpu"))
    rollout_bg = BackgroundServer(
        [
            service(
                RolloutServicer(engine, load_tokenizer(MODEL)),
                rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                rollout_pb2,
            )
        ]
    )
    rollout_address = rollout_bg.start().address
    # What a previous service left on the fleet, and an adapter of somebody else's.
    tensors = peft_adapter()
    for name in ("tinker-stale", "other"):
        rollout_bg.call(engine.load_adapter(name, tensors, 4, 8.0))
    fleet = SamplerFleet([rollout_address])
    servicer = LoraTrainingServicer(
        LoraEngine(MODEL),
        TinkerConfig(samplers_per_run=2, rollout_addresses=[rollout_address]),
        Tenants(KEYS),
        tmp_path / "root",
        [MODEL],
        fleet=fleet,
    )
    bg = BackgroundServer(
        [service(servicer, pb_grpc.add_LoraTrainingServiceServicer_to_server, pb)]
    )
    running = bg.start()
    bg.call(servicer.start())
    channel = grpc.insecure_channel(running.address)
    rollout_channel = sync_channel(rollout_address)
    try:
        yield Mesh(servicer, channel, rollout_pb2_grpc.RolloutServiceStub(rollout_channel))
    finally:
        channel.close()
        rollout_channel.close()
        bg.call(servicer.stop())
        bg.stop()
        fleet.close()
        rollout_bg.call(engine.close())
        rollout_bg.stop()


def peft_adapter() -> dict[str, torch.Tensor]:
    """An adapter of the served base (peft's saved names), rank 4, on q and v."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from areal_grpc.model import load_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(load_model(MODEL, seed=0), config)
    return get_peft_model_state_dict(model)


def sample(mesh: Mesh, tenant: str, **model: str) -> list[list[int]]:
    reply = mesh.stub().Sample(
        pb.SampleRequest(
            prompt_tokens=SEQ[:3],
            sampling=common_pb2.SamplingParams(
                max_new_tokens=5, temperature=0.0, n_samples=2, ignore_eos=True
            ),
            **model,
        ),
        metadata=auth(tenant),
    )
    result = ok(mesh, tenant, reply.operation).sample
    assert all(len(c.output_logprobs) == len(c.output_ids) == 5 for c in result.completions)
    return [list(c.output_ids) for c in result.completions]


def save(mesh: Mesh, tenant: str, run: str, name: str) -> str:
    reply = mesh.stub().SaveWeights(
        pb.SaveWeightsRequest(
            training_run=run, kind=pb.CHECKPOINT_KIND_SAMPLER, checkpoint_id=name
        ),
        metadata=auth(tenant),
    )
    return ok(mesh, tenant, reply.operation).checkpoint.name


def test_samplers_are_served_and_sampled_by_the_rollout_fleet(mesh: Mesh):
    # The service removed the samplers a previous one left, and nothing else.
    assert list(mesh.fleet_status().adapters) == ["other"]
    a = create(mesh, "alice")
    b = create(mesh, "bob")
    before = mesh.fleet_status().generated_tokens
    base = sample(mesh, "alice", base_model=MODEL)
    for _ in range(20):
        step(mesh, "alice", a)
    trained = save(mesh, "alice", a, "trained")
    fresh = save(mesh, "bob", b, "fresh")
    # Each sampler is a named adapter on the fleet now, and the samples came from there.
    assert len(mesh.fleet_status().adapters) == 3
    assert sample(mesh, "alice", checkpoint=trained)[0] == SEQ[3:8]  # it learned the sequence
    assert sample(mesh, "bob", checkpoint=fresh) == base  # an untrained adapter is the base
    # Three calls of two samples of five tokens, all generated by the fleet's server.
    assert mesh.fleet_status().generated_tokens - before == 3 * 2 * 5
    # The service's own engine samples the same tokens from the same sampler (its worker is
    # idle: every call above is done).
    own, _ = mesh.servicer.engine.sample(
        name_key("alice", trained),
        SEQ[:3],
        num_samples=1,
        max_tokens=5,
        temperature=0.0,
        stop_token_ids=[],
    )
    assert own[0].tokens == SEQ[3:8]
    # Another tenant's sampler is not found, through the fleet as without it.
    with pytest.raises(grpc.RpcError) as err:
        mesh.stub().Sample(
            pb.SampleRequest(
                checkpoint=trained,
                prompt_tokens=SEQ[:3],
                sampling=common_pb2.SamplingParams(max_new_tokens=2),
            ),
            metadata=auth("bob"),
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_samplers_leaving_memory_or_a_deleted_run_leave_the_fleet(mesh: Mesh):
    a = create(mesh, "alice")
    first = save(mesh, "alice", a, "one")
    save(mesh, "alice", a, "two")
    assert len(mesh.fleet_status().adapters) == 3  # beside "other"
    save(mesh, "alice", a, "three")  # samplers_per_run=2: "one" leaves memory and the fleet
    while len(mesh.fleet_status().adapters) != 3:
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as err:
        mesh.stub().Sample(
            pb.SampleRequest(
                checkpoint=first,
                prompt_tokens=SEQ[:3],
                sampling=common_pb2.SamplingParams(max_new_tokens=2),
            ),
            metadata=auth("alice"),
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    mesh.stub().DeleteTrainingRun(pb.DeleteTrainingRunRequest(name=a), metadata=auth("alice"))
    assert list(mesh.fleet_status().adapters) == ["other"]
