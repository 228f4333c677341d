"""Sender side of weight sync: a trainer publishes its weights to rollout servers.

Every rank runs :func:`gather_buckets` (the FSDP all-gathers are collective): the parameters
are grouped into buckets of at most ``bucket_bytes`` and each bucket's sharded ones are
gathered in one all-gather (every rank holds the bucket's bytes while it runs); only rank 0
keeps them. Rank 0 hands each bucket to a :class:`PublishSession`
as soon as it is gathered (a transport queues it behind the one it is sending), then waits
for the bucket before it to be sent before gathering more, so the full model never exists
twice on rank 0: at most two buckets do (one being sent, one gathered or queued behind it),
plus, for DISK, the buckets whose shard files are still being written (``disk_writers`` at
most).

A session negotiates with every rollout server (methods in the caller's preference order;
begun as the request arrives, while the torch thread lists the tensors), then moves each
bucket by the plan each server accepted, through that method's transport
(:mod:`areal_servers.trainer.publish`: ``stream``, ``socket``, ``shared_memory``, ``disk``,
``distributed``, one module each behind one interface).

A server that fails (refuses, times out, drops) is reported failed with the gRPC status, and
the others go on. Nothing here raises for a server's failure; a broken DISTRIBUTED group's
survivors are reported with a retryable error, and ``clients.fleet`` retries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TypeVar

import grpc
import torch
from areal_servers.trainer.publish.base import (
    PublishContext,
    PublisherConfig,
    Target,
    TargetResult,
    TensorMeta,
    Transport,
    cast_floats,
    wire_dtype,
)
from areal_servers.trainer.publish.disk import DiskTransport
from areal_servers.trainer.publish.distributed import DistributedTransport, GroupCache
from areal_servers.trainer.publish.shared_memory import SharedMemoryTransport
from areal_servers.trainer.publish.socket import SocketTransport
from areal_servers.trainer.publish.stream import StreamTransport
from arealgrpc.v1 import weight_sync_pb2, weight_sync_pb2_grpc
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from areal_grpc.chunk_wire import stream_channel_options
from areal_grpc.errors import status_proto_of
from areal_grpc.host_memory import tune_malloc
from areal_grpc.model import adapter_names, is_lora
from areal_grpc.ports import free_port
from areal_grpc.server import ChannelCache
from areal_grpc.shared_memory import host_id
from areal_grpc.weight_disk import version_dir_name
from areal_grpc.weight_transfer import (
    cuda_uuid,
    plan_buckets,
)

log = logging.getLogger(__name__)
pb = weight_sync_pb2
T = TypeVar("T")

# Every method a publication may offer.
METHODS = (
    pb.TRANSFER_METHOD_DISTRIBUTED,
    pb.TRANSFER_METHOD_SHARED_MEMORY,
    pb.TRANSFER_METHOD_SOCKET,
    pb.TRANSFER_METHOD_STREAM,
    pb.TRANSFER_METHOD_DISK,
)


def default_methods(device: torch.device) -> tuple[int, ...]:
    """The offer order when the caller names none, by the trainer's device.

    Each server takes the first offer it can, so this order is per topology: on a CPU
    trainer, servers on its host map SHARED_MEMORY (measured 0.18 s per 394 MiB update
    against 0.28 s for DISTRIBUTED over gloo and 0.29 s for SOCKET, one run of
    bench/weight_sync.py) and servers on other hosts, which decline it, join DISTRIBUTED
    (one broadcast for the whole fleet). On a GPU trainer DISTRIBUTED (NCCL,
    device to device) comes first: SHARED_MEMORY would copy the weights through host memory.
    """
    if device.type == "cuda":
        return METHODS
    return (
        pb.TRANSFER_METHOD_SHARED_MEMORY,
        pb.TRANSFER_METHOD_DISTRIBUTED,
        pb.TRANSFER_METHOD_SOCKET,
        pb.TRANSFER_METHOD_STREAM,
        pb.TRANSFER_METHOD_DISK,
    )


def _published_names(model: torch.nn.Module) -> list[str]:
    """The names :func:`published_tensors` lists, in state-dict order."""
    names = list(model.state_dict())
    if is_lora(model):
        trained = adapter_names(model)
        return [name for name in names if name in trained]
    # state_dict() lists tied weights under every name; named_parameters() only once (e.g.
    # lm_head.weight tied to embed_tokens): receivers tie them again themselves.
    owners = {name for name, _ in model.named_parameters()}
    owners.update(name for name, _ in model.named_buffers())
    return [name for name in names if name in owners]


# Per model: the names never change between publications, and listing them through
# state_dict() (hooks, a DTensor per FSDP2 parameter) cost 2-5 ms of every update.
_NAMES: weakref.WeakKeyDictionary[torch.nn.Module, list[str]] = weakref.WeakKeyDictionary()


def published_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or buffer) in state-dict order; tied duplicates are left out.

    A LoRA model publishes its adapters only: the frozen base weights and buffers are the
    same in every process from the start. Works the same on every rank without
    communication (DTensor shapes are global), so all ranks agree on the order of the gathers.
    """
    # Reshard first: an FSDP2 root module keeps its parameters gathered after a forward
    # without backward, and the parameters read next must be the sharded ones, not unsharded
    # ones about to be freed.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    names = _NAMES.get(model)
    if names is None:
        names = _NAMES[model] = _published_names(model)
    owners: dict[str, torch.Tensor] = dict(model.named_parameters())
    owners.update(dict(model.named_buffers()))
    return [(name, owners[name]) for name in names]


