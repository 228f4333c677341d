"""SOCKET (``UpdateFromSocket``): the bytes over a plain TCP connection, gRPC for the rest.

Each accepted offer gets a listener of its own and a one-time 32-byte token, both in the
plan. ``UpdateFromSocket`` announces the version and the tensors; the sender then connects,
presents the token and the version (checked before any byte is written) and sends the
tensors as CRC-32C-checked frames that are read straight into the receive buffers
(:mod:`areal_grpc.side_channel`). A server with TLS speaks it on the side channel too, with
its own certificate and client check. Only a complete transfer is swapped in, so a wrong or
used token, a failed handshake, a corrupt or short frame, or a sender that vanishes leaves
the old weights serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import ssl
import time
from collections import OrderedDict

import torch
from areal_servers.rollout.receive.base import Receiver, ReceiverState, check_specs
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc import side_channel
from areal_grpc import tensor_codec as tc
from areal_grpc.errors import FieldError, PreconditionError

__all__ = ["SocketReceiver"]

log = logging.getLogger(__name__)
pb = weight_sync_pb2


def _announced(host: str) -> str:
    """The host a plan names: "" for a wildcard bind (the sender uses the host it called)."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_unspecified:
            return ""
    return host


class SocketReceiver(Receiver):
    """Per-plan TCP listeners with one-time tokens."""

    name = "socket"
    method = pb.TRANSFER_METHOD_SOCKET

    def __init__(self, state: ReceiverState) -> None:
        super().__init__(state)
        # Listeners of plans not used yet, by token (used once: taken out by the update).
        self._listeners: OrderedDict[bytes, socket.socket] = OrderedDict()
        tls = state.config.socket_tls
        self._tls: ssl.SSLContext | None = tls.ssl_context() if tls is not None else None

    @property
    def enabled(self) -> bool:
        return super().enabled and self.state.config.socket_host is not None

    def supported(self) -> str | None:
        if not self.enabled:
            return None
        tls = ", TLS" if self._tls is not None else ""
        return f"TRANSFER_METHOD_SOCKET (frames <= {self.state.config.max_frame_bytes} B{tls})"

    def accept(
        self, where: str, offer: pb.TransferOption, declined: list[str]
    ) -> pb.TransferOption | None:
        if not self.enabled:
            return None
        asked = offer.socket.max_frame_bytes if offer.HasField("socket") else 0
        if asked < 0:
            raise FieldError(f"{where}.socket.max_frame_bytes", f"is negative ({asked})")
        if self._tls is not None and not offer.socket.tls:
            declined.append(f"{where}: this server's side channel is TLS; the offer is plaintext")
            return None
        limit = self.state.config.max_frame_bytes
        host = self.state.config.socket_host or ""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(1)
        token = secrets.token_bytes(side_channel.TOKEN_BYTES)
        self._listeners[token] = listener
        while len(self._listeners) > self.state.config.max_socket_listeners:
            _, old = self._listeners.popitem(last=False)
            old.close()
        params = pb.SocketParams(
            host=_announced(host),
            port=listener.getsockname()[1],
            token=token,
            max_frame_bytes=min(asked or limit, limit),
            tls=self._tls is not None,
        )
        return pb.TransferOption(method=self.method, socket=params)

    async def close(self) -> None:
        """Closes the listeners of unused plans."""
        while self._listeners:
            _, listener = self._listeners.popitem()
            listener.close()

    async def update(
        self, request: pb.UpdateFromSocketRequest, time_left_s: float | None = None
    ) -> pb.UpdateFromSocketResponse:
        """Receives the announced tensors over the plan's connection, then swaps them in."""
        state = self.state
        plan = state.plan(request.plan_id, self.method, required=True)
        assert plan is not None
        params = plan.option.socket
        listener = self._listeners.pop(params.token, None)
        if listener is None:
            raise PreconditionError(
                f"plan_id {request.plan_id!r}: its connection was used or dropped; negotiate again"
            )
        buffers: dict[str, torch.Tensor] = {}
        try:
            state.check_version(request.policy_version)
            check_specs(request.tensors, state.config.max_total_bytes, state.expected_dtype)
            for s in request.tensors:
                dtype, shape = tc.dtype_from_proto(s.dtype), [int(d) for d in s.shape]
                buffers[s.name] = state.take_buffer(s.name, dtype, shape)
            timeout = state.config.group_timeout_s
            if time_left_s is not None:
                timeout = min(timeout, time_left_s)
            log.info(
                "socket update to version %d: receiving %d tensors on port %d (%s)",
                request.policy_version,
                len(buffers),
                params.port,
                "TLS" if params.tls else "plaintext",
            )
            received = await self._receive(
                listener, params, request.policy_version, list(buffers.values()), timeout
            )
            async with state.update_lock:
                state.check_version(request.policy_version)
                await state.load(buffers, request.policy_version, relay_root=plan.relay_root)
        except BaseException:
            state.give_back(buffers)  # not installed: still free to receive into
            raise
        finally:
            listener.close()
        return pb.UpdateFromSocketResponse(
            policy_version=state.engine.version,
            tensor_count=len(buffers),
            received_bytes=received,
        )

    async def _receive(
        self,
        listener: socket.socket,
        params: pb.SocketParams,
        version: int,
        dests: list[torch.Tensor],
        timeout_s: float,
    ) -> int:
        deadline = time.monotonic() + timeout_s
        conn: list[socket.socket] = []

        def work() -> int:
            conn.append(side_channel.accept(listener, deadline, self._tls))
            with conn[0]:
                return side_channel.receive_tensors(
                    conn[0], params.token, version, dests, params.max_frame_bytes, deadline
                )

        task = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The call was cancelled: unblock the thread (its recv or accept ends at once).
            for c in conn:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(BaseException):
                await task
            raise
