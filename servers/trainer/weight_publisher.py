"""Sender side of weight sync: a trainer publishes its weights to rollout servers.

Every rank runs :func:`gather_buckets` (the FSDP all-gathers are collective): parameters are
materialised one at a time with ``DTensor.full_tensor()`` and grouped into buckets of at most
``bucket_bytes``; only rank 0 keeps them. Rank 0 hands each bucket to a :class:`PublishSession`
as soon as it is gathered, with at most one bucket in flight while the next is gathered, so
the full model never exists twice on rank 0 (at most two buckets do, plus, for DISK, the
buckets whose shard files are still being written: ``disk_writers`` at most).

A session negotiates with every rollout server (methods in the caller's preference order),
then moves each bucket by the plan each server accepted:

* STREAM: one ``PushWeights`` call per server; each chunk is encoded once and written to every
  stream server.
* DISK: rank 0 writes the bucket as the next shard of a versioned safetensors directory
  (``disk_writers`` shard files at once; atomic rename when complete, then ``UpdateFromDisk``
  on each disk server; older versions beyond ``keep_versions`` are deleted).
* DISTRIBUTED: a private process group (rank 0 here, the servers at their rank offsets) is
  formed once and reused while its members stay the same; each server gets the metadata
  (``UpdateFromDistributed``), then every tensor is broadcast in order.

A server that fails (refuses, times out, drops) is reported failed with the gRPC status, and
the others go on. Nothing here raises for a server's failure. A DISTRIBUTED member whose call
fails while the group forms or broadcasts (its process died) breaks the group at once: gloo
would keep the survivors waiting on it until the group timeout, so the group's blocked thread
is abandoned (it ends by itself at that timeout), the survivors' calls are cancelled (they drop
the group too) and reported failed with a retryable error; ``clients.fleet`` retries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import torch
from arealgrpc.v1 import tensor_pb2, weight_sync_pb2, weight_sync_pb2_grpc
from google.rpc import status_pb2
from torch.distributed.tensor import DTensor

from areal_grpc import tensor_codec as tc
from areal_grpc.chunk_wire import stream_channel_options
from areal_grpc.chunks import iter_chunk_views
from areal_grpc.errors import describe, status_proto, status_proto_of
from areal_grpc.host_memory import tune_malloc
from areal_grpc.server import aio_channel, default_channel_options
from areal_grpc.weight_disk import VersionWriter, prune_versions, version_dir_name
from areal_grpc.weight_transfer import (
    DEFAULT_BUCKET_BYTES,
    MAX_CHUNK_BYTES,
    PUSH_WEIGHTS_METHOD,
    GroupParams,
    WeightGroup,
    cuda_uuid,
    encode_push_request,
    free_port,
    plan_buckets,
    run_in_thread,
)

log = logging.getLogger(__name__)
pb = weight_sync_pb2
T = TypeVar("T")

DEFAULT_METHODS = (
    pb.TRANSFER_METHOD_DISTRIBUTED,
    pb.TRANSFER_METHOD_STREAM,
    pb.TRANSFER_METHOD_DISK,
)


@dataclass
class PublisherConfig:
    """How a trainer rank publishes weights."""

    # Where rank 0 writes versioned directories for DISK; None: DISK is never offered.
    disk_root: str | None = None
    # Published versions kept under disk_root (older ones are deleted after an update).
    keep_versions: int = 2
    # Gather / broadcast / shard bucket size when a request gives none.
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    # Address the rollout servers use to reach rank 0's weight-group rendezvous.
    master_address: str = "127.0.0.1"
    # "gloo" or "nccl"; None: nccl when the trainer's parameters are on a GPU, else gloo.
    backend: str | None = None
    # Seconds for a group rendezvous or one broadcast.
    group_timeout_s: float = 300.0
    # Seconds for the whole publication when a request gives none.
    timeout_s: float = 600.0
    # Largest PushWeights chunk this sender offers.
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    # DISK shard files written at once, each by its own thread (>= 1). A bucket is held until
    # its shard is written: up to this many gathered buckets besides the one being gathered.
    disk_writers: int = 2


@dataclass
class TensorMeta:
    """A parameter's published name, dtype and full (unsharded) shape."""

    name: str
    dtype: torch.dtype
    shape: list[int]

    @property
    def nbytes(self) -> int:
        """Size of the full tensor in bytes."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def spec(self) -> tensor_pb2.TensorSpec:
        """As a ``TensorSpec``."""
        return tensor_pb2.TensorSpec(
            name=self.name, dtype=tc.dtype_to_proto(self.dtype), shape=self.shape
        )


def published_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or buffer) in state-dict order; tied duplicates are left out.

    Works the same on every rank without communication (DTensor shapes are global), so all
    ranks agree on the order of the gathers.
    """
    owners: dict[str, torch.Tensor] = dict(model.named_parameters())
    owners.update(dict(model.named_buffers()))
    # state_dict() lists tied weights under every name; named_parameters() only once (e.g.
    # lm_head.weight tied to embed_tokens): receivers tie them again themselves.
    return [(name, owners[name]) for name in model.state_dict() if name in owners]


