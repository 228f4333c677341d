"""Pieces of the weight-sync protocol shared by senders and receivers.

* ``PushWeights`` wire format: a :class:`PushWeightsRequest` header, then chunks encoded by the
  codec's fast path (``PushWeightsRequest.chunk`` is field 2), so a chunk's data is copied once
  on the way out and sliced without a copy on the way in. Any protobuf library can still talk
  to the method: the bytes are plain ``PushWeightsRequest`` messages.
* Buckets: how an ordered list of tensors is cut into broadcast / shard buckets (AReaL's rule,
  identical on both sides so a receiver can recompute the sender's buckets).
* :class:`WeightGroup`: a torch.distributed process group of its own (a ``TCPStore`` at the
  sender plus a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object), independent of any default
  group the process already belongs to: the trainer's own FSDP group is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from arealgrpc.v1 import tensor_pb2, weight_sync_pb2
from google.protobuf.message import DecodeError

from areal_grpc import tensor_codec as tc
from areal_grpc.chunk_wire import decode_chunk, encode_chunk
from areal_grpc.chunks import ChunkLike, ChunkView

log = logging.getLogger(__name__)

PUSH_WEIGHTS_METHOD = "/arealgrpc.v1.WeightSyncService/PushWeights"
SERVICE_NAME = "arealgrpc.v1.WeightSyncService"
#: Largest chunk data per PushWeights message (the contract's limit).
MAX_CHUNK_BYTES = tc.MiB
DEFAULT_BUCKET_BYTES = 64 * tc.MiB

PushMessage = weight_sync_pb2.PushWeightsRequest | ChunkView

T = TypeVar("T")


def run_in_thread(fn: Callable[[], T], name: str = "weight-group") -> asyncio.Future[T]:
    """``fn()`` on a thread of its own; a future on the running loop for its result.

    For blocking collective work that may have to be abandoned: a gloo collective whose peer
    died can only end at the group timeout, and a caller that knows the group is broken stops
    awaiting the future (the thread ends by itself later). A thread of its own, not the loop's
    default executor, so an abandoned collective never takes a slot other work needs.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if fut.done():  # abandoned (cancelled) meanwhile
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # handed to the awaiting side
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=body, name=name, daemon=True).start()
    return fut


def encode_push_request(msg: weight_sync_pb2.PushWeightsRequest | ChunkLike) -> bytes:
    """Wire bytes of a PushWeights message: a full request, or a chunk (view) as field 2."""
    if isinstance(msg, weight_sync_pb2.PushWeightsRequest):
        return msg.SerializeToString()
    return encode_chunk(msg, wrap_field=2)


def decode_push_request(buf: bytes) -> PushMessage:
    """A chunk as a zero-copy :class:`ChunkView`, or any other message parsed in full."""
    try:
        return decode_chunk(buf, wrap_field=2)
    except DecodeError:
        # No single chunk field: a header (or an unusual encoding the full parser handles).
        return weight_sync_pb2.PushWeightsRequest.FromString(buf)


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of tensors grouped in order into buckets of at most ``bucket_bytes``.

    A bucket is closed before a tensor that would overflow it (a tensor bigger than the limit
    gets a bucket of its own). ``bucket_bytes <= 0`` means one bucket for everything.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        if current and bucket_bytes > 0 and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def spec_nbytes(spec: tensor_pb2.TensorSpec) -> int:
    """Byte size of a ``TensorSpec`` (FieldError for a bad dtype)."""
    dtype = tc.dtype_from_proto(spec.dtype, f"{tc.tensor_label(spec.name)}.dtype")
    n = 1
    for d in spec.shape:
        n *= int(d)
    return n * dtype.itemsize


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form SGLang's ParamSpec dtypes take)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class GroupParams:
    """Where and how a weight group rendezvouses; this process is ``rank``."""

    master_address: str
    master_port: int
    world_size: int
    rank: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 300.0
    # nccl: this rank's GPU ("": the thread's current one).
    device: str = ""


