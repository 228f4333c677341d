"""WeightSyncService over the sglang engine, against a fake SGLang HTTP server.

SGLang cannot run here (it needs a GPU), so a fake HTTP server stands in for it and records
what it is sent. The test checks the exact documented payloads (SGLang 0.5.10, as AReaL's
``areal/engine/sglang_remote.py`` sends them): ``/init_weights_update_group`` once per group,
one ``/update_weights_from_distributed`` per bucket, ``/update_weights_from_disk`` with the
confined path; and that refused updates send SGLang nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from areal_servers.rollout.weight_sync import build_weight_sync_service
from arealgrpc.v1 import tensor_pb2
from arealgrpc.v1 import weight_sync_pb2 as pb
from arealgrpc.v1 import weight_sync_pb2_grpc as pb_grpc

from areal_grpc.errors import field_violations
from areal_grpc.server import BackgroundServer, sync_channel
from tests.support.sglang import FakeSGLangHTTP
from tests.support.weightsync import distributed_offer

TIMEOUT = 30.0


@pytest.fixture
def sglang(tmp_path: Path) -> Iterator[tuple[FakeSGLangHTTP, pb_grpc.WeightSyncServiceStub]]:
    fake = FakeSGLangHTTP()
    engine = SGLangEngine(SGLangEngineConfig(model="builtin:micro", url=fake.url))
    svc = build_weight_sync_service(engine, ReceiverConfig(disk_root=str(tmp_path)))
    with BackgroundServer([svc]) as running, sync_channel(running.address) as channel:
        yield fake, pb_grpc.WeightSyncServiceStub(channel)
    fake.close()


# The group SGLang is asked to join (checked field by field in its payloads below).
GROUP = {
    "master_address": "10.0.0.5",
    "master_port": 29123,
    "world_size": 3,
    "group_name": "areal-weights-test",
    "bucket_bytes": 4096,
}


SPECS = [
    tensor_pb2.TensorSpec(name="a.weight", dtype=tensor_pb2.DTYPE_BFLOAT16, shape=[32, 32]),
    tensor_pb2.TensorSpec(name="b.weight", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[16, 32]),
    tensor_pb2.TensorSpec(name="c.bias", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[32]),
]


def test_sglang_fake_http_distributed_update_payloads(sglang) -> None:
    fake, stub = sglang
    gloo = pb.TransferOption()
    gloo.CopyFrom(distributed_offer(**GROUP))
    gloo.distributed.backend = pb.COLLECTIVE_BACKEND_GLOO
    # SGLang's weight groups are NCCL: a gloo offer is passed over for the nccl one.
    plan = stub.Negotiate(
        pb.NegotiateRequest(offers=[gloo, distributed_offer(**GROUP)]), timeout=TIMEOUT
    )
    assert plan.plan.method == pb.TRANSFER_METHOD_DISTRIBUTED
    assert plan.plan.distributed.backend == pb.COLLECTIVE_BACKEND_NCCL
    assert not plan.plan.distributed.joined
    assert fake.posts == []  # negotiation alone tells SGLang nothing

    # 2 KiB + 2 KiB + 128 B with 4 KiB buckets: [a, b] then [c].
    reply = stub.UpdateFromDistributed(
        pb.UpdateFromDistributedRequest(
            plan_id=plan.plan_id, policy_version=1, tensors=SPECS, bucket_bytes=4096
        ),
        timeout=TIMEOUT,
    )
    assert reply.policy_version == 1 and reply.tensor_count == 3
    assert fake.posts == [
        (
            "/init_weights_update_group",
            {
                "master_address": "10.0.0.5",
                "master_port": "29123",
                "rank_offset": 1,
                "world_size": 3,
                "backend": "nccl",
                "group_name": "areal-weights-test",
            },
        ),
        (
            "/update_weights_from_distributed",
            {
                "names": ["a.weight", "b.weight"],
                "dtypes": ["bfloat16", "float32"],
                "shapes": [[32, 32], [16, 32]],
                "group_name": "areal-weights-test",
                "abort_all_requests": True,
            },
        ),
        (
            "/update_weights_from_distributed",
            {
                "names": ["c.bias"],
                "dtypes": ["float32"],
                "shapes": [[32]],
                "group_name": "areal-weights-test",
                "abort_all_requests": True,
            },
        ),
    ]

    # The same group again: SGLang already belongs to it, so no second init.
    fake.posts.clear()
    plan2 = stub.Negotiate(
        pb.NegotiateRequest(offers=[distributed_offer(**GROUP)]), timeout=TIMEOUT
    )
    assert plan2.plan.distributed.joined and plan2.policy_version == 1
    stub.UpdateFromDistributed(
        pb.UpdateFromDistributedRequest(
            plan_id=plan2.plan_id, policy_version=2, tensors=SPECS[2:], bucket_bytes=0
        ),
        timeout=TIMEOUT,
    )
    assert [p for p, _ in fake.posts] == ["/update_weights_from_distributed"]

    # A stale version is refused before SGLang hears of it.
    fake.posts.clear()
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateFromDistributed(
            pb.UpdateFromDistributedRequest(
                plan_id=plan2.plan_id, policy_version=2, tensors=SPECS, bucket_bytes=0
            ),
            timeout=TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert fake.posts == []


def test_sglang_fake_http_disk_update_payload_and_confinement(sglang, tmp_path: Path) -> None:
    fake, stub = sglang
    (tmp_path / "v00000001").mkdir()
    plan = stub.Negotiate(
        pb.NegotiateRequest(offers=[pb.TransferOption(method=pb.TRANSFER_METHOD_DISK)]),
        timeout=TIMEOUT,
    )
    assert plan.plan.disk.root == str(tmp_path.resolve())
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateFromDisk(
            pb.UpdateFromDiskRequest(plan_id=plan.plan_id, policy_version=1, path="../x"),
            timeout=TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in field_violations(err.value)] == ["path"]
    assert fake.posts == []
    reply = stub.UpdateFromDisk(
        pb.UpdateFromDiskRequest(plan_id=plan.plan_id, policy_version=1, path="v00000001"),
        timeout=TIMEOUT,
    )
    assert reply.policy_version == 1
    assert fake.posts == [
        (
            "/update_weights_from_disk",
            {"model_path": str((tmp_path / "v00000001").resolve()), "abort_all_requests": True},
        )
    ]
