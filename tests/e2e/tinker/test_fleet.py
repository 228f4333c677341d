"""``python -m areal_grpc.tinker`` with ``tinker.rollout_addresses``, driven by the official
``tinker`` SDK unchanged: a saved sampler is loaded on a rollout server (``python -m
areal_servers.rollout``, a process of its own) as a named adapter, and the SDK's ``sample``
is generated there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import tinker
from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc

from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from tests.support.tinker import SEQ, greedy, sft_steps, start_tinker

MODEL = "builtin:tiny"
KEYS = {"alice": "tml-alice-0123456789abcdef"}


@dataclass
class Mesh:
    tinker: Child
    rollout: rollout_pb2_grpc.RolloutServiceStub

    def client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=f"http://{self.tinker.address}", api_key=KEYS["alice"])

    def fleet(self) -> rollout_pb2.GetRolloutStatusResponse:
        return self.rollout.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=30)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    os.environ["TINKER_TELEMETRY"] = "0"
    out: Path = tmp_path_factory.mktemp("tinker-fleet")
    rollout = start_child(
        "rollout",
        python_module_argv("areal_servers.rollout", "--port", "0", f"model.source={MODEL}"),
        log_dir=out / "logs",
    )
    children = [rollout]
    channel = grpc.insecure_channel(rollout.address)
    try:
        service = start_tinker(out, KEYS, MODEL, f"tinker.rollout_addresses=[{rollout.address}]")
        children.append(service)
        yield Mesh(service, rollout_pb2_grpc.RolloutServiceStub(channel))
    finally:
        channel.close()
        stop_children(children)


def test_the_sdks_samples_of_a_trained_sampler_come_from_the_rollout_fleet(mesh: Mesh):
    sc = mesh.client()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    base = greedy(sc.create_sampling_client(base_model=MODEL).result(), SEQ[:3])
    sft_steps(tc, 20)
    before = mesh.fleet().generated_tokens
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert len(mesh.fleet().adapters) == 1  # the sampler, on the rollout server
    assert greedy(sampler, SEQ[:3]) == SEQ[3:8] != base
    assert mesh.fleet().generated_tokens - before == 5  # generated there