def tensor_metas(model: torch.nn.Module) -> list[TensorMeta]:
    """The metadata of :func:`published_tensors`."""
    return [
        TensorMeta(name, t.dtype, [int(d) for d in t.shape]) for name, t in published_tensors(model)
    ]


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


def gather_buckets(
    model: torch.nn.Module, buckets: Sequence[Sequence[int]], keep: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """Full tensors bucket by bucket (collective: every rank must iterate all of it).

    ``keep`` False (ranks other than 0) yields empty dicts: the rank only joins the gathers.
    """
    items = published_tensors(model)
    with torch.no_grad():
        for bucket in buckets:
            out: dict[str, torch.Tensor] = {}
            for i in bucket:
                name, t = items[i]
                full = _full(t)
                if keep:
                    out[name] = full
                del full
            yield out


class GroupBroken(RuntimeError):
    """A member of the weight group failed while the group's collective work was running."""


@dataclass
class TargetResult:
    """Outcome for one rollout server."""

    address: str
    method: int = pb.TRANSFER_METHOD_UNSPECIFIED
    ok: bool = False
    # Code 0 (OK) until the first failure, which is kept (with the server's error details).
    status: status_pb2.Status = field(default_factory=status_pb2.Status)
    policy_version: int = 0
    sent_bytes: int = 0

    @property
    def error(self) -> str:
        """``CODE: message`` of the failure; empty while none."""
        return describe(self.status) if self.status.code else ""

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Marks the target failed (the first error is kept)."""
        self.fail_with(status_proto(code, message))

    def fail_with(self, st: status_pb2.Status) -> None:
        """Marks the target failed with ``st`` (the first error is kept)."""
        if self.ok or not self.status.code:
            self.status.CopyFrom(st)
        self.ok = False


@dataclass
class _Target:
    result: TargetResult
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub
    channel: grpc.aio.Channel
    plan: weight_sync_pb2.NegotiateResponse | None = None
    call: grpc.aio.StreamUnaryCall | None = None  # type: ignore[type-arg]
    task: asyncio.Task[None] | None = None
    rank: int = 0

    @property
    def alive(self) -> bool:
        return self.plan is not None and not self.result.error


@dataclass
class _GroupCache:
    members: list[str]
    params: GroupParams
    group: WeightGroup | None = None


def _bytes_passthrough(msg: bytes) -> bytes:
    return msg


@dataclass
class SessionStats:
    """What a session moved."""

    tensor_count: int = 0
    total_bytes: int = 0
    elapsed_s: float = 0.0
    by_method: dict[str, int] = field(default_factory=dict)


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
        self._group: _GroupCache | None = None
        # A STREAM publication allocates and frees a ~1 MiB message buffer per chunk; keep
        # freed ones mapped instead of faulting fresh pages in for every message.
        tune_malloc()

    def session(
        self,
        addresses: Sequence[str],
        methods: Sequence[int],
        version: int,
        metas: Sequence[TensorMeta],
        buckets: Sequence[Sequence[int]],
        *,
        bucket_bytes: int,
        timeout_s: float,
        config_json: str | None = None,
    ) -> PublishSession:
        """A session publishing ``version`` (run its coroutines on one event loop)."""
        return PublishSession(
            self,
            list(addresses),
            list(methods) or list(DEFAULT_METHODS),
            version,
            list(metas),
            [list(b) for b in buckets],
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            config_json=config_json,
        )

    def close(self) -> None:
        """Leaves the weight group."""
        if self._group is not None and self._group.group is not None:
            self._group.group.close()
        self._group = None


class PublishSession:
    """One publication from rank 0: ``open``, ``send_bucket`` per bucket, ``close``."""

    def __init__(
        self,
        publisher: WeightPublisher,
        addresses: list[str],
        methods: list[int],
        version: int,
        metas: list[TensorMeta],
        buckets: list[list[int]],
        *,
        bucket_bytes: int,
        timeout_s: float,
        config_json: str | None,
    ) -> None:
        self.publisher = publisher
        self.cfg = publisher.config
        self.methods = methods
        self.version = version
        self.metas = metas
        self.buckets = buckets
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.config_json = config_json
        self.deadline = time.monotonic() + timeout_s
        self.stats = SessionStats(tensor_count=len(metas), total_bytes=sum(m.nbytes for m in metas))
        self._start = time.monotonic()
        self.targets: list[_Target] = []
        # The process default carries the run's TLS and token (set from the server flags).
        opts = default_channel_options(extra=stream_channel_options())
        for address in addresses:
            channel = aio_channel(address, opts)
            self.targets.append(
                _Target(
                    TargetResult(address),
                    weight_sync_pb2_grpc.WeightSyncServiceStub(channel),
                    channel,
                )
            )
        self._tensor_index = 0
        self._disk: VersionWriter | None = None
        self._disk_writes: list[asyncio.Task[None]] = []
        self._disk_slots = asyncio.Semaphore(max(1, self.cfg.disk_writers))
        self._disk_error: status_pb2.Status | None = None
        self._group: WeightGroup | None = None
        # Set when a DISTRIBUTED member's call fails: the group can no longer complete.
        self._member_failed = asyncio.Event()
        self._failed_member = ""

    # --------------------------------------------------------------------------- helpers

    def _left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def _of(self, method: int) -> list[_Target]:
        return [t for t in self.targets if t.alive and t.result.method == method]

    def _offer(
        self, method: int, rank: int, world: int, params: tuple[int, str] | None
    ) -> pb.TransferOption | None:
        if method == pb.TRANSFER_METHOD_STREAM:
            return pb.TransferOption(
                method=method, stream=pb.StreamParams(max_chunk_bytes=self.cfg.max_chunk_bytes)
            )
        if method == pb.TRANSFER_METHOD_DISK:
            if not self.cfg.disk_root:
                return None
            return pb.TransferOption(method=method, disk=pb.DiskParams(root=self.cfg.disk_root))
        if method == pb.TRANSFER_METHOD_DISTRIBUTED and params is not None:
            port, name = params
            backend = (
                pb.COLLECTIVE_BACKEND_NCCL
                if self.publisher.backend == "nccl"
                else pb.COLLECTIVE_BACKEND_GLOO
            )
            return pb.TransferOption(
                method=method,
                distributed=pb.DistributedParams(
                    backend=backend,
                    master_address=self.cfg.master_address,
                    master_port=port,
                    world_size=world,
                    rank_offset=rank,
                    group_name=name,
                    bucket_bytes=self.bucket_bytes,
                    device_uuid=self.publisher.device_uuid,
                ),
            )
        return None

    async def _negotiate(
        self, target: _Target, methods: Sequence[int], rank: int, world: int, params: object
    ) -> None:
        offers = [
            o
            for m in methods
            if (o := self._offer(m, rank, world, params)) is not None  # type: ignore[arg-type]
        ]
        if not offers:
            target.result.fail(grpc.StatusCode.FAILED_PRECONDITION, "no method left to offer")
            target.plan = None
            return
        try:
            reply = await target.stub.Negotiate(
                pb.NegotiateRequest(offers=offers, sender_id=self.publisher.sender_id),
                timeout=min(60.0, self._left()),
            )
        except Exception as exc:
            target.result.fail_with(status_proto_of(exc, "negotiate: "))
            target.plan = None
            return
        target.plan = reply
        target.result.method = reply.plan.method
        target.result.policy_version = reply.policy_version
        if reply.policy_version >= self.version:
            target.result.fail(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"serves version {reply.policy_version}, not older than "
                f"the published {self.version}",
            )

    # ------------------------------------------------------------------------------ open

    async def open(self) -> None:
        """Negotiates with every server and starts each method's transfer."""
        pub = self.publisher
        addresses = [t.result.address for t in self.targets]
        cache = pub._group
        if cache is not None and cache.members == addresses:
            params: tuple[int, str] | None = (cache.params.master_port, cache.params.group_name)
        else:
            params = (free_port(self.cfg.master_address), f"areal-weights-{uuid.uuid4().hex[:8]}")
        world = len(self.targets) + 1
        await asyncio.gather(
            *(
                self._negotiate(t, self.methods, i + 1, world, params)
                for i, t in enumerate(self.targets)
            )
        )
        # Distributed ranks must be exactly 1..n for the servers that took DISTRIBUTED; when
        # some did not (or a cached group is gone on a server), renegotiate those with a fresh
        # group until the set is consistent.
        offered = {t.result.address: i + 1 for i, t in enumerate(self.targets)}
        offered_world = world
        while True:
            members = self._of(pb.TRANSFER_METHOD_DISTRIBUTED)
            if not members:
                break
            consistent = offered_world == len(members) + 1 and all(
                offered[t.result.address] == j + 1 for j, t in enumerate(members)
            )
            reuse = (
                cache is not None
                and cache.group is not None
                and params == (cache.params.master_port, cache.params.group_name)
            )
            if reuse and not all(t.plan.plan.distributed.joined for t in members):  # type: ignore[union-attr]
                consistent = False
            if consistent:
                break
            params = (free_port(self.cfg.master_address), f"areal-weights-{uuid.uuid4().hex[:8]}")
            offered_world = len(members) + 1
            offered = {t.result.address: j + 1 for j, t in enumerate(members)}
            await asyncio.gather(
                *(
                    self._negotiate(
                        t, [pb.TRANSFER_METHOD_DISTRIBUTED], j + 1, offered_world, params
                    )
                    for j, t in enumerate(members)
                )
            )
        await self._open_stream()
        self._open_disk()
        members = self._of(pb.TRANSFER_METHOD_DISTRIBUTED)
        if members and params is not None:
            await self._open_distributed(members, params)

    async def _open_stream(self) -> None:
        targets = self._of(pb.TRANSFER_METHOD_STREAM)
        header = pb.PushWeightsRequest(
            header=pb.PushWeightsHeader(
                policy_version=self.version,
                tensor_count=len(self.metas),
                total_bytes=self.stats.total_bytes,
            )
        )
        for t in targets:
            assert t.plan is not None
            multi = t.channel.stream_unary(
                PUSH_WEIGHTS_METHOD,
                request_serializer=_bytes_passthrough,
                response_deserializer=pb.PushWeightsResponse.FromString,
            )
            t.call = multi(timeout=self._left())
            header.header.plan_id = t.plan.plan_id
            await self._write(t, header.SerializeToString())

    def _open_disk(self) -> None:
        if not self._of(pb.TRANSFER_METHOD_DISK) or not self.cfg.disk_root:
            return
        writer = VersionWriter(
            self.cfg.disk_root, self.version, len(self.buckets), keep=self.cfg.keep_versions
        )
        try:
            writer.__enter__()
        except Exception as exc:
            for t in self._of(pb.TRANSFER_METHOD_DISK):
                t.result.fail_with(status_proto_of(exc, "writing the version directory: "))
            return
        self._disk = writer

    async def _open_distributed(self, members: list[_Target], params: tuple[int, str]) -> None:
        pub = self.publisher
        port, name = params
        gp = GroupParams(
            master_address=self.cfg.master_address,
            master_port=port,
            world_size=len(members) + 1,
            rank=0,
            group_name=name,
            backend=pub.backend,
            timeout_s=self.cfg.group_timeout_s,
            device=str(pub.device) if pub.backend == "nccl" and pub.device.type == "cuda" else "",
        )
        addresses = [t.result.address for t in members]
        request = pb.UpdateFromDistributedRequest(
            policy_version=self.version,
            tensors=[m.spec() for m in self.metas],
            bucket_bytes=self.bucket_bytes,
        )
        # The metadata calls return only after every broadcast: start them, then join.
        for t in members:
            assert t.plan is not None
            req = pb.UpdateFromDistributedRequest()
            req.CopyFrom(request)
            req.plan_id = t.plan.plan_id
            t.task = asyncio.create_task(self._distributed_call(t, req))
        cache = pub._group
        if cache is not None and cache.params == gp and cache.group is not None:
            self._group = cache.group
            return
        if cache is not None and cache.group is not None:
            cache.group.close()
        pub._group = None
        try:
            self._group = await self._group_work(lambda: WeightGroup(gp))
        except Exception as exc:
            self._break_group(grpc.StatusCode.UNAVAILABLE, f"weight group did not form: {exc}")
            return
        pub._group = _GroupCache(addresses, gp, self._group)

    async def _distributed_call(self, t: _Target, req: pb.UpdateFromDistributedRequest) -> None:
        try:
            reply = await t.stub.UpdateFromDistributed(req, timeout=self._left())
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

    def _break_group(self, code: grpc.StatusCode, error: str) -> None:
        """Fails every DISTRIBUTED member and drops the group; members still in it are cancelled.

        The group object is not closed: a collective may still block in an abandoned thread.
        Members that failed on their own keep their own error; the others get ``code`` and
        ``error`` (ABORTED or UNAVAILABLE, so the caller may retry them in a new group).
        """
        for t in self.targets:
            if t.result.method != pb.TRANSFER_METHOD_DISTRIBUTED or t.plan is None:
                continue
            t.result.fail(code, error)
            if t.task is not None and not t.task.done():
                t.task.cancel()
        self._group = None
        self.publisher._group = None

    # ------------------------------------------------------------------------------ send

    async def _write(self, t: _Target, data: bytes) -> None:
        if t.call is None or t.result.error:
            return
        try:
            await t.call.write(data)
        except Exception as exc:
            t.result.fail_with(status_proto_of(exc, "stream: "))
            with contextlib.suppress(Exception):
                t.call.cancel()

    async def send_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        """Moves one gathered bucket by every method in use (servers in parallel)."""
        stream = self._of(pb.TRANSFER_METHOD_STREAM)
        jobs = []
        if stream:
            jobs.append(self._stream_bucket(bucket, stream))
        if self._disk is not None:
            jobs.append(self._disk_bucket(bucket))
        if self._group is not None and self._of(pb.TRANSFER_METHOD_DISTRIBUTED):
            jobs.append(self._broadcast_bucket(bucket))
        await asyncio.gather(*jobs)
        self._tensor_index += len(bucket)

    async def _stream_bucket(self, bucket: dict[str, torch.Tensor], targets: list[_Target]) -> None:
        index = self._tensor_index
        chunk = self.cfg.max_chunk_bytes
        for t in targets:
            assert t.plan is not None
            chunk = min(chunk, t.plan.plan.stream.max_chunk_bytes or chunk)
        # One write in flight per call (grpc.aio allows no more): the next chunk is encoded
        # while the previous one is being written.
        writing: asyncio.Future[list[None]] | None = None
        for k, (name, tensor) in enumerate(bucket.items()):
            for view in iter_chunk_views({name: tensor}, chunk):
                view.tensor_index = index + k
                # Encoded once (the data's one copy), written to every stream server.
                data = encode_push_request(view)
                if writing is not None:
                    await writing
                live = [t for t in targets if not t.result.error]
                if not live:
                    return
                writing = asyncio.gather(*(self._write(t, data) for t in live))
                for t in live:
                    t.result.sent_bytes += len(view.data)
        if writing is not None:
            await writing

    async def _disk_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        # Returns once the shard's write has started: up to cfg.disk_writers shards are
        # written at once while the next buckets are gathered (a write is mostly copying
        # into the page cache, which a second core speeds up).
        await self._disk_slots.acquire()
        self._disk_writes.append(asyncio.create_task(self._write_shard(bucket)))

    async def _write_shard(self, bucket: dict[str, torch.Tensor]) -> None:
        try:
            writer = self._disk
            if writer is not None and self._disk_error is None:
                await asyncio.to_thread(writer.add_shard, bucket)
        except Exception as exc:
            # The writer is aborted once no other write of it is running (see _close_disk).
            if self._disk_error is None:
                self._disk_error = status_proto_of(exc, "writing the version directory: ")
        finally:
            self._disk_slots.release()

    def _abort_disk(self, error: status_pb2.Status) -> None:
        if self._disk is not None:
            self._disk.__exit__(RuntimeError, RuntimeError(error.message), None)
            self._disk = None
        for t in self._of(pb.TRANSFER_METHOD_DISK):
            t.result.fail_with(error)

    async def _broadcast_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        group = self._group
        assert group is not None

        def run() -> None:
            for tensor in bucket.values():
                t = tensor.to(group.device).contiguous()
                group.broadcast(t, src=0)

        try:
            await self._group_work(run)
        except GroupBroken as exc:
            self._break_group(grpc.StatusCode.ABORTED, f"the weight group broke: {exc}")
            return
        except Exception as exc:
            # A broken collective breaks the group for every member. Its thread has ended, so
            # (unlike an abandoned one) the group can be closed here.
            group.close()
            self._break_group(
                grpc.StatusCode.ABORTED, f"the weight group broke: broadcast failed: {exc}"
            )
            return
        for t in self._of(pb.TRANSFER_METHOD_DISTRIBUTED):
            t.result.sent_bytes += sum(v.numel() * v.element_size() for v in bucket.values())

    # ----------------------------------------------------------------------------- close

    async def close(self) -> list[TargetResult]:
        """Finishes every transfer and returns one result per server (request order)."""
        await asyncio.gather(self._close_stream(), self._close_disk(), self._close_distributed())
        for t in self.targets:
            if t.plan is None and not t.result.error:
                t.result.fail(grpc.StatusCode.INTERNAL, "no plan")
            with contextlib.suppress(Exception):
                await t.channel.close()
        self.stats.elapsed_s = time.monotonic() - self._start
        for t in self.targets:
            if t.result.ok:
                name = pb.TransferMethod.Name(t.result.method)
                self.stats.by_method[name] = self.stats.by_method.get(name, 0) + 1
        return [t.result for t in self.targets]

    async def _close_stream(self) -> None:
        async def finish(t: _Target) -> None:
            if t.call is None:
                return
            if t.result.error:
                with contextlib.suppress(Exception):
                    t.call.cancel()
                return
            try:
                await t.call.done_writing()
                reply = await t.call
            except Exception as exc:
                t.result.fail_with(status_proto_of(exc))
                return
            t.result.policy_version = reply.policy_version
            t.result.ok = True

        await asyncio.gather(*(finish(t) for t in self.targets))

    async def _close_disk(self) -> None:
        await asyncio.gather(*self._disk_writes)
        self._disk_writes.clear()
        writer = self._disk
        if writer is None:
            return
        if self._disk_error is not None:
            self._abort_disk(self._disk_error)
            return
        try:
            if self.config_json is not None:
                writer.write_config(self.config_json)
            await asyncio.to_thread(writer.__exit__, None, None, None)
        except Exception as exc:
            self._abort_disk(status_proto_of(exc, "publishing the version directory: "))
            return
        self._disk = None
        rel = version_dir_name(self.version)

        async def load(t: _Target) -> None:
            assert t.plan is not None
            try:
                reply = await t.stub.UpdateFromDisk(
                    pb.UpdateFromDiskRequest(
                        plan_id=t.plan.plan_id, policy_version=self.version, path=rel
                    ),
                    timeout=self._left(),
                )
            except Exception as exc:
                t.result.fail_with(status_proto_of(exc))
                return
            t.result.policy_version = reply.policy_version
            t.result.sent_bytes = self.stats.total_bytes
            t.result.ok = True

        await asyncio.gather(*(load(t) for t in self._of(pb.TRANSFER_METHOD_DISK)))
        assert self.cfg.disk_root is not None
        try:
            await asyncio.to_thread(prune_versions, self.cfg.disk_root, self.cfg.keep_versions)
        except OSError as exc:
            log.warning("pruning %s failed: %s", self.cfg.disk_root, exc)

    async def _close_distributed(self) -> None:
        tasks = [t.task for t in self.targets if t.task is not None]
        if tasks:
            # Cancelled members (a broken group) end with CancelledError: already recorded.
            await asyncio.gather(*tasks, return_exceptions=True)


def run_publication(
    model: torch.nn.Module,
    rank: int,
    loop: asyncio.AbstractEventLoop | None,
    session_factory: object | None,
    bucket_bytes: int,
) -> tuple[list[TargetResult], SessionStats]:
    """Body of a publication on one rank's torch thread (collective over the trainer group).

    ``session_factory(metas, buckets)`` (rank 0 only) returns a :class:`PublishSession`
    whose coroutines run on ``loop``; other ranks pass None and only join the gathers.
    """
    metas = tensor_metas(model)
    buckets = plan_buckets([m.nbytes for m in metas], bucket_bytes)
    session: PublishSession | None = None
    broken: BaseException | None = None

    def call(coro: object) -> Future[object]:
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop)  # type: ignore[arg-type]

    if rank == 0 and session_factory is not None and loop is not None:

        async def make() -> PublishSession:
            # On the event loop: the session's grpc.aio channels belong to it.
            return session_factory(metas, buckets)  # type: ignore[operator,no-any-return]

        try:
            session = call(make()).result()  # type: ignore[assignment]
        except BaseException as exc:  # keep gathering: the other ranks wait in the gathers
            broken = exc

    opened: Future[object] | None = call(session.open()) if session is not None else None
    pending: Future[object] | None = None

    def settle(fut: Future[object] | None) -> None:
        nonlocal broken, session
        if fut is None or session is None:
            return
        try:
            fut.result()
        except BaseException as exc:  # keep gathering: the other ranks wait in the gathers
            broken, session = exc, None

    for bucket in gather_buckets(model, buckets, keep=session is not None):
        if session is None:
            continue
        # Negotiation overlaps the first gather; at most one bucket is in flight while the
        # next one is gathered.
        settle(opened)
        opened = None
        settle(pending)
        pending = None
        if session is not None:
            pending = call(session.send_bucket(bucket))
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
    "DEFAULT_METHODS",
    "PublishSession",
    "PublisherConfig",
    "SessionStats",
    "TargetResult",
    "TensorMeta",
    "WeightPublisher",
    "gather_buckets",
    "published_tensors",
    "run_publication",
    "tensor_metas",
]
