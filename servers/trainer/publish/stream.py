"""STREAM: one ``PushWeights`` call per server; each chunk is encoded once and written to
every stream server."""

from __future__ import annotations

import asyncio
import contextlib

import torch
from areal_servers.trainer.publish.base import Target, Transport
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc.chunks import iter_chunk_views
from areal_grpc.errors import status_proto_of
from areal_grpc.weight_transfer import PUSH_WEIGHTS_METHOD, encode_push_request

__all__ = ["StreamTransport"]

pb = weight_sync_pb2


def _bytes_passthrough(msg: bytes) -> bytes:
    return msg


class StreamTransport(Transport):
    """Chunked ``PushWeights`` streams, applied by each server once its stream completes."""

    method = pb.TRANSFER_METHOD_STREAM

    def offer(self, rank: int, world: int) -> pb.TransferOption | None:
        return pb.TransferOption(
            method=self.method, stream=pb.StreamParams(max_chunk_bytes=self.ctx.cfg.max_chunk_bytes)
        )

    async def open(self, targets: list[Target]) -> None:
        self.targets = targets
        header = pb.PushWeightsRequest(
            header=pb.PushWeightsHeader(
                policy_version=self.ctx.version,
                tensor_count=len(self.ctx.metas),
                total_bytes=self.ctx.total_bytes,
            )
        )
        for t in targets:
            assert t.plan is not None
            multi = t.channel.stream_unary(
                PUSH_WEIGHTS_METHOD,
                request_serializer=_bytes_passthrough,
                response_deserializer=pb.PushWeightsResponse.FromString,
            )
            t.call = multi(timeout=self.ctx.left())
            header.header.plan_id = t.plan.plan_id
            await self._write(t, header.SerializeToString())

    async def _write(self, t: Target, data: bytes) -> None:
        if t.call is None or t.result.error:
            return
        try:
            await t.call.write(data)
        except Exception as exc:
            t.result.fail_with(status_proto_of(exc, "stream: "))
            with contextlib.suppress(Exception):
                t.call.cancel()

    async def send(self, bucket: dict[str, torch.Tensor], index: int) -> None:
        targets = self.live()
        if not targets:
            return
        chunk = self.ctx.cfg.max_chunk_bytes
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

    async def close(self) -> None:
        async def finish(t: Target) -> None:
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