def tensor_metas(
    model: torch.nn.Module, items: Sequence[tuple[str, torch.Tensor]] | None = None
) -> list[TensorMeta]:
    """The metadata of :func:`published_tensors` (``items``: those already listed)."""
    items = published_tensors(model) if items is None else items
    return [TensorMeta(name, t.dtype, [int(d) for d in t.shape]) for name, t in items]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter: gathered for a DTensor sharded over several ranks.

    On a one-rank mesh the local shard already is the full tensor: it is used as it is (a
    view of the parameter, read before the publication returns), with no all-gather copy.
    """
    if not isinstance(t, DTensor):
        return t.detach()
    if t.device_mesh.size() == 1:
        local = t.detach().to_local()
        if tuple(local.shape) == tuple(t.shape):
            return local
    return t.full_tensor()


def _row_sharded(t: torch.Tensor) -> bool:
    """A DTensor sharded by rows over a 1-D mesh of several ranks (what ``fully_shard`` makes)."""
    return (
        isinstance(t, DTensor)
        and t.device_mesh.ndim == 1
        and t.device_mesh.size() > 1
        and tuple(t.placements) == (Shard(0),)
        and t.dim() > 0
    )


def _gather_rows(tensors: list[DTensor], keep: bool) -> list[torch.Tensor]:
    """The full tensors of row-sharded DTensors of one dtype and mesh, in one all-gather.

    ``full_tensor()`` per parameter costs a collective each: 50 of them took 70-95 ms for
    builtin:tiny over gloo on 2 ranks, against one per bucket here. Each rank packs its shards,
    padded to the chunk ``torch.chunk`` gives rank 0 (the layout ``Shard(0)`` uses), into one
    flat buffer; rank r's rows of a tensor then sit at the same offset of r's part.
    """
    mesh = tensors[0].device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    layout = []  # (chunk rows, elements per row, offset) per tensor
    total = 0
    for t in tensors:
        rows = t.shape[0]
        per_row = t.numel() // rows if rows else 0
        chunk = -(-rows // world)
        layout.append((chunk, per_row, total))
        total += chunk * per_row
    local = tensors[0].to_local()
    send = torch.zeros(total, dtype=local.dtype, device=local.device)
    for t, (chunk, per_row, offset) in zip(tensors, layout, strict=True):
        shard = t.to_local().reshape(-1)
        # Ranks past the last row hold an empty shard; only the last non-empty one is short.
        assert shard.numel() <= chunk * per_row, (rank, t.shape, shard.shape)
        send[offset : offset + shard.numel()].copy_(shard)
    recv = torch.empty(world * total, dtype=send.dtype, device=send.device)
    torch.distributed.all_gather_into_tensor(recv, send, group=mesh.get_group())
    if not keep:
        return []
    parts = recv.view(world, total)
    out = []
    for t, (chunk, per_row, offset) in zip(tensors, layout, strict=True):
        rows = t.shape[0]
        pieces = [
            parts[r, offset : offset + min(chunk, max(0, rows - r * chunk)) * per_row]
            for r in range(world)
        ]
        out.append(torch.cat(pieces).view(t.shape))  # a tensor of its own, one copy
    return out


def gather_buckets(
    items: Sequence[tuple[str, torch.Tensor]], buckets: Sequence[Sequence[int]], keep: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """Full tensors of :func:`published_tensors`' ``items``, bucket by bucket (collective:
    every rank must iterate all of it).

    The row-sharded parameters of a bucket (FSDP2's, on several ranks) are gathered together,
    one all-gather per dtype; anything else one by one. ``keep`` False (ranks other than 0)
    yields empty dicts: the rank only joins the gathers.
    """
    with torch.no_grad():
        for bucket in buckets:
            full: dict[str, torch.Tensor] = {}
            groups: dict[tuple[torch.dtype, int], list[int]] = {}
            for i in bucket:
                name, t = items[i]
                if _row_sharded(t):
                    groups.setdefault((t.dtype, id(t.device_mesh)), []).append(i)
                else:
                    tensor = _full(t)
                    if keep:
                        full[name] = tensor
                    del tensor
            for members in groups.values():
                gathered = _gather_rows([items[i][1] for i in members], keep)  # type: ignore[misc]
                for i, tensor in zip(members, gathered, strict=False):
                    full[items[i][0]] = tensor
                del gathered
            # In the items' order, as a receiver lists them.
            yield {items[i][0]: full[items[i][0]] for i in bucket} if keep else {}


@dataclass
class SessionStats:
    """What a session moved."""

    tensor_count: int = 0
    total_bytes: int = 0
    elapsed_s: float = 0.0
    by_method: dict[str, int] = field(default_factory=dict)


def relayed(targets: Sequence[Target]) -> list[Target]:
    """The targets that take the publication from their host's relay."""
    return [t for t in targets if t.relay_from is not None]


@dataclass
class RelayPlan:
    """Which servers took the last publication from their host's relay: the publication's
    servers, each relayed server's relay, and each relay's shared-memory directory."""

    addresses: list[str]
    relay_of: dict[str, str]
    roots: dict[str, pb.SharedMemoryParams]


class WeightPublisher:
    """Rank 0's sender: keeps the distributed group between publications."""

    def __init__(
        self,
        config: PublisherConfig | None = None,
        sender_id: str = "",
        *,
        device: torch.device,
    ) -> None:
        """``device``: the rank's own (engine.resolve_device); the backend follows it."""
        self.config = config or PublisherConfig()
        self.sender_id = sender_id or f"trainer-{uuid.uuid4().hex[:8]}"
        backend = self.config.backend
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.backend = backend
        self.device = device
        # Receivers on this very GPU decline NCCL (it refuses two ranks on one device).
        self.device_uuid = cuda_uuid(device) if backend == "nccl" else ""
        # The weight group kept between publications (see publish.distributed).
        self.group: GroupCache | None = None
        # The relays of the last publication (see PublishSession._plan_relays), taken up
        # again by the next one to the same servers.
        self.relays: RelayPlan | None = None
        # This host, as its shared memory (servers reporting it get shared memory, not relays).
        self.host_id = host_id()
        # A STREAM publication allocates and frees a ~1 MiB message buffer per chunk; keep
        # freed ones mapped instead of faulting fresh pages in for every message.
        tune_malloc()
        # Channels to the rollout servers, kept between publications on the server's event
        # loop (a fresh one costs a connection and an HTTP/2 handshake before Negotiate).
        self._channels = ChannelCache(extra=stream_channel_options())

    def session(
        self,
        addresses: Sequence[str],
        methods: Sequence[int],
        *,
        bucket_bytes: int,
        timeout_s: float,
        config_json: str | None = None,
    ) -> PublishSession:
        """A publication to ``addresses`` (make it and run its coroutines on one event loop)."""
        self._channels.prune()
        return PublishSession(
            self,
            [self._channels.get(a) for a in addresses],
            list(addresses),
            list(methods) or list(default_methods(self.device)),
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            config_json=config_json,
        )

    async def aclose(self) -> None:
        """Leaves the weight group and closes the kept channels."""
        self.close()
        await self._channels.aclose()

    def close(self) -> None:
        """Leaves the weight group."""
        if self.group is not None and self.group.group is not None:
            self.group.group.close()
        self.group = None


class PublishSession:
    """One publication from rank 0: ``begin`` (negotiation), ``open`` once the version and the
    tensors are known, ``send_bucket`` per bucket, ``close``."""

    def __init__(
        self,
        publisher: WeightPublisher,
        channels: list[grpc.aio.Channel],
        addresses: list[str],
        methods: list[int],
        *,
        bucket_bytes: int,
        timeout_s: float,
        config_json: str | None,
    ) -> None:
        self.publisher = publisher
        self.cfg = publisher.config
        self.methods = methods
        self.ctx = PublishContext(
            cfg=self.cfg,
            bucket_bytes=bucket_bytes,
            config_json=config_json,
            deadline=time.monotonic() + timeout_s,
        )
        self.stats = SessionStats()
        self._start = time.monotonic()
        self.distributed = DistributedTransport(self.ctx, publisher)
        self.transports: dict[int, Transport] = {
            pb.TRANSFER_METHOD_STREAM: StreamTransport(self.ctx),
            pb.TRANSFER_METHOD_SOCKET: SocketTransport(self.ctx),
            pb.TRANSFER_METHOD_SHARED_MEMORY: SharedMemoryTransport(self.ctx),
            pb.TRANSFER_METHOD_DISK: DiskTransport(self.ctx),
            pb.TRANSFER_METHOD_DISTRIBUTED: self.distributed,
        }
        self.targets = [
            Target(TargetResult(a), weight_sync_pb2_grpc.WeightSyncServiceStub(c), c)
            for a, c in zip(addresses, channels, strict=True)
        ]
        self._tensor_index = 0
        self._negotiation: asyncio.Future[None] | None = None
        self._opened = False
        # Each transport's latest send: a transport gets its buckets one at a time, in order.
        self._sending: dict[int, asyncio.Future[None]] = {}
        # The dtype each method's floating-point tensors travel in (None: as held).
        self._wire: dict[int, torch.dtype | None] = {}
        # Held while a bucket is cast and its sends are queued, so buckets keep their order.
        self._queueing = asyncio.Lock()
        # The weight-group ranks offered to the servers, and the group's size.
        self._offered: dict[str, int] = {}
        self._offered_world = 0

    def _of(self, method: int) -> list[Target]:
        """The live targets the sender sends to by ``method`` (relayed ones are not)."""
        return [
            t
            for t in self.targets
            if t.alive and t.result.method == method and t.relay_from is None
        ]

    async def _negotiate(
        self,
        target: Target,
        methods: Sequence[int],
        rank: int,
        world: int,
        offers: Sequence[pb.TransferOption] | None = None,
    ) -> None:
        if offers is None:
            offers = [
                o
                for m in methods
                if m in self.transports and (o := self.transports[m].offer(rank, world)) is not None
            ]
        if not offers:
            target.result.fail(grpc.StatusCode.FAILED_PRECONDITION, "no method left to offer")
            target.plan = None
            return
        try:
            reply = await target.stub.Negotiate(
                pb.NegotiateRequest(
                    offers=offers, sender_id=self.publisher.sender_id, relay=target.relay
                ),
                timeout=min(60.0, self.ctx.left()),
            )
        except Exception as exc:
            target.result.fail_with(status_proto_of(exc, "negotiate: "))
            target.plan = None
            return
        target.plan = reply
        target.result.method = reply.plan.method
        target.result.policy_version = reply.policy_version
        if self._opened:
            self._check_version(target)

    def _check_version(self, target: Target) -> None:
        """Fails a server that already serves the published version or a newer one."""
        if target.plan is not None:
            served = target.plan.policy_version
            if served >= self.ctx.version:
                target.result.fail(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"serves version {served}, not older than the published {self.ctx.version}",
                )

    def _fresh_group_params(self) -> tuple[int, str]:
        return (free_port(self.cfg.master_address), f"areal-weights-{uuid.uuid4().hex[:8]}")

    def begin(self) -> None:
        """Starts negotiating with every server (before the version and tensors are known:
        it overlaps the trainer's preparation); :meth:`open` waits for it."""
        if self._negotiation is None:
            self._negotiation = asyncio.ensure_future(self._negotiate_all())

    async def _negotiate_all(self) -> None:
        addresses = [t.result.address for t in self.targets]
        # The same servers as last time: the same relays, so one round of negotiation and
        # the weight group kept (its members are the servers the sender sends to).
        relays = self.publisher.relays
        if relays is None or relays.addresses != addresses:
            relays = RelayPlan(addresses, {}, {})
        by_address = {t.result.address: t for t in self.targets}
        direct = [t for t in self.targets if t.result.address not in relays.relay_of]
        for t in direct:
            t.relay = t.result.address in relays.roots
        cache = self.publisher.group
        dist = self.distributed
        if cache is not None and cache.members == [t.result.address for t in direct]:
            dist.params = (cache.params.master_port, cache.params.group_name)
        else:
            dist.params = self._fresh_group_params()
        world = len(direct) + 1
        ranks = {t.result.address: i + 1 for i, t in enumerate(direct)}

        # What the weight group was offered as (open() checks the servers that took it).
        self._offered, self._offered_world = ranks, world
        followers = [
            (t, relays.relay_of[t.result.address])
            for t in self.targets
            if t.result.address in relays.relay_of
        ]
        await asyncio.gather(
            *(self._negotiate(t, self.methods, ranks[t.result.address], world) for t in direct),
            *(
                self._follow(t, by_address[a], relays.roots[a], world - 1, world)
                for t, a in followers
            ),
        )

    async def open(self, version: int, metas: list[TensorMeta], buckets: list[list[int]]) -> None:
        """Publishes ``version`` (``metas`` in ``buckets``): waits for the negotiation, then
        starts each method's transfer."""
        self.ctx.version = version
        self.ctx.metas = metas
        self.ctx.bucket_count = len(buckets)
        self.stats = SessionStats(tensor_count=len(metas), total_bytes=self.ctx.total_bytes)
        self._opened = True
        self.begin()
        assert self._negotiation is not None
        await self._negotiation
        for t in self.targets:
            self._check_version(t)
        await self._plan_relays()
        # Distributed ranks must be exactly 1..n for the servers that took DISTRIBUTED; when
        # some did not (or a cached group is gone on a server), renegotiate those with a fresh
        # group until the set is consistent.
        dist = self.distributed
        offered, offered_world = self._offered, self._offered_world
        while True:
            members = self._of(pb.TRANSFER_METHOD_DISTRIBUTED)
            if not members:
                break
            consistent = offered_world == len(members) + 1 and all(
                offered.get(t.result.address) == j + 1 for j, t in enumerate(members)
            )
            if dist.reusable() and not all(t.plan.plan.distributed.joined for t in members):  # type: ignore[union-attr]
                consistent = False
            if consistent:
                break
            dist.params = self._fresh_group_params()
            offered_world = len(members) + 1
            offered = {t.result.address: j + 1 for j, t in enumerate(members)}
            await asyncio.gather(
                *(
                    self._negotiate(t, [pb.TRANSFER_METHOD_DISTRIBUTED], j + 1, offered_world)
                    for j, t in enumerate(members)
                )
            )
        for method, transport in self.transports.items():
            targets = self._of(method)
            # In the dtype the receivers serve (bf16: half of fp32's bytes), cast once per
            # bucket for every receiver of the method.
            wire = wire_dtype(targets)
            self._wire[method] = wire
            if wire is not None:
                transport.ctx = replace(self.ctx, metas=[m.sent_as(wire) for m in metas])
            await transport.open(targets)

    async def _plan_relays(self) -> None:
        """One send per host: of the hf-engine servers that share one host's memory (their
        replies' ``host_id``; another host than this one) and would receive over the network,
        one relays the update into its shared memory and the others load it from there.

        A server that declines the relayed offer is negotiated with again as before. The
        plan is kept for the next publication to the same servers.
        """
        own = self.publisher.host_id
        # A weight group's ranks as offered; a server offered none gets a valid one, which
        # open() makes consistent afterwards (it renegotiates the group).
        ranks, world = self._offered, self._offered_world
        hosts: dict[tuple[str, int], list[Target]] = {}
        for t in self.targets:
            plan = t.plan
            if not t.alive or plan is None or not plan.host_id or plan.host_id == own:
                continue
            # Relays and the servers they serve are hf engines (their replies name a relay
            # root): vLLM's and SGLang's servers read weight files with a config of their
            # own, which a relayed directory does not carry; they keep their own copy.
            if t.relay_from is not None or not plan.HasField("relay_root"):
                continue
            if t.result.method in (pb.TRANSFER_METHOD_SHARED_MEMORY, pb.TRANSFER_METHOD_DISK):
                continue
            # One copy serves one dtype: servers of a host that serve another get their own.
            hosts.setdefault((plan.host_id, plan.weights_dtype), []).append(t)
        for group in hosts.values():
            if len(group) < 2:
                continue
            leader = next((t for t in group if t.relay), group[0])
            if not leader.relay:
                leader.relay = True
                rank = ranks.get(leader.result.address, world - 1)
                await self._negotiate(leader, [leader.result.method], rank, world)
            if leader.plan is None or not leader.plan.HasField("relay_root"):
                continue
            root = leader.plan.relay_root
            await asyncio.gather(
                *(
                    self._follow(t, leader, root, ranks.get(t.result.address, world - 1), world)
                    for t in group
                    if t is not leader
                )
            )
        self.publisher.relays = RelayPlan(
            [t.result.address for t in self.targets],
            {t.result.address: t.relay_from.result.address for t in relayed(self.targets)},
            {
                t.relay_from.result.address: t.relay_from.plan.relay_root
                for t in relayed(self.targets)
                if t.relay_from.plan is not None
            },
        )

    async def _follow(
        self, t: Target, leader: Target, root: pb.SharedMemoryParams, rank: int, world: int
    ) -> None:
        """Offers ``t`` the version directory ``leader`` will relay into ``root`` (by
        SHARED_MEMORY); where ``t`` declines (its relay is not the one it was), it is
        negotiated with again as before (``rank`` of ``world`` for a weight group)."""
        offer = pb.TransferOption(method=pb.TRANSFER_METHOD_SHARED_MEMORY, shared_memory=root)
        await self._negotiate(t, (), 0, 0, offers=[offer])
        if t.plan is not None:
            t.relay_from = leader
            return
        t.result = TargetResult(t.result.address)  # the decline is not a failure
        await self._negotiate(t, self.methods, rank, world)

    async def _load_relayed(self, t: Target) -> None:
        """Has ``t`` load the version its host's relay wrote (after the relay's update)."""
        leader = t.relay_from
        assert leader is not None and t.plan is not None
        if not leader.result.ok:
            t.result.fail(
                grpc.StatusCode.UNAVAILABLE,
                f"its host's relay {leader.result.address} failed: {leader.result.error}",
            )
            return
        try:
            reply = await t.stub.UpdateFromSharedMemory(
                pb.UpdateFromSharedMemoryRequest(
                    plan_id=t.plan.plan_id,
                    policy_version=self.ctx.version,
                    path=version_dir_name(self.ctx.version),
                ),
                timeout=self.ctx.left(),
            )
        except Exception as exc:
            t.result.fail_with(status_proto_of(exc, "loading the relayed version: "))
            return
        t.result.policy_version = reply.policy_version
        t.result.ok = True

    async def abandon(self) -> None:
        """Ends a session if it was never opened (its negotiation is stopped); an opened one
        is left to its publication."""
        if self._negotiation is not None and not self._opened:
            self._negotiation.cancel()
            with contextlib.suppress(BaseException):
                await self._negotiation

    async def send_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        """Moves one gathered bucket by every method in use (servers in parallel).

        May be called before the previous bucket's call returned: each transport still gets
        its buckets one at a time and in order, and starts the next one as soon as it is
        done with the previous one, without waiting for the caller.
        """
        index = self._tensor_index
        self._tensor_index += len(bucket)

        async def send(
            transport: Transport,
            tensors: dict[str, torch.Tensor],
            previous: asyncio.Future[None] | None,
        ) -> None:
            if previous is not None and not transport.pipelined:
                await asyncio.wait([previous])  # its outcome is on the targets' results
            await transport.send(tensors, index)

        sends = []
        # The lock is taken in call order (it is fair): a later bucket whose cast is quicker
        # still queues its sends after this one's.
        async with self._queueing:
            cast: dict[torch.dtype, dict[str, torch.Tensor]] = {}
            for method, transport in self.transports.items():
                wire = self._wire.get(method)
                if wire is None or wire in cast or not transport.active:
                    continue
                if any(t.is_floating_point() and t.dtype != wire for t in bucket.values()):
                    cast[wire] = await asyncio.to_thread(cast_floats, bucket, wire)
                else:
                    cast[wire] = bucket
            for method, transport in self.transports.items():
                wire = self._wire.get(method)
                tensors = cast.get(wire, bucket) if wire is not None else bucket
                # Tasks start in the order they are made: a pipelined transport sees its
                # buckets in order.
                task = asyncio.ensure_future(send(transport, tensors, self._sending.get(method)))
                self._sending[method] = task
                sends.append(task)
        await asyncio.gather(*sends)

    async def close(self) -> list[TargetResult]:
        """Finishes every transfer and returns one result per server (request order)."""
        await asyncio.gather(*self._sending.values(), return_exceptions=True)
        await asyncio.gather(*(t.close() for t in self.transports.values()))
        await asyncio.gather(*(self._load_relayed(t) for t in relayed(self.targets) if t.alive))
        for t in self.targets:
            if t.plan is None and not t.result.error:
                t.result.fail(grpc.StatusCode.INTERNAL, "no plan")
        self.stats.elapsed_s = time.monotonic() - self._start
        for t in self.targets:
            if t.result.ok:
                name = pb.TransferMethod.Name(t.result.method)
                self.stats.by_method[name] = self.stats.by_method.get(name, 0) + 1
        return [t.result for t in self.targets]


def run_publication(
    model: torch.nn.Module,
    version: int,
    loop: asyncio.AbstractEventLoop | None,
    session: PublishSession | None,
    bucket_bytes: int,
) -> tuple[list[TargetResult], SessionStats]:
    """Body of a publication of ``version`` on one rank's torch thread (collective over the
    trainer group).

    Rank 0 passes its :class:`PublishSession` (made, and best begun, on ``loop``, where its
    coroutines run); other ranks pass None and only join the gathers.
    """
    items = published_tensors(model)
    metas = tensor_metas(model, items)
    buckets = plan_buckets([m.nbytes for m in metas], bucket_bytes)
    broken: BaseException | None = None

    def call(coro: object) -> Future[object]:
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop)  # type: ignore[arg-type]

    if session is not None and loop is None:
        raise ValueError("a session needs the event loop it runs on")
    opened: Future[object] | None = (
        call(session.open(version, metas, buckets)) if session is not None else None
    )
    pending: Future[object] | None = None

    def settle(fut: Future[object] | None) -> None:
        nonlocal broken, session
        if fut is None or session is None:
            return
        try:
            fut.result()
        except BaseException as exc:  # keep gathering: the other ranks wait in the gathers
            broken, session = exc, None

    for bucket in gather_buckets(items, buckets, keep=session is not None):
        if session is None:
            continue
        # Negotiation overlaps the first gather. A bucket is handed over as soon as it is
        # gathered (the transports queue it behind the one they are sending), and the next
        # one is gathered once the previous one is sent: at most two buckets at a time.
        settle(opened)
        opened = None
        if session is not None:
            sent = call(session.send_bucket(bucket))
            settle(pending)
            pending = sent
        del bucket
    settle(opened)
    settle(pending)
    stats = SessionStats(tensor_count=len(metas), total_bytes=sum(m.nbytes for m in metas))
    if broken is not None:
        raise RuntimeError(f"publishing failed on rank 0: {broken!r}") from broken
    if session is None:
        return [], stats
    results = call(session.close()).result()
    return results, session.stats  # type: ignore[return-value]


__all__ = [
    "METHODS",
    "PublishSession",
    "SessionStats",
    "WeightPublisher",
    "default_methods",
    "gather_buckets",
    "published_tensors",
    "run_publication",
    "tensor_metas",
]
