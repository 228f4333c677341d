"""DISK: rank 0 writes each bucket as the next shard of a versioned safetensors directory
(``disk_writers`` shard files at once; atomic rename when complete), then each disk server
loads it with ``UpdateFromDisk``; versions beyond ``keep_versions`` are deleted."""

from __future__ import annotations

import asyncio
import logging

import torch
from areal_servers.trainer.publish.base import PublishContext, Target, Transport
from arealgrpc.v1 import weight_sync_pb2
from google.rpc import status_pb2

from areal_grpc.errors import status_proto_of
from areal_grpc.weight_disk import VersionWriter, prune_versions, version_dir_name

__all__ = ["DiskTransport"]

log = logging.getLogger(__name__)
pb = weight_sync_pb2


class DiskTransport(Transport):
    """A versioned directory under the shared ``disk_root``, loaded by each server."""

    method = pb.TRANSFER_METHOD_DISK

    def __init__(self, ctx: PublishContext) -> None:
        super().__init__(ctx)
        self._writer: VersionWriter | None = None
        self._writes: list[asyncio.Task[None]] = []
        self._slots = asyncio.Semaphore(max(1, ctx.cfg.disk_writers))
        self._error: status_pb2.Status | None = None

    @property
    def root(self) -> str | None:
        """Where versions are written (None: this method is not offered)."""
        return self.ctx.cfg.disk_root

    @property
    def keep(self) -> int:
        """Versions kept under the root after an update."""
        return self.ctx.cfg.keep_versions

    def offer(self, rank: int, world: int) -> pb.TransferOption | None:
        root = self.root
        if not root:
            return None
        return pb.TransferOption(method=self.method, disk=pb.DiskParams(root=root))

    async def load(self, t: Target, path: str) -> tuple[int, int]:
        """Has the server load the version at ``path``: (version served, tensors)."""
        assert t.plan is not None
        reply = await t.stub.UpdateFromDisk(
            pb.UpdateFromDiskRequest(
                plan_id=t.plan.plan_id, policy_version=self.ctx.version, path=path
            ),
            timeout=self.ctx.left(),
        )
        return reply.policy_version, reply.tensor_count

    async def open(self, targets: list[Target]) -> None:
        self.targets = targets
        root = self.root
        if not targets or not root:
            return
        writer = VersionWriter(root, self.ctx.version, self.ctx.bucket_count, keep=self.keep)
        try:
            writer.__enter__()
        except Exception as exc:
            for t in targets:
                t.result.fail_with(status_proto_of(exc, "writing the version directory: "))
            return
        self._writer = writer

    async def send(self, bucket: dict[str, torch.Tensor], index: int) -> None:
        if self._writer is None:
            return
        # Returns once the shard's write has started: up to cfg.disk_writers shards are
        # written at once while the next buckets are gathered (a write is mostly copying
        # into the page cache, which a second core speeds up).
        await self._slots.acquire()
        self._writes.append(asyncio.create_task(self._write_shard(bucket)))

    async def _write_shard(self, bucket: dict[str, torch.Tensor]) -> None:
        try:
            writer = self._writer
            if writer is not None and self._error is None:
                await asyncio.to_thread(writer.add_shard, bucket)
        except Exception as exc:
            # The writer is aborted once no other write of it is running (see close).
            if self._error is None:
                self._error = status_proto_of(exc, "writing the version directory: ")
        finally:
            self._slots.release()

    def _abort(self, error: status_pb2.Status) -> None:
        if self._writer is not None:
            self._writer.__exit__(RuntimeError, RuntimeError(error.message), None)
            self._writer = None
        for t in self.live():
            t.result.fail_with(error)

    async def close(self) -> None:
        await asyncio.gather(*self._writes)
        self._writes.clear()
        writer = self._writer
        if writer is None:
            return
        if self._error is not None:
            self._abort(self._error)
            return
        try:
            if self.ctx.config_json is not None:
                writer.write_config(self.ctx.config_json)
            await asyncio.to_thread(writer.__exit__, None, None, None)
        except Exception as exc:
            self._abort(status_proto_of(exc, "publishing the version directory: "))
            return
        self._writer = None
        rel = version_dir_name(self.ctx.version)

        async def one(t: Target) -> None:
            try:
                version, _ = await self.load(t, rel)
            except Exception as exc:
                t.result.fail_with(status_proto_of(exc))
                return
            t.result.policy_version = version
            t.result.sent_bytes = self.ctx.total_bytes
            t.result.ok = True

        await asyncio.gather(*(one(t) for t in self.live()))
        root = self.root
        assert root is not None
        try:
            await asyncio.to_thread(prune_versions, root, self.keep)
        except OSError as exc:
            log.warning("pruning %s failed: %s", root, exc)
