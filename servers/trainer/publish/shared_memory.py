"""SHARED_MEMORY: DISK's versioned directory, written once into this process's directory in
``/dev/shm`` (:mod:`areal_grpc.shared_memory`) and mapped by every receiver on this host
without a copy. Offered with the directory's probe, which only a receiver sharing this
memory can read back; one version is kept (the one being served)."""

from __future__ import annotations

from areal_servers.trainer.publish.base import Target
from areal_servers.trainer.publish.disk import DiskTransport
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc.shared_memory import own_root

__all__ = ["SharedMemoryTransport"]

pb = weight_sync_pb2


class SharedMemoryTransport(DiskTransport):
    """A version directory in this process's shared memory, mapped by same-host servers."""

    method = pb.TRANSFER_METHOD_SHARED_MEMORY

    @property
    def root(self) -> str | None:
        own = own_root()
        return str(own[0]) if own is not None else None

    @property
    def keep(self) -> int:
        # Memory, not disk: only the version being served (receivers keep their mappings
        # of the one it replaces until they swap).
        return 1

    def offer(self, rank: int, world: int) -> pb.TransferOption | None:
        own = own_root()
        if own is None:
            return None
        root, probe = own
        return pb.TransferOption(
            method=self.method,
            shared_memory=pb.SharedMemoryParams(root=str(root), probe=probe),
        )

    async def load(self, t: Target, path: str) -> tuple[int, int]:
        assert t.plan is not None
        reply = await t.stub.UpdateFromSharedMemory(
            pb.UpdateFromSharedMemoryRequest(
                plan_id=t.plan.plan_id, policy_version=self.ctx.version, path=path
            ),
            timeout=self.ctx.left(),
        )
        return reply.policy_version, reply.tensor_count