class WeightGroup:
    """A private process group between a sender (rank 0) and receivers (ranks 1..).

    Creating one blocks until every rank has joined (or ``timeout_s`` passes). Collectives
    are called on the group object directly, never through ``torch.distributed``'s default
    group, so a process may also belong to another group (the trainer's FSDP group).
    """

    def __init__(self, params: GroupParams) -> None:
        self.params = params
        timeout = datetime.timedelta(seconds=params.timeout_s)
        host = params.master_address
        self._store = dist.TCPStore(
            host,
            params.master_port,
            params.world_size,
            is_master=params.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        # Keys as torch.distributed names them for a group its helpers form on a rendezvous
        # store (SGLang's init_custom_process_group does): "<group>", "<group>/", then the
        # device's "cpu/" or "cuda/". The name keeps several groups apart on one port space,
        # and a receiver that forms its side that way (an SGLang server) meets ours.
        device_prefix = "cpu/" if params.backend == "gloo" else "cuda/"
        store = dist.PrefixStore(params.group_name, self._store)
        store = dist.PrefixStore(device_prefix, dist.PrefixStore(f"{params.group_name}/", store))
        if params.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            # Bind to the interface that reaches the master, not whatever the hostname says.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_ip_for(host))]
            self.pg: object = dist.ProcessGroupGloo(store, params.rank, params.world_size, opts)
            self.device = torch.device("cpu")
        elif params.backend == "nccl":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None or not torch.cuda.is_available():
                raise RuntimeError("the nccl backend needs a CUDA build of torch and a GPU")
            self.device = (
                torch.device(params.device)
                if params.device
                else torch.device("cuda", torch.cuda.current_device())
            )
            # The communicator binds to the current device of the thread that creates it.
            torch.cuda.set_device(self.device)
            nopts = nccl.Options()
            nopts._timeout = timeout
            self.pg = nccl(store, params.rank, params.world_size, nopts)
        else:
            raise ValueError(f"unknown backend {params.backend!r}")
        # No collective of its own here: an SGLang member makes none before the first
        # broadcast, and would never answer one. Gloo connects every rank while the group
        # forms (a missing one fails that); NCCL forms its communicator on the first broadcast.

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.params.rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcasts ``tensor`` in place from ``src`` (blocks until done)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Releases the group's connections (best effort)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            # An already broken group may refuse; there is nothing more to release then.
            with contextlib.suppress(Exception):
                shutdown()


#: A receive buffer for (name, dtype, shape, device): a kept one that fits, or a fresh one.
BufferSource = Callable[[str, torch.dtype, Sequence[int], torch.device], torch.Tensor]


class GroupMember:
    """A receiver's side of DISTRIBUTED updates: the weight group it last joined (kept while
    the sender's group stays the same) and the broadcasts it takes there. Blocking: run it on
    a thread of its own (:func:`run_in_thread`); an update given up meanwhile sets the
    ``abandoned`` event it was given and calls :meth:`abandon`."""

    def __init__(self, who: str = "") -> None:
        self.who = who
        self.group: WeightGroup | None = None
        # Orders an abandon against a receiving thread keeping the group it joined.
        self._lock = threading.Lock()

    def join(self, params: GroupParams, abandoned: threading.Event) -> WeightGroup:
        """The group of ``params``: the current one, or a freshly joined one."""
        if self.group is not None and self.group.params == params:
            return self.group
        if self.group is not None:
            self.group.close()
            self.group = None
        log.info(
            "%sjoining weight group %s at %s:%d as rank %d/%d (%s)",
            self.who,
            params.group_name,
            params.master_address,
            params.master_port,
            params.rank,
            params.world_size,
            params.backend,
        )
        group = WeightGroup(params)
        with self._lock:
            if not abandoned.is_set():
                self.group = group
                return group
        # The update was given up while this thread waited in the rendezvous.
        group.close()
        raise RuntimeError(f"weight group {params.group_name} was abandoned")

    def receive(
        self,
        params: GroupParams,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        buffer: BufferSource,
        abandoned: threading.Event,
    ) -> dict[str, torch.Tensor]:
        """Takes the sender's broadcast of each of ``specs`` (name, dtype, shape), in order,
        into ``buffer``'s tensors on the group's device; landed when this returns."""
        group = self.join(params, abandoned)
        out: dict[str, torch.Tensor] = {}
        try:
            for name, dtype, shape in specs:
                t = buffer(name, dtype, shape, group.device)
                group.broadcast(t, src=0)
                out[name] = t
            if group.device.type == "cuda":
                # The tensors are used next on another thread's stream.
                torch.cuda.current_stream(group.device).synchronize()
        except Exception:
            # A failed collective leaves the group unusable; the next update forms a new one.
            group.close()
            with self._lock:
                if self.group is group:
                    self.group = None
            raise
        return out

    def abandon(self) -> None:
        """Forgets the group without closing it: a collective may still block in it, on the
        thread that ends it at the group timeout."""
        with self._lock:
            self.group = None

    def close(self) -> None:
        """Leaves the group (best effort)."""
        if self.group is not None:
            self.group.close()
            self.group = None


def cuda_uuid(device: torch.device | str) -> str:
    """The GPU's UUID ("" for a non-CUDA device): which physical GPU, across processes.

    Indices are no good for that: each process may see other GPUs under CUDA_VISIBLE_DEVICES.
    """
    d = torch.device(device)
    if d.type != "cuda" or not torch.cuda.is_available():
        return ""
    index = d.index if d.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def _local_ip_for(remote: str) -> str:
    """The local address this host uses to reach ``remote`` (loopback stays loopback)."""
    if remote in ("127.0.0.1", "localhost", "::1"):
        return remote
    try:
        with socket.socket(
            socket.AF_INET6 if ":" in remote else socket.AF_INET, socket.SOCK_DGRAM
        ) as s:
            s.connect((remote, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MAX_CHUNK_BYTES",
    "PUSH_WEIGHTS_METHOD",
    "SERVICE_NAME",
    "BufferSource",
    "GroupMember",
    "GroupParams",
    "PushMessage",
    "WeightGroup",
    "decode_push_request",
    "encode_push_request",
    "plan_buckets",
    "run_in_thread",
    "spec_nbytes",
    "torch_dtype_name",
]
