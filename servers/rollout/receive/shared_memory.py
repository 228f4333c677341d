"""SHARED_MEMORY (``UpdateFromSharedMemory``): a version directory a sender on this host
wrote once into its own directory in ``/dev/shm``; loaded as DISK loads one (mapped, not
copied). Taken only when the offer's root is a project directory directly in this server's
shared-memory base and its probe reads back as offered, i.e. the sender shares this memory
(another host, or another container of this host, does not); the path must lie inside that
root."""

from __future__ import annotations

from areal_servers.rollout.receive.base import Receiver
from areal_servers.rollout.receive.disk import load_directory
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc.errors import FieldError
from areal_grpc.shared_memory import is_shared_root, read_probe

__all__ = ["SharedMemoryReceiver"]

pb = weight_sync_pb2


class SharedMemoryReceiver(Receiver):
    """Version directories of same-host senders, in shared memory."""

    name = "shared_memory"
    method = pb.TRANSFER_METHOD_SHARED_MEMORY

    @property
    def enabled(self) -> bool:
        return super().enabled and self.state.config.shm_base is not None

    def supported(self) -> str | None:
        if not self.enabled:
            return None
        return f"TRANSFER_METHOD_SHARED_MEMORY (senders on this host, {self.state.config.shm_base})"

    def accept(
        self, where: str, offer: pb.TransferOption, declined: list[str]
    ) -> pb.TransferOption | None:
        if not self.enabled:
            return None
        params = offer.shared_memory
        if not offer.HasField("shared_memory") or not params.root:
            raise FieldError(f"{where}.shared_memory.root", "is required")
        base = self.state.config.shm_base
        assert base is not None
        if not params.probe or not is_shared_root(params.root, base):
            declined.append(f"{where}: {params.root} is not a sender's directory in {base} here")
            return None
        if read_probe(params.root) != params.probe:
            declined.append(f"{where}: {params.root} is not the sender's (another host?)")
            return None
        return pb.TransferOption(
            method=self.method, shared_memory=pb.SharedMemoryParams(root=params.root)
        )

    async def close(self) -> None:
        """Nothing is held between updates."""

    async def update(
        self, request: pb.UpdateFromSharedMemoryRequest
    ) -> pb.UpdateFromSharedMemoryResponse:
        """Loads the version directory from the plan's root."""
        state = self.state
        plan = state.plan(request.plan_id, self.method, required=True)
        assert plan is not None
        root = plan.option.shared_memory.root
        count = await load_directory(state, root, request.path, request.policy_version)
        return pb.UpdateFromSharedMemoryResponse(
            policy_version=state.engine.version, tensor_count=count
        )
