"""A rollout server's WeightSyncService refuses what it must and keeps serving.

Real rollout servers on loopback (HFEngine + RolloutService + WeightSyncService); the client
side is a plain gRPC client speaking the contract.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from arealgrpc.v1 import tensor_pb2
from arealgrpc.v1 import weight_sync_pb2 as pb

from areal_grpc.errors import field_violations
from areal_grpc.ports import free_port
from areal_grpc.tensor_codec import tensor_spec
from areal_grpc.weight_disk import write_version
from tests.support.weightsync import (
    RPC_TIMEOUT,
    MakeRollout,
    Rollout,
    distributed_offer,
    push,
    push_messages,
    shifted,
    tensor_digest,
)

PROMPT = [5, 17, 42, 99, 7]


def disk_update(r: Rollout, path: str, version: int) -> pb.UpdateFromDiskResponse:
    return r.sync.UpdateFromDisk(
        pb.UpdateFromDiskRequest(path=path, policy_version=version), timeout=RPC_TIMEOUT
    )


def expect_error(fn, code: grpc.StatusCode) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    return info.value


def test_stream_cut_midway_leaves_old_weights_serving_and_retry_succeeds(
    make_rollout: MakeRollout,
) -> None:
    r = make_rollout()
    before = r.digests()
    greedy_before = r.greedy(PROMPT)
    new = shifted(r, 0.01)
    messages = push_messages(new, version=1)

    def cut() -> Iterator[object]:
        # The sender dies halfway through the stream.
        yield from messages[: len(messages) // 2]
        raise ConnectionError("sender lost")

    with pytest.raises(grpc.RpcError):
        push(r, cut())
    # A stream that simply stops early (half-close mid-tensor) is refused too.
    err = expect_error(
        lambda: push(r, messages[: len(messages) // 2]), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "chunk" in (err.details() or "") or "tensor" in (err.details() or "")
    assert r.version() == 0
    assert r.digests() == before
    assert r.greedy(PROMPT) == greedy_before

    reply = push(r, messages)
    assert reply.policy_version == 1
    assert reply.tensor_count == len(new)
    assert r.version() == 1
    served = r.digests()
    assert all(served[k] == tensor_digest(v) for k, v in new.items())
    assert served["lm_head.weight"] == served["model.embed_tokens.weight"]  # tied again


def test_corrupt_chunk_is_invalid_argument_naming_the_chunk(make_rollout: MakeRollout) -> None:
    r = make_rollout()
    before = r.digests()
    messages = push_messages(shifted(r, 0.5), version=3)
    bad = messages[5].to_proto()  # a chunk of the first big tensor
    bad.data = bytes([bad.data[0] ^ 1]) + bad.data[1:]
    messages[5] = bad
    err = expect_error(lambda: push(r, messages), grpc.StatusCode.INVALID_ARGUMENT)
    fields = [f for f, _ in field_violations(err)]
    assert len(fields) == 1 and fields[0].endswith(".crc32c"), fields
    assert r.version() == 0 and r.digests() == before


def test_stale_versions_are_refused_and_server_stays_up(
    make_rollout: MakeRollout, tmp_path: Path
) -> None:
    r = make_rollout(disk_root=tmp_path)
    assert push(r, push_messages(shifted(r, 0.01), version=5)).policy_version == 5
    served = r.digests()
    for version in (5, 4):
        err = expect_error(
            lambda v=version: push(r, push_messages(shifted(r, 0.02), version=v)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert "not newer than the served version 5" in (err.details() or "")
    write_version(tmp_path, 4, [shifted(r, 0.03)], 1)
    expect_error(lambda: disk_update(r, "v00000004", 4), grpc.StatusCode.FAILED_PRECONDITION)
    assert r.version() == 5 and r.digests() == served
    # Still serving, and a newer version is taken.
    assert len(r.greedy(PROMPT)) == 12
    write_version(tmp_path, 6, [shifted(r, 0.03)], 1)
    assert disk_update(r, "v00000006", 6).policy_version == 6
    assert r.version() == 6


def test_disk_paths_outside_the_root_are_refused_naming_path(
    make_rollout: MakeRollout, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    r = make_rollout(disk_root=root)
    sd = shifted(r, 0.01)
    write_version(outside, 1, [sd], 1)
    os.symlink(outside / "v00000001", root / "link-out")
    # An index inside the root whose shard is a symlink out of it.
    inner = write_version(root, 9, [sd], 1)
    shard = next(inner.glob("*.safetensors"))
    shard.unlink()
    os.symlink(next((outside / "v00000001").glob("*.safetensors")), shard)
    for path in (
        "../outside/v00000001",
        str(outside / "v00000001"),
        "link-out",
        "/etc",
        "v00000009",
        "",
        ".",
        str(root),
        "v00000009/../../outside/v00000001",
    ):
        err = expect_error(lambda p=path: disk_update(r, p, 1), grpc.StatusCode.INVALID_ARGUMENT)
        assert [f for f, _ in field_violations(err)] == ["path"], path
    assert r.version() == 0
    write_version(root, 1, [sd], 1)
    assert disk_update(r, str(root / "v00000001"), 1).policy_version == 1
    assert r.version() == 1


def test_negotiate_picks_the_first_acceptable_offer_or_lists_what_it_supports(
    make_rollout: MakeRollout, tmp_path: Path
) -> None:
    r = make_rollout(disk_root=tmp_path)
    disk = pb.TransferOption(method=pb.TRANSFER_METHOD_DISK, disk=pb.DiskParams(root="/x"))
    stream = pb.TransferOption(
        method=pb.TRANSFER_METHOD_STREAM, stream=pb.StreamParams(max_chunk_bytes=8 << 20)
    )
    nccl = distributed_offer()
    reply = r.sync.Negotiate(pb.NegotiateRequest(offers=[stream, disk]), timeout=RPC_TIMEOUT)
    assert reply.plan.method == pb.TRANSFER_METHOD_STREAM
    assert reply.plan.stream.max_chunk_bytes == 1 << 20  # clamped to the contract's limit
    assert reply.plan_id and reply.policy_version == 0
    reply = r.sync.Negotiate(pb.NegotiateRequest(offers=[disk, stream]), timeout=RPC_TIMEOUT)
    assert reply.plan.method == pb.TRANSFER_METHOD_DISK
    assert reply.plan.disk.root == str(tmp_path.resolve())  # the receiver's own root

    if not torch.cuda.is_available():
        # No nccl here and no stream accepted: nothing acceptable.
        only = make_rollout(methods=("distributed", "stream"))
        err = expect_error(
            lambda: only.sync.Negotiate(
                pb.NegotiateRequest(offers=[nccl, disk]), timeout=RPC_TIMEOUT
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        details = err.details() or ""
        assert "TRANSFER_METHOD_STREAM" in details and "gloo" in details

    bad = pb.TransferOption()
    bad.CopyFrom(nccl)
    bad.distributed.backend = pb.COLLECTIVE_BACKEND_GLOO
    bad.distributed.master_port = 0
    err = expect_error(
        lambda: r.sync.Negotiate(pb.NegotiateRequest(offers=[bad]), timeout=RPC_TIMEOUT),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert [f for f, _ in field_violations(err)] == ["offers[0].distributed.master_port"]
    expect_error(
        lambda: r.sync.Negotiate(pb.NegotiateRequest(), timeout=RPC_TIMEOUT),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    # An update quoting a plan this server never made is refused; the server stays up.
    expect_error(
        lambda: r.sync.UpdateFromDistributed(
            pb.UpdateFromDistributedRequest(plan_id="nope", policy_version=1),
            timeout=RPC_TIMEOUT,
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert r.version() == 0


def test_updates_reuse_replaced_weights_and_a_broken_stream_still_leaves_them_serving(
    make_rollout: MakeRollout,
) -> None:
    r = make_rollout()
    push(r, push_messages(shifted(r, 0.01), version=1))
    v1 = {k: v.data_ptr() for k, v in r.engine.model.state_dict().items()}
    push(r, push_messages(shifted(r, 0.01), version=2))
    served = r.digests()
    # The next stream is received into the memory version 1 occupied; cut midway, it must
    # not disturb version 2, which keeps serving.
    messages = push_messages(shifted(r, 0.01), version=3)
    expect_error(lambda: push(r, messages[: len(messages) // 2]), grpc.StatusCode.INVALID_ARGUMENT)
    assert r.version() == 2 and r.digests() == served
    new = shifted(r, 0.02)
    push(r, push_messages(new, version=3))
    now = r.engine.model.state_dict()
    assert all(tensor_digest(now[k]) == tensor_digest(v) for k, v in new.items())
    # Received in place: every tensor sits in the memory version 1 used (the cut stream
    # gave back what it had taken).
    assert [k for k in new if now[k].data_ptr() != v1[k]] == []


def test_a_bf16_server_asks_for_bf16_takes_it_or_float32_and_refuses_float16_by_every_method(
    make_rollout: MakeRollout, tmp_path: Path
) -> None:
    """The plan names the dtype the engine serves; a tensor in another narrow dtype is
    INVALID_ARGUMENT naming its dtype field (or the directory's path) and nothing changes."""
    r = make_rollout(disk_root=tmp_path, dtype="bfloat16")
    stream = pb.TransferOption(
        method=pb.TRANSFER_METHOD_STREAM, stream=pb.StreamParams(max_chunk_bytes=1 << 20)
    )
    reply = r.sync.Negotiate(pb.NegotiateRequest(offers=[stream]), timeout=RPC_TIMEOUT)
    assert reply.weights_dtype == tensor_pb2.DTYPE_BFLOAT16
    before = r.digests()
    served = shifted(r, 0.0)
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    half = {k: v.to(torch.float16) for k, v in served.items()}
    first = next(iter(half))

    err = expect_error(lambda: push(r, push_messages(half, 1)), grpc.StatusCode.INVALID_ARGUMENT)
    assert [f for f, _ in field_violations(err)] == [f'tensor["{first}"].dtype']
    assert "bfloat16" in (err.details() or "")
    specs = [tensor_spec(k, v) for k, v in half.items()]
    gloo = distributed_offer(backend=pb.COLLECTIVE_BACKEND_GLOO, master_port=free_port())
    socket = pb.TransferOption(
        method=pb.TRANSFER_METHOD_SOCKET, socket=pb.SocketParams(max_frame_bytes=4096)
    )
    # The two methods that announce their tensors: refused before a byte moves.
    for offer, update, request in (
        (gloo, r.sync.UpdateFromDistributed, pb.UpdateFromDistributedRequest),
        (socket, r.sync.UpdateFromSocket, pb.UpdateFromSocketRequest),
    ):
        plan = r.sync.Negotiate(pb.NegotiateRequest(offers=[offer]), timeout=RPC_TIMEOUT)
        announce = request(plan_id=plan.plan_id, policy_version=1, tensors=specs)
        err = expect_error(
            lambda u=update, a=announce: u(a, timeout=RPC_TIMEOUT),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert [f for f, _ in field_violations(err)] == ["tensors[0].dtype"], request
    write_version(tmp_path, 1, [half], 1)
    err = expect_error(lambda: disk_update(r, "v00000001", 1), grpc.StatusCode.INVALID_ARGUMENT)
    assert [f for f, _ in field_violations(err)] == ["path"]
    assert r.version() == 0 and r.digests() == before

    # float32 is converted on arrival; bfloat16 is installed as sent.
    wide = {k: v.float() + 0.01 for k, v in served.items()}
    assert push(r, push_messages(wide, 1)).policy_version == 1
    got = r.digests()
    assert all(got[k] == tensor_digest(v.to(torch.bfloat16)) for k, v in wide.items())
    narrow = {k: (v + 0.02).to(torch.bfloat16) for k, v in wide.items()}
    assert push(r, push_messages(narrow, 2)).policy_version == 2
    got = r.digests()
    assert all(got[k] == tensor_digest(v) for k, v in narrow.items())
    assert r.greedy(PROMPT)  # still generating
