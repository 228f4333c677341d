"""SOCKET: per server an ``UpdateFromSocket`` call (the control) and one TCP connection to
the listener its plan names (the bytes), written by a thread of its own from the tensors'
own memory, bucket after bucket. The connection speaks TLS when the plan asks, with the
trust and client certificate of this process's gRPC channels."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch
from areal_servers.trainer.publish.base import PublishContext, Target, Transport
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc import side_channel
from areal_grpc.errors import status_proto_of
from areal_grpc.server import default_channel_options

__all__ = ["SocketTransport"]

pb = weight_sync_pb2
# How long a failed connection waits for its call's status (the receiver's reason) before
# reporting the connection's own error.
_STATUS_WAIT_S = 5.0


def _host(address: str) -> str:
    """The host part of ``host:port`` (IPv6 brackets removed)."""
    return address.rsplit(":", 1)[0].strip("[]")


class SocketTransport(Transport):
    """Raw frames over TCP, control and commit over gRPC."""

    method = pb.TRANSFER_METHOD_SOCKET
    # A connection's thread takes the next bucket the moment it has written one: going back
    # to the event loop between buckets left the socket idle for 1-3 ms each time.
    pipelined = True

    def __init__(self, ctx: PublishContext) -> None:
        super().__init__(ctx)
        # Each target's connection and its writer thread, by id(target), while it is in
        # the transfer.
        self._socks: dict[int, socket.socket] = {}
        self._writers: dict[int, ThreadPoolExecutor] = {}
        # The side channel's TLS: what this process's channels trust and present (the
        # context is made when a plan asks for it).
        self._client_tls = default_channel_options().tls
        self._tls: ssl.SSLContext | None = None

    def offer(self, rank: int, world: int) -> pb.TransferOption | None:
        return pb.TransferOption(
            method=self.method,
            socket=pb.SocketParams(
                max_frame_bytes=side_channel.DEFAULT_FRAME_BYTES,
                tls=self._client_tls is not None,
            ),
        )

    async def open(self, targets: list[Target]) -> None:
        self.targets = targets
        request = pb.UpdateFromSocketRequest(
            policy_version=self.ctx.version, tensors=[m.spec() for m in self.ctx.metas]
        )
        await asyncio.gather(*(self._open(t, request) for t in targets))

    async def _open(self, t: Target, request: pb.UpdateFromSocketRequest) -> None:
        assert t.plan is not None
        params = t.plan.plan.socket
        mine = pb.UpdateFromSocketRequest()
        mine.CopyFrom(request)
        mine.plan_id = t.plan.plan_id
        t.task = asyncio.create_task(self._call(t, mine))
        dialled = _host(t.result.address)
        host = params.host or dialled
        # The certificate must name what gRPC checked it against: the address dialled.
        name = (self._client_tls.server_name if self._client_tls else None) or dialled

        def connect(tls: ssl.SSLContext | None) -> socket.socket:
            sock = side_channel.connect(host, params.port, self.ctx.left(), tls, name)
            side_channel.send_preamble(sock, params.token, self.ctx.version)
            return sock

        writer = ThreadPoolExecutor(1, thread_name_prefix="socket-writer")
        self._writers[id(t)] = writer
        try:
            tls = self._tls_context() if params.tls else None
            self._socks[id(t)] = await asyncio.wrap_future(writer.submit(connect, tls))
        except OSError as exc:
            await self._lost(t, exc)

    def _tls_context(self) -> ssl.SSLContext:
        """The side channel's TLS context, made on the event loop when a plan first asks."""
        if self._tls is None:
            if self._client_tls is None:
                raise ssl.SSLError("the plan asks for TLS; this sender has none configured")
            self._tls = self._client_tls.ssl_context()
        return self._tls

    async def _call(self, t: Target, request: pb.UpdateFromSocketRequest) -> None:
        try:
            reply = await t.stub.UpdateFromSocket(request, timeout=self.ctx.left())
        except Exception as exc:
            t.result.fail_with(status_proto_of(exc))
            return
        t.result.policy_version = reply.policy_version
        t.result.ok = True

    async def _lost(self, t: Target, exc: BaseException) -> None:
        """A connection failed: the call's status (the receiver's reason) if it comes soon,
        else the connection's error."""
        sock = self._socks.pop(id(t), None)
        if sock is not None:
            sock.close()
        if t.task is not None:
            await asyncio.wait([t.task], timeout=_STATUS_WAIT_S)
            if not t.task.done():
                t.task.cancel()
        if not t.result.error:
            t.result.fail(grpc.StatusCode.UNAVAILABLE, f"socket: {type(exc).__name__}: {exc}")

    async def send(self, bucket: dict[str, torch.Tensor], index: int) -> None:
        live = [t for t in self.live() if id(t) in self._socks]
        if not live:
            return
        frame_bytes = min(
            t.plan.plan.socket.max_frame_bytes or side_channel.DEFAULT_FRAME_BYTES
            for t in live
            if t.plan is not None
        )

        # Queued on every connection's writer at once (before any await: buckets stay in
        # order); each checksums a frame just before sending it (in cache for the copy that
        # follows).
        tensors = [(index + k, t) for k, t in enumerate(bucket.values())]
        writes = [
            (
                t,
                self._writers[id(t)].submit(
                    side_channel.send_tensors, self._socks[id(t)], tensors, frame_bytes
                ),
            )
            for t in live
        ]

        async def settle(t: Target, write: Future[int]) -> None:
            try:
                sent = await asyncio.wrap_future(write)
            except OSError as exc:
                await self._lost(t, exc)
                return
            t.result.sent_bytes += sent

        await asyncio.gather(*(settle(t, w) for t, w in writes))

    async def close(self) -> None:
        async def finish(t: Target) -> None:
            writer = self._writers.pop(id(t), None)
            sock = self._socks.pop(id(t), None)
            end = None
            if writer is not None:
                if sock is not None and not t.result.error:
                    end = writer.submit(side_channel.send_end, sock)
                writer.shutdown(wait=False)  # its thread ends after what is queued
            if end is not None:
                try:
                    await asyncio.wrap_future(end)
                except OSError as exc:
                    self._socks[id(t)] = sock  # type: ignore[assignment]
                    await self._lost(t, exc)
                    return
            if t.task is not None:
                if t.result.error and not t.task.done():
                    t.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t.task
            if sock is not None:
                sock.close()

        await asyncio.gather(*(finish(t) for t in self.targets))
