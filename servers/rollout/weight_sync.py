"""``WeightSyncService``: a rollout server receives new policy weights.

Five data planes, agreed per sender with ``Negotiate``, each a receiver in its own module
(:mod:`areal_servers.rollout.receive`):

* STREAM (``PushWeights``, ``receive.stream``): CRC-32C-checked chunks reassembled into a staged
  state dict; only a complete, valid stream is swapped in.
* DISK (``UpdateFromDisk``, ``receive.disk``): a versioned safetensors directory that must lie
  inside this server's own configured root.
* DISTRIBUTED (``UpdateFromDistributed``, ``receive.distributed``): broadcasts over a private
  process group with the sender (or SGLang's own group for the ``sglang`` engine).
* SOCKET (``UpdateFromSocket``, ``receive.socket``): CRC-32C-checked frames over a plain TCP
  connection the plan names, read straight into the receive buffers; gRPC keeps the control.
* SHARED_MEMORY (``UpdateFromSharedMemory``, ``receive.shared_memory``): a version directory a
  sender on this host wrote once into ``/dev/shm``, mapped without a copy.

A server asked to relay (``NegotiateRequest.relay``) also writes an update it receives by
STREAM, SOCKET or DISTRIBUTED into a version directory in its own shared memory, from which
the other servers of its host take it by SHARED_MEMORY: the sender's update then crosses the
network to each host once. Every reply says which host's memory the server shares
(``host_id``) and where it would relay (``relay_root``).

Every update names the new policy version; one that is not newer than the served version is
FAILED_PRECONDITION and changes nothing. Updates run one at a time.

Received tensors are handed to the engine without a copy, and the weights they replace become
the next update's receive buffers (``reuse_buffers``): STREAM chunks and DISTRIBUTED
broadcasts and SOCKET frames land in memory already faulted in rather than in fresh pages.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

import grpc
import torch
from areal_servers.rollout.engine import InferenceEngine
from areal_servers.rollout.receive.base import Plan, Receiver, ReceiverConfig, ReceiverState
from areal_servers.rollout.receive.disk import DiskReceiver
from areal_servers.rollout.receive.distributed import DistributedReceiver
from areal_servers.rollout.receive.shared_memory import SharedMemoryReceiver
from areal_servers.rollout.receive.socket import SocketReceiver
from areal_servers.rollout.receive.stream import StreamReceiver
from arealgrpc.v1 import weight_sync_pb2, weight_sync_pb2_grpc

from areal_grpc import tensor_codec as tc
from areal_grpc.errors import (
    FieldError,
    abort_for,
    abort_with,
    invalid_argument,
    status,
)
from areal_grpc.host_memory import tune_malloc
from areal_grpc.server import Service
from areal_grpc.shared_memory import host_id, own_root
from areal_grpc.weight_transfer import (
    MAX_CHUNK_BYTES,
    SERVICE_NAME,
    PushMessage,
    WeightGroup,
    decode_push_request,
)

log = logging.getLogger(__name__)

pb = weight_sync_pb2
METHOD_NAMES = {
    "distributed": pb.TRANSFER_METHOD_DISTRIBUTED,
    "stream": pb.TRANSFER_METHOD_STREAM,
    "disk": pb.TRANSFER_METHOD_DISK,
    "socket": pb.TRANSFER_METHOD_SOCKET,
    "shared_memory": pb.TRANSFER_METHOD_SHARED_MEMORY,
}


T = TypeVar("T")

# The methods whose updates a server can relay to the others of its host (they arrive over
# the network as a state dict this process holds).
RELAYED_METHODS = (
    pb.TRANSFER_METHOD_STREAM,
    pb.TRANSFER_METHOD_SOCKET,
    pb.TRANSFER_METHOD_DISTRIBUTED,
)


@dataclass
class _Counters:
    updates: int = 0
    refused: int = 0
    last_method: str = ""
    by_method: dict[str, int] = field(default_factory=dict)


class WeightSyncServicer(weight_sync_pb2_grpc.WeightSyncServiceServicer):
    """The handlers of ``arealgrpc.v1.WeightSyncService`` over one inference engine."""

    def __init__(self, engine: InferenceEngine, config: ReceiverConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ReceiverConfig()
        unknown = set(self.config.methods) - set(METHOD_NAMES)
        if unknown:
            raise ValueError(f"unknown weight-sync methods {sorted(unknown)}")
        if self.config.max_chunk_bytes > MAX_CHUNK_BYTES or self.config.max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be in 1..{MAX_CHUNK_BYTES}")
        self.state = ReceiverState(engine, self.config)
        self.stream = StreamReceiver(self.state)
        self.disk = DiskReceiver(self.state)
        self.distributed = DistributedReceiver(self.state)
        self.socket = SocketReceiver(self.state)
        self.shared_memory = SharedMemoryReceiver(self.state)
        self.receivers: dict[int, Receiver] = {
            r.method: r
            for r in (self.stream, self.disk, self.distributed, self.socket, self.shared_memory)
        }
        self.counters = _Counters()
        # The host whose shared memory this server shares (reported in every Negotiate reply).
        self.host_id = host_id(self.config.shm_base) if self.config.shm_base else ""
        if "stream" in self.config.methods:
            # Each PushWeights message is a ~1 MiB buffer allocated and freed in turn; keep
            # freed ones mapped instead of faulting fresh pages in for every message.
            tune_malloc()

    @property
    def group(self) -> WeightGroup | None:
        """The DISTRIBUTED weight group this server is in, if any."""
        return self.distributed.group

    @property
    def spare(self) -> dict[str, torch.Tensor]:
        """The receive buffers kept for the next update (see ``reuse_buffers``)."""
        return self.state.spare

    # ------------------------------------------------------------------------ negotiation

    def relay_root(self) -> pb.SharedMemoryParams | None:
        """Where this server would relay updates (its own shared-memory directory and probe);
        None where it cannot: no shared memory, or an engine whose updates do not pass
        through this process as a state dict (vLLM's worker, SGLang)."""
        base = self.config.shm_base
        if base is None or "shared_memory" not in self.config.methods or self.engine.kind != "hf":
            return None
        own = own_root(base)
        if own is None:
            return None
        return pb.SharedMemoryParams(root=str(own[0]), probe=own[1])

    def supported(self) -> list[str]:
        """What this server accepts, in words (quoted in FAILED_PRECONDITION answers)."""
        out = []
        for name in self.config.methods:
            said = self.receivers[METHOD_NAMES[name]].supported()
            if said is not None:
                out.append(said)
        return out

    def _accept(
        self, i: int, offer: pb.TransferOption, declined: list[str]
    ) -> pb.TransferOption | None:
        """The plan for one offer, None when this server does not take it; FieldError if bad."""
        m = offer.method
        if m == pb.TRANSFER_METHOD_UNSPECIFIED or m not in self.receivers:
            raise FieldError(f"offers[{i}].method", f"unknown or unspecified method {m}")
        return self.receivers[m].accept(f"offers[{i}]", offer, declined)

    async def Negotiate(
        self, request: pb.NegotiateRequest, context: grpc.aio.ServicerContext
    ) -> pb.NegotiateResponse:
        """The first offered method this server accepts, with its own parameters."""
        try:
            if not request.offers:
                raise FieldError("offers", "must offer at least one method")
            plan_option = None
            declined: list[str] = []
            for i, offer in enumerate(request.offers):
                plan_option = self._accept(i, offer, declined)
                if plan_option is not None:
                    break
        except FieldError as exc:
            await abort_with(context, invalid_argument(exc))
        if plan_option is None:
            offered = ", ".join(pb.TransferMethod.Name(o.method) for o in request.offers)
            await abort_with(
                context,
                status(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"none of the offered methods ({offered}) is acceptable; this server "
                    f"supports: {'; '.join(self.supported()) or 'nothing'}"
                    + "".join(f"; declined {d}" for d in declined),
                ),
            )
        assert plan_option is not None
        plan = Plan(uuid.uuid4().hex, plan_option, request.sender_id)
        if plan_option.method == pb.TRANSFER_METHOD_DISTRIBUTED:
            plan.group = self.distributed.group_params(plan_option.distributed)
        relay_root = self.relay_root()
        if request.relay and relay_root is not None and plan_option.method in RELAYED_METHODS:
            plan.relay_root = relay_root.root
        self.state.remember(plan)
        log.info(
            "plan %s for %s: %s%s",
            plan.plan_id,
            request.sender_id or "?",
            pb.TransferMethod.Name(plan_option.method),
            f", relayed into {plan.relay_root}" if plan.relay_root else "",
        )
        wanted = self.state.expected_dtype
        return pb.NegotiateResponse(
            plan=plan_option,
            policy_version=self.engine.version,
            plan_id=plan.plan_id,
            weights_dtype=tc.dtype_to_proto(wanted) if wanted is not None else 0,
            relay_root=relay_root,
            host_id=self.host_id,
        )

    # --------------------------------------------------------------------------- updates

    def _count(self, method: str, ok: bool) -> None:
        if ok:
            self.counters.updates += 1
            self.counters.last_method = method
            self.counters.by_method[method] = self.counters.by_method.get(method, 0) + 1
        else:
            self.counters.refused += 1

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
        self._count("", ok=False)
        await abort_for(context, exc)

    async def _update(
        self, method: str, work: Awaitable[T], context: grpc.aio.ServicerContext
    ) -> T:
        """Runs one update call: its reply, or the call aborted with the error's status."""
        try:
            reply = await work
        except Exception as exc:
            await self._fail(context, exc)
        self._count(method, ok=True)
        return reply

    async def PushWeights(
        self, request_iterator: AsyncIterator[PushMessage], context: grpc.aio.ServicerContext
    ) -> pb.PushWeightsResponse:
        """Stages the streamed state dict, then swaps it in atomically."""
        return await self._update("stream", self.stream.update(request_iterator), context)

    async def UpdateFromDisk(
        self, request: pb.UpdateFromDiskRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateFromDiskResponse:
        """Loads a safetensors directory from under this server's root."""
        return await self._update("disk", self.disk.update(request), context)

    async def UpdateFromDistributed(
        self, request: pb.UpdateFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateFromDistributedResponse:
        """Takes part in the sender's broadcasts, then swaps the received weights in."""
        return await self._update("distributed", self.distributed.update(request), context)

    async def UpdateFromSocket(
        self, request: pb.UpdateFromSocketRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateFromSocketResponse:
        """Receives the tensors over the plan's side channel, then swaps them in."""
        work = self.socket.update(request, context.time_remaining())
        return await self._update("socket", work, context)

    async def UpdateFromSharedMemory(
        self, request: pb.UpdateFromSharedMemoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateFromSharedMemoryResponse:
        """Loads a version directory a same-host sender wrote into shared memory."""
        work = self.shared_memory.update(request)
        return await self._update("shared_memory", work, context)

    async def close(self) -> None:
        """Leaves the weight group and closes unused side-channel listeners."""
        for r in self.receivers.values():
            await r.close()


def build_weight_sync_service(
    engine: InferenceEngine, cfg: ReceiverConfig | None = None
) -> Service:
    """The WeightSyncService of a rollout server, ready for ``start_server``.

    ``PushWeights`` is registered with the codec's fast chunk decoder (chunk data sliced out of
    the received bytes without a copy); the other methods use the generated messages.
    """
    servicer = WeightSyncServicer(engine, cfg)
    handlers = {
        "Negotiate": grpc.unary_unary_rpc_method_handler(
            servicer.Negotiate,
            request_deserializer=pb.NegotiateRequest.FromString,
            response_serializer=pb.NegotiateResponse.SerializeToString,
        ),
        "PushWeights": grpc.stream_unary_rpc_method_handler(
            servicer.PushWeights,
            request_deserializer=decode_push_request,
            response_serializer=pb.PushWeightsResponse.SerializeToString,
        ),
        "UpdateFromDisk": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateFromDisk,
            request_deserializer=pb.UpdateFromDiskRequest.FromString,
            response_serializer=pb.UpdateFromDiskResponse.SerializeToString,
        ),
        "UpdateFromDistributed": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateFromDistributed,
            request_deserializer=pb.UpdateFromDistributedRequest.FromString,
            response_serializer=pb.UpdateFromDistributedResponse.SerializeToString,
        ),
        "UpdateFromSocket": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateFromSocket,
            request_deserializer=pb.UpdateFromSocketRequest.FromString,
            response_serializer=pb.UpdateFromSocketResponse.SerializeToString,
        ),
        "UpdateFromSharedMemory": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateFromSharedMemory,
            request_deserializer=pb.UpdateFromSharedMemoryRequest.FromString,
            response_serializer=pb.UpdateFromSharedMemoryResponse.SerializeToString,
        ),
    }

    def add(svc: WeightSyncServicer, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )

    return Service(name=SERVICE_NAME, servicer=servicer, add=add)


__all__ = ["METHOD_NAMES", "WeightSyncServicer", "build_weight_sync_service"]
