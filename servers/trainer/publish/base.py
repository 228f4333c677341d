"""What every transfer method shares: the sender's config, targets, results, the interface."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import grpc
import torch
from arealgrpc.v1 import tensor_pb2, weight_sync_pb2, weight_sync_pb2_grpc
from google.rpc import status_pb2

from areal_grpc import tensor_codec as tc
from areal_grpc.errors import describe, status_proto
from areal_grpc.weight_transfer import DEFAULT_BUCKET_BYTES, MAX_CHUNK_BYTES

__all__ = [
    "PublishContext",
    "PublisherConfig",
    "Target",
    "TargetResult",
    "TensorMeta",
    "Transport",
    "cast_floats",
    "wire_dtype",
]

pb = weight_sync_pb2


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

    def sent_as(self, wire: torch.dtype | None) -> TensorMeta:
        """This tensor as it travels when floating-point tensors go in ``wire`` (None: as held)."""
        if wire is None or not self.dtype.is_floating_point:
            return self
        return TensorMeta(self.name, wire, self.shape)

    def spec(self) -> tensor_pb2.TensorSpec:
        """As a ``TensorSpec``."""
        return tensor_pb2.TensorSpec(
            name=self.name, dtype=tc.dtype_to_proto(self.dtype), shape=self.shape
        )


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
class Target:
    """One rollout server in a publication: its channel, the plan it accepted, its calls."""

    result: TargetResult
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub
    channel: grpc.aio.Channel
    plan: weight_sync_pb2.NegotiateResponse | None = None
    call: grpc.aio.StreamUnaryCall | None = None  # type: ignore[type-arg]
    task: asyncio.Task[None] | None = None
    # Asked to relay the update to the other servers of its host (it writes it into its
    # shared memory).
    relay: bool = False
    # The server of this one's host that relays the update to it (it then loads the relayed
    # version directory by SHARED_MEMORY instead of receiving from the sender).
    relay_from: Target | None = None

    @property
    def alive(self) -> bool:
        """Negotiated and not failed."""
        return self.plan is not None and not self.result.error


def wire_dtype(targets: list[Target]) -> torch.dtype | None:
    """The dtype floating-point tensors travel in to ``targets`` (one copy for all of them):
    the one their plans name; float32 when they name several (every receiver takes it); None
    (as the trainer holds them) when none names one."""
    named = set()
    for t in targets:
        if t.plan is not None and t.plan.weights_dtype:
            try:
                named.add(tc.dtype_from_proto(t.plan.weights_dtype))
            except ValueError:  # a dtype this sender does not know: the one all take
                named.add(torch.float32)
    if len(named) > 1:
        return torch.float32
    return named.pop() if named else None


def cast_floats(bucket: dict[str, torch.Tensor], wire: torch.dtype) -> dict[str, torch.Tensor]:
    """``bucket`` with its floating-point tensors in ``wire`` (others as they are)."""
    return {
        name: t.to(wire) if t.is_floating_point() and t.dtype != wire else t
        for name, t in bucket.items()
    }


@dataclass
class PublishContext:
    """What one publication is: shared by the session and its transports."""

    cfg: PublisherConfig
    bucket_bytes: int
    config_json: str | None
    deadline: float
    # Known once the session opens (negotiation starts before: offers do not depend on them).
    version: int = 0
    metas: list[TensorMeta] = field(default_factory=list)
    bucket_count: int = 0

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole published state dict."""
        return sum(m.nbytes for m in self.metas)

    def left(self) -> float:
        """Seconds left for a call (at least 1: a late call still gets a chance to answer)."""
        return max(1.0, self.deadline - time.monotonic())


class Transport(ABC):
    """One transfer method on the sender's side.

    ``offer`` is asked for each server during negotiation; the targets that accepted the
    method are handed to ``open``; each gathered bucket goes to ``send`` (with the index of
    its first tensor); ``close`` finishes the transfer and settles every target's result.
    A target's failure is recorded on its result, never raised.
    """

    method: ClassVar[int]
    # True: ``send`` may be called for the next bucket before the previous call returned (the
    # transport keeps the buckets in order itself, and starts each one as soon as the one
    # before is done); False: the session waits for the previous call first.
    pipelined: ClassVar[bool] = False

    def __init__(self, ctx: PublishContext) -> None:
        self.ctx = ctx
        self.targets: list[Target] = []

    @abstractmethod
    def offer(self, rank: int, world: int) -> weight_sync_pb2.TransferOption | None:
        """The option offered to the server at distributed ``rank`` of ``world``; None: none."""

    @abstractmethod
    async def open(self, targets: list[Target]) -> None:
        """Starts the transfer to ``targets`` (they accepted this method)."""

    @abstractmethod
    async def send(self, bucket: dict[str, torch.Tensor], index: int) -> None:
        """Moves one gathered bucket, whose first tensor has index ``index``."""

    @abstractmethod
    async def close(self) -> None:
        """Finishes the transfer; every target's result says how it ended."""

    @property
    def active(self) -> bool:
        """Whether a bucket has anywhere to go by this method."""
        return any(t.alive for t in self.targets)

    def live(self) -> list[Target]:
        """The targets still in this transfer."""
        return [t for t in self.targets if t.alive]
