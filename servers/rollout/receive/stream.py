"""STREAM (``PushWeights``): a header, then CRC-32C-checked chunks, reassembled into a staged
state dict; only a complete, valid stream is swapped in (``engine.load_weights`` is atomic), so
a broken or corrupt stream leaves the old weights serving."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch
from areal_servers.rollout.receive.base import Receiver
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc import tensor_codec as tc
from areal_grpc.chunks import ChunkLike, StateDictAssembler
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.server import drain_requests
from areal_grpc.weight_transfer import PushMessage

__all__ = ["StreamReceiver"]

pb = weight_sync_pb2
# A rejected stream is read on (and dropped) for at most this many messages before the status
# goes out (drain_requests).
_DRAIN_MESSAGES = 1 << 16


class StreamReceiver(Receiver):
    """``PushWeights`` streams."""

    name = "stream"
    method = pb.TRANSFER_METHOD_STREAM

    def accept(
        self, where: str, offer: pb.TransferOption, declined: list[str]
    ) -> pb.TransferOption | None:
        if not self.enabled:
            return None
        limit = self.state.config.max_chunk_bytes
        asked = offer.stream.max_chunk_bytes if offer.HasField("stream") else 0
        if asked < 0:
            raise FieldError(f"{where}.stream.max_chunk_bytes", f"is negative ({asked})")
        chunk = min(asked or limit, limit)
        return pb.TransferOption(method=self.method, stream=pb.StreamParams(max_chunk_bytes=chunk))

    def supported(self) -> str | None:
        if not self.enabled:
            return None
        return f"TRANSFER_METHOD_STREAM (chunks <= {self.state.config.max_chunk_bytes} B)"

    async def close(self) -> None:
        """Nothing is held between updates."""

    async def update(self, requests: AsyncIterator[PushMessage]) -> pb.PushWeightsResponse:
        """Stages the streamed state dict, then swaps it in atomically."""
        state = self.state
        try:
            header, state_dict, received = await self._read_stream(requests)
        except (FieldError, PreconditionError):
            await drain_requests(requests, _DRAIN_MESSAGES)
            raise
        try:
            async with state.update_lock:
                state.check_version(header.policy_version, "header.policy_version")
                plan = state.plans.get(header.plan_id)
                relay = plan.relay_root if plan is not None else None
                await state.load(state_dict, header.policy_version, relay_root=relay)
        except Exception:
            state.give_back(state_dict)  # not installed: still free to receive into
            raise
        return pb.PushWeightsResponse(
            policy_version=state.engine.version,
            tensor_count=len(state_dict),
            received_bytes=received,
        )

    async def _read_stream(
        self, requests: AsyncIterator[PushMessage]
    ) -> tuple[pb.PushWeightsHeader, dict[str, torch.Tensor], int]:
        state = self.state
        first = None
        async for msg in requests:
            first = msg
            break
        if not isinstance(first, pb.PushWeightsRequest) or not first.HasField("header"):
            raise FieldError("header", "the stream must start with a PushWeightsHeader")
        header = first.header
        plan = state.plan(header.plan_id, self.method, required=False)
        max_chunk = state.config.max_chunk_bytes
        if plan is not None:
            max_chunk = plan.option.stream.max_chunk_bytes or max_chunk
        # Refuse a stale version before reading (and allocating) anything.
        state.check_version(header.policy_version, "header.policy_version")
        if header.tensor_count == 0:
            raise FieldError("header.tensor_count", "must be >= 1")
        if header.total_bytes > state.config.max_total_bytes:
            raise FieldError(
                "header.total_bytes",
                f"{header.total_bytes} exceeds this server's limit {state.config.max_total_bytes}",
            )
        asm = StateDictAssembler(
            expected_tensors=header.tensor_count,
            max_total_bytes=header.total_bytes,
            buffers=state.spare,
        )
        try:
            await self._read_chunks(requests, asm, max_chunk)
            state_dict = asm.finish()
            state.check_tensors(state_dict)
            if len(state_dict) != header.tensor_count:
                raise FieldError(
                    "header.tensor_count",
                    f"announced {header.tensor_count} tensors, {len(state_dict)} arrived",
                )
            if asm.total_bytes != header.total_bytes:
                raise FieldError(
                    "header.total_bytes",
                    f"announced {header.total_bytes} bytes, the tensors hold {asm.total_bytes}",
                )
        except BaseException:
            state.give_back(asm.taken)  # a broken stream: the buffers hold nothing served
            raise
        # Every chunk's data landed in a tensor: the bytes received are the tensors' bytes.
        return header, state_dict, asm.total_bytes

    async def _read_chunks(
        self, requests: AsyncIterator[PushMessage], asm: StateDictAssembler, max_chunk: int
    ) -> None:
        async for msg in requests:
            if isinstance(msg, pb.PushWeightsRequest):
                if msg.HasField("header"):
                    raise FieldError("header", "sent twice")
                if not msg.HasField("chunk"):
                    raise FieldError("kind", "empty message: set header or chunk")
                chunk: ChunkLike = msg.chunk
            else:
                chunk = msg
            n = len(chunk.data)
            if n > max_chunk:
                raise FieldError(
                    f"{tc.tensor_label(chunk.name)}.chunk[{chunk.chunk_index}].data",
                    f"{n} bytes exceed the plan's max_chunk_bytes {max_chunk}",
                )
            asm.add(chunk)
