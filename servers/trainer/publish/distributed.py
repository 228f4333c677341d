"""DISTRIBUTED: a private process group (rank 0 here, the servers at their rank offsets) is
formed once and reused while its members stay the same; each server gets the metadata
(``UpdateFromDistributed``), then every tensor is broadcast in order.

A member whose call fails while the group forms or broadcasts (its process died) breaks the
group at once: gloo would keep the survivors waiting on it until the group timeout, so the
group's blocked thread is abandoned (it ends by itself at that timeout), the survivors' calls
are cancelled (they drop the group too) and reported failed with a retryable error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import torch
from areal_servers.trainer.publish.base import PublishContext, Target, Transport
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc.errors import status_proto_of
from areal_grpc.weight_transfer import GroupParams, WeightGroup, run_in_thread

__all__ = ["DistributedTransport", "GroupBroken", "GroupCache", "GroupOwner"]

pb = weight_sync_pb2
T = TypeVar("T")


class GroupBroken(RuntimeError):
    """A member of the weight group failed while the group's collective work was running."""


@dataclass
class GroupCache:
    """The weight group kept between publications, and who is in it."""

    members: list[str]
    params: GroupParams
    group: WeightGroup | None = None


class GroupOwner(Protocol):
    """What keeps the group between publications (the rank's publisher)."""

    backend: str
    device: torch.device
    device_uuid: str
    group: GroupCache | None


class DistributedTransport(Transport):
    """Broadcasts over a torch.distributed group of rank 0 and the servers."""

    method = pb.TRANSFER_METHOD_DISTRIBUTED

    def __init__(self, ctx: PublishContext, owner: GroupOwner) -> None:
        super().__init__(ctx)
        self.owner = owner
        # (rendezvous port, group name) offered in the current negotiation round.
        self.params: tuple[int, str] | None = None
        self._group: WeightGroup | None = None
        # Set when a member's call fails: the group can no longer complete.
        self._member_failed = asyncio.Event()
        self._failed_member = ""

    def offer(self, rank: int, world: int) -> pb.TransferOption | None:
        if self.params is None:
            return None
        port, name = self.params
        backend = (
            pb.COLLECTIVE_BACKEND_NCCL
            if self.owner.backend == "nccl"
            else pb.COLLECTIVE_BACKEND_GLOO
        )
        return pb.TransferOption(
            method=self.method,
            distributed=pb.DistributedParams(
                backend=backend,
                master_address=self.ctx.cfg.master_address,
                master_port=port,
                world_size=world,
                rank_offset=rank,
                group_name=name,
                bucket_bytes=self.ctx.bucket_bytes,
                device_uuid=self.owner.device_uuid,
            ),
        )

    def reusable(self) -> bool:
        """Whether the offered params are those of the group kept from before."""
        cache = self.owner.group
        return (
            cache is not None
            and cache.group is not None
            and self.params == (cache.params.master_port, cache.params.group_name)
        )

    async def open(self, targets: list[Target]) -> None:
        self.targets = targets
        if not targets or self.params is None:
            return
        owner = self.owner
        port, name = self.params
        gp = GroupParams(
            master_address=self.ctx.cfg.master_address,
            master_port=port,
            world_size=len(targets) + 1,
            rank=0,
            group_name=name,
            backend=owner.backend,
            timeout_s=self.ctx.cfg.group_timeout_s,
            device=str(owner.device)
            if owner.backend == "nccl" and owner.device.type == "cuda"
            else "",
        )
        addresses = [t.result.address for t in targets]
        request = pb.UpdateFromDistributedRequest(
            policy_version=self.ctx.version,
            tensors=[m.spec() for m in self.ctx.metas],
            bucket_bytes=self.ctx.bucket_bytes,
        )
        # The metadata calls return only after every broadcast: start them, then join.
        for t in targets:
            assert t.plan is not None
            req = pb.UpdateFromDistributedRequest()
            req.CopyFrom(request)
            req.plan_id = t.plan.plan_id
            t.task = asyncio.create_task(self._call(t, req))
        cache = owner.group
        if cache is not None and cache.params == gp and cache.group is not None:
            self._group = cache.group
            return
        if cache is not None and cache.group is not None:
            cache.group.close()
        owner.group = None
        try:
            self._group = await self._group_work(lambda: WeightGroup(gp))
        except Exception as exc:
            self._break(grpc.StatusCode.UNAVAILABLE, f"weight group did not form: {exc}")
            return
        owner.group = GroupCache(addresses, gp, self._group)

    async def _call(self, t: Target, req: pb.UpdateFromDistributedRequest) -> None:
        try:
            reply = await t.stub.UpdateFromDistributed(req, timeout=self.ctx.left())
        except asyncio.CancelledError:
            t.result.fail(grpc.StatusCode.ABORTED, "cancelled: the weight group broke")
            raise
        except Exception as exc:
            t.result.fail_with(status_proto_of(exc))
            # This member left the collective (died, or refused before joining): the group
            # cannot complete, so nobody waits for it any longer.
            if not self._failed_member:
                self._failed_member = f"{t.result.address}: {t.result.error}"
            self._member_failed.set()
            return
        t.result.policy_version = reply.policy_version
        if not t.result.error:
            t.result.ok = True

    async def _group_work(self, fn: Callable[[], T]) -> T:
        """``fn()`` (blocking group work) in a thread; GroupBroken once a member's call fails.

        A collective waiting on a dead member only ends at the group timeout; the thread is
        then left to end by itself and the publication goes on without the group.
        """
        work = run_in_thread(fn, "weight-publish")
        failed = asyncio.ensure_future(self._member_failed.wait())
        try:
            await asyncio.wait({work, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if work.done():
            return work.result()
        work.cancel()
        raise GroupBroken(f"a member failed ({self._failed_member})")

    def _break(self, code: grpc.StatusCode, error: str) -> None:
        """Fails every member and drops the group; members still in it are cancelled.

        The group object is not closed: a collective may still block in an abandoned thread.
        Members that failed on their own keep their own error; the others get ``code`` and
        ``error`` (ABORTED or UNAVAILABLE, so the caller may retry them in a new group).
        """
        for t in self.targets:
            if t.plan is None:
                continue
            t.result.fail(code, error)
            if t.task is not None and not t.task.done():
                t.task.cancel()
        self._group = None
        self.owner.group = None

    async def send(self, bucket: dict[str, torch.Tensor], index: int) -> None:
        group = self._group
        if group is None or not self.live():
            return

        def run() -> None:
            for tensor in bucket.values():
                t = tensor.to(group.device).contiguous()
                group.broadcast(t, src=0)

        try:
            await self._group_work(run)
        except GroupBroken as exc:
            self._break(grpc.StatusCode.ABORTED, f"the weight group broke: {exc}")
            return
        except Exception as exc:
            # A broken collective breaks the group for every member. Its thread has ended, so
            # (unlike an abandoned one) the group can be closed here.
            group.close()
            self._break(grpc.StatusCode.ABORTED, f"the weight group broke: broadcast failed: {exc}")
            return
        for t in self.live():
            t.result.sent_bytes += sum(v.numel() * v.element_size() for v in bucket.values())

    async def close(self) -> None:
        tasks = [t.task for t in self.targets if t.task is not None]
        if tasks:
            # Cancelled members (a broken group) end with CancelledError: already recorded.
            await asyncio.gather(*tasks, return_exceptions=True)
