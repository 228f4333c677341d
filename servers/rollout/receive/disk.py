"""DISK (``UpdateFromDisk``): a versioned safetensors directory that must lie inside this
server's own configured root (``..``, absolute paths elsewhere and symlinks leading out are
INVALID_ARGUMENT naming ``path``). An engine that reads the files itself (vLLM's worker, an
SGLang server through ``/update_weights_from_disk``) is handed them as they are (with LoRA,
the adapters are loaded and rewritten as the peft directory such a server reads).

DISK shards need no receive buffer: safetensors maps each file privately (copy-on-write), and
the mapped tensors are handed over as they are, so the served weights share the page cache
the trainer wrote (pruning the directory later does not disturb a mapping).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import torch
from areal_servers.rollout.receive.base import Receiver, ReceiverState, check_dtype
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.weight_disk import float_dtypes, load_version, resolve_confined, weight_files

__all__ = ["DiskReceiver", "check_file_dtypes", "load_directory"]

pb = weight_sync_pb2


class DiskReceiver(Receiver):
    """Versioned directories under this server's disk root."""

    name = "disk"
    method = pb.TRANSFER_METHOD_DISK

    @property
    def enabled(self) -> bool:
        return super().enabled and bool(self.state.config.disk_root)

    def accept(
        self, where: str, offer: pb.TransferOption, declined: list[str]
    ) -> pb.TransferOption | None:
        if not self.enabled:
            return None
        root = str(Path(self.state.config.disk_root or "").resolve())
        return pb.TransferOption(method=self.method, disk=pb.DiskParams(root=root))

    def supported(self) -> str | None:
        if not self.enabled:
            return None
        return f"TRANSFER_METHOD_DISK (root {self.state.config.disk_root})"

    async def close(self) -> None:
        """Nothing is held between updates."""

    async def update(self, request: pb.UpdateFromDiskRequest) -> pb.UpdateFromDiskResponse:
        """Loads a safetensors directory from under this server's root."""
        state = self.state
        state.plan(request.plan_id, self.method, required=False)
        root = state.config.disk_root
        if not self.enabled or not root:
            raise PreconditionError("this server takes no disk updates (no disk root)")
        count = await load_directory(state, root, request.path, request.policy_version)
        return pb.UpdateFromDiskResponse(policy_version=state.engine.version, tensor_count=count)


async def load_directory(state: ReceiverState, root: str, path: str, version: int) -> int:
    """Loads the version directory ``path`` (confined to ``root``) as ``version``; the
    number of tensors loaded."""
    state.check_version(version)
    directory = resolve_confined(root, path, "path")
    async with state.update_lock:
        state.check_version(version)
        load_files = getattr(state.engine, "load_weight_files", None)
        if load_files is not None and not state.engine.adapters_only:
            # An engine that reads the files itself (vLLM's worker, SGLang) is handed them.
            files = weight_files(directory, Path(root), "path")
            check_file_dtypes(state, float_dtypes(files, "path"))
            state.spare = {}
            try:
                return int(await load_files(files, version))
            except ValueError as exc:
                raise FieldError("path", str(exc)) from None
        # Mapped, not copied: nothing to receive into (see the module docstring).
        state_dict = await asyncio.to_thread(load_version, root, str(directory))
        check_file_dtypes(state, {n: t.dtype for n, t in state_dict.items()})
        # The weights such an update replaces may themselves be mapped files: as receive
        # buffers they would only copy-on-write, so they are let go.
        await state.load(state_dict, version, keep_spare=False)
        return len(state_dict)


def check_file_dtypes(state: ReceiverState, dtypes: Mapping[str, torch.dtype]) -> None:
    """FieldError naming ``path`` when a tensor of the directory has a dtype refused here."""
    for name, dtype in dtypes.items():
        try:
            check_dtype(name, dtype, state.expected_dtype)
        except FieldError as exc:
            raise FieldError("path", f"tensor {name!r} {exc.description}") from None
