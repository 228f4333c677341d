"""SHARED_MEMORY: what a rollout server takes from shared memory, and that no segment
outlives its owner (kill -9 included). Real rollout servers on loopback; the sender's side
is the real shared-memory directory of a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from arealgrpc.v1 import weight_sync_pb2 as pb

from areal_grpc.errors import field_violations
from areal_grpc.shared_memory import PREFIX, own_root, sweep_dead
from areal_grpc.weight_disk import write_version
from tests.support.weightsync import RPC_TIMEOUT, MakeRollout, shifted, tensor_digest


def offer(root: str, probe: bytes) -> pb.NegotiateRequest:
    option = pb.TransferOption(
        method=pb.TRANSFER_METHOD_SHARED_MEMORY,
        shared_memory=pb.SharedMemoryParams(root=root, probe=probe),
    )
    return pb.NegotiateRequest(offers=[option, pb.TransferOption(method=pb.TRANSFER_METHOD_STREAM)])


def test_shared_memory_is_taken_only_from_a_sender_sharing_it(
    make_rollout: MakeRollout, tmp_path: Path
) -> None:
    own = own_root()
    assert own is not None
    root, probe = own
    r = make_rollout()
    # A wrong probe (another host's directory of the same name) or a root outside
    # /dev/shm: declined, and the next offer is taken.
    for bad_root, bad_probe in [(str(root), b"x" * 16), (str(tmp_path), probe), ("/etc", probe)]:
        plan = r.sync.Negotiate(offer(bad_root, bad_probe), timeout=RPC_TIMEOUT)
        assert plan.plan.method == pb.TRANSFER_METHOD_STREAM, bad_root
    plan = r.sync.Negotiate(offer(str(root), probe), timeout=RPC_TIMEOUT)
    assert plan.plan.method == pb.TRANSFER_METHOD_SHARED_MEMORY
    assert plan.plan.shared_memory.root == str(root)

    sd = shifted(r, 0.25)
    write_version(root, 1, [sd], 1)
    # A canary outside the root: a complete version with other weights. A path leading to
    # it (relative, or absolute) is INVALID_ARGUMENT naming path; nothing of it is loaded
    # and nothing in it changes.
    canary = write_version(tmp_path, 1, [shifted(r, 9.0)], 1)
    before = {p: p.read_bytes() for p in sorted(canary.rglob("*")) if p.is_file()}
    for path in ("../../etc", os.path.relpath(canary, root), str(canary)):
        with pytest.raises(grpc.RpcError) as err:
            r.sync.UpdateFromSharedMemory(
                pb.UpdateFromSharedMemoryRequest(plan_id=plan.plan_id, policy_version=1, path=path),
                timeout=RPC_TIMEOUT,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
        assert [f for f, _ in field_violations(err.value)] == ["path"]
        assert r.version() == 0
    assert {p: p.read_bytes() for p in sorted(canary.rglob("*")) if p.is_file()} == before
    reply = r.sync.UpdateFromSharedMemory(
        pb.UpdateFromSharedMemoryRequest(plan_id=plan.plan_id, policy_version=1, path="v00000001"),
        timeout=RPC_TIMEOUT,
    )
    assert reply.policy_version == 1 == r.version() and reply.tensor_count == len(sd)
    served = r.digests()
    assert all(served[k] == tensor_digest(v) for k, v in sd.items())


def test_a_killed_owner_leaves_no_segment_behind() -> None:
    """kill -9 of a process holding a version in shared memory: the next process to open its
    own directory removes the dead one's (and leaves live ones alone)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch\n"
            "from areal_grpc.shared_memory import own_root\n"
            "from areal_grpc.weight_disk import write_version\n"
            "root, _ = own_root()\n"
            "write_version(root, 1, [{'w': torch.ones(1 << 20)}], 1)\n"
            "print(root, flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    dead_root = Path(child.stdout.readline().strip())
    assert dead_root.name == f"{PREFIX}{child.pid}" and (dead_root / "v00000001").is_dir()
    # While it lives, its directory is left alone.
    assert dead_root not in sweep_dead()
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert dead_root.is_dir()  # kill -9: nothing of its own ran
    assert dead_root in sweep_dead()
    assert not dead_root.exists()
