"""The SOCKET side channel's wire format: a preamble, then CRC-32C-checked frames that land
straight in their destination tensors.

gRPC carries the control of a SOCKET transfer (negotiation, the version, the tensor list, the
commit); the bytes go over one plain TCP connection, sender to receiver, in large frames
(see ``UpdateFromSocketRequest`` in weight_sync.proto for the layout). Both ends work on the
tensors' own memory: the sender writes each frame's payload from the tensor, the receiver
reads it with ``recv_into`` into the tensor that will be served, and the CRC of a frame is
computed on that memory in place. With TLS (:func:`accept` and :func:`connect` given an
``ssl.SSLContext``) the same bytes travel inside it. Blocking calls: run them in a thread.
"""

from __future__ import annotations

import hmac
import socket
import ssl
import struct
import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from areal_grpc import tensor_codec as tc
from areal_grpc.checksum import crc32c
from areal_grpc.errors import DataLossError, DeadlineError, DeniedError, PreconditionError

__all__ = [
    "DEFAULT_FRAME_BYTES",
    "END_INDEX",
    "MAGIC",
    "TOKEN_BYTES",
    "Frame",
    "accept",
    "connect",
    "frames_of",
    "receive_tensors",
    "send_end",
    "send_frames",
    "send_preamble",
    "send_tensor",
    "send_tensors",
    "tune",
]

MAGIC = b"AREALSK1"
TOKEN_BYTES = 32
END_INDEX = 0xFFFFFFFF
# The sender's frame size: large enough that a header costs nothing next to its payload,
# small enough to stay in cache between being checksummed and being copied into the socket
# (at 16 MiB each frame is read from memory twice).
DEFAULT_FRAME_BYTES = 1 << 20
# Socket buffers asked for on both ends (the kernel may cap them).
SOCKET_BUFFER_BYTES = 8 << 20

_PREAMBLE = struct.Struct("<8s32sq")
_FRAME = struct.Struct("<IQII")


def tune(sock: socket.socket) -> None:
    """Large socket buffers; no Nagle delay on the small frame headers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(tc.byte_view(t).numpy())  # type: ignore[arg-type]


def send_preamble(sock: socket.socket, token: bytes, version: int) -> None:
    """Opens a transfer: magic, the plan's token, the policy version."""
    sock.sendall(_PREAMBLE.pack(MAGIC, token, version))


Frame = tuple[bytes, memoryview]


def _iter_frames(index: int, tensor: torch.Tensor, frame_bytes: int) -> Iterator[Frame]:
    # Lazily: a frame is checksummed just before it is sent, so the kernel's copy finds it in
    # cache (a separate pass, or a thread ahead of the sender, reads memory twice).
    view = _view(tensor)
    n = len(view)
    if n == 0:
        yield _FRAME.pack(index, 0, 0, 0), view
        return
    for offset in range(0, n, frame_bytes):
        part = view[offset : offset + frame_bytes]
        yield _FRAME.pack(index, offset, len(part), crc32c(part)), part


def frames_of(index: int, tensor: torch.Tensor, frame_bytes: int) -> list[Frame]:
    """One tensor as (header, payload) frames of at most ``frame_bytes`` (the payloads are
    views of the tensor's memory: keep it alive while they are sent)."""
    return list(_iter_frames(index, tensor, frame_bytes))


def _send_frame(sock: socket.socket, header: bytes, payload: memoryview) -> None:
    if isinstance(sock, ssl.SSLSocket):
        # No sendmsg on TLS: the header is a record of its own (a few dozen bytes a frame).
        sock.sendall(header)
        sock.sendall(payload)
        return
    # One call for both: with TCP_NODELAY a header sent on its own is a packet of its own.
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(payload[sent - len(header) :])


def send_frames(sock: socket.socket, frames: Iterable[Frame]) -> int:
    """Sends frames; the payload bytes sent."""
    sent = 0
    for header, payload in frames:
        _send_frame(sock, header, payload)
        sent += len(payload)
    return sent


def send_tensors(
    sock: socket.socket, tensors: Iterable[tuple[int, torch.Tensor]], frame_bytes: int
) -> int:
    """Sends (index, tensor) pairs as frames of at most ``frame_bytes``; the payload bytes
    sent."""
    return sum(send_frames(sock, _iter_frames(i, t, frame_bytes)) for i, t in tensors)


def send_tensor(sock: socket.socket, index: int, tensor: torch.Tensor, frame_bytes: int) -> int:
    """Sends one tensor as frames of at most ``frame_bytes``; the payload bytes sent."""
    return send_tensors(sock, [(index, tensor)], frame_bytes)


def send_end(sock: socket.socket) -> None:
    """Ends a transfer."""
    sock.sendall(_FRAME.pack(END_INDEX, 0, 0, 0))


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _recv_into(
    sock: socket.socket, view: memoryview, deadline: float, crc: int | None = None
) -> int | None:
    """Fills ``view``; given the ``crc`` of the bytes before it, returns the CRC-32C extended
    over it, computed on each piece as it arrives (still in cache)."""
    got = 0
    while got < len(view):
        sock.settimeout(_left(deadline))
        try:
            n = sock.recv_into(view[got:], len(view) - got)
        except TimeoutError:
            raise DeadlineError("the side channel stalled past the update's deadline") from None
        except OSError as exc:
            # A reset connection, a TLS record that fails its check: the bytes did not arrive.
            raise DataLossError(f"the side channel broke: {exc}") from None
        if n == 0:
            raise DataLossError(f"the side channel closed {len(view) - got} bytes short of a frame")
        if crc is not None:
            crc = crc32c(view[got : got + n], crc)
        got += n
    return crc


def _frames(sock: socket.socket, deadline: float) -> Iterator[tuple[int, int, int, int]]:
    header = bytearray(_FRAME.size)
    while True:
        _recv_into(sock, memoryview(header), deadline)
        yield _FRAME.unpack(header)


def accept(
    listener: socket.socket, deadline: float, tls: ssl.SSLContext | None = None
) -> socket.socket:
    """The sender's connection, its TLS handshake done when ``tls`` is given (DeadlineError
    when none arrives in time; DeniedError when the handshake fails: no TLS, an untrusted or
    missing client certificate)."""
    listener.settimeout(_left(deadline))
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        raise DeadlineError("no side-channel connection arrived in time") from None
    tune(conn)
    if tls is None:
        return conn
    conn.settimeout(_left(deadline))
    try:
        return tls.wrap_socket(conn, server_side=True)
    except TimeoutError:
        conn.close()
        raise DeadlineError("the side channel's TLS handshake did not finish in time") from None
    except OSError as exc:  # ssl.SSLError among them
        conn.close()
        raise DeniedError(f"the side channel's TLS handshake failed: {exc}") from None


def connect(
    host: str,
    port: int,
    timeout_s: float,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> socket.socket:
    """A tuned connection to a receiver's listener, inside TLS when ``tls`` is given (the
    receiver's certificate checked against ``server_name``, else ``host``)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    tune(sock)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=server_name or host)
    except BaseException:
        sock.close()
        raise


def receive_tensors(
    conn: socket.socket,
    token: bytes,
    version: int,
    dests: Sequence[torch.Tensor],
    max_frame_bytes: int,
    deadline: float,
) -> int:
    """Checks the preamble, then reads every frame into ``dests`` (in order); the bytes read.

    Nothing is written into ``dests`` before the token and version are checked. A wrong
    token is DeniedError; another version PreconditionError; a frame out of order, too long,
    with a bad CRC, or a connection that ends early is DataLossError.
    """
    head = bytearray(_PREAMBLE.size)
    _recv_into(conn, memoryview(head), deadline)
    magic, got_token, got_version = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        raise DataLossError("the side channel did not start with the AREALSK1 preamble")
    if not hmac.compare_digest(got_token, token):
        raise DeniedError("the side channel presented a wrong token")
    if got_version != version:
        raise PreconditionError(
            f"the side channel carries version {got_version}, the update announced {version}"
        )
    views = [_view(t) for t in dests]
    frames = _frames(conn, deadline)
    total = _read_frames(conn, frames, views, max_frame_bytes, deadline)
    end_index, _, size, _ = next(frames)
    if end_index != END_INDEX or size:
        raise DataLossError("the side channel sent more frames than the tensors announced")
    return total


def _read_frames(
    conn: socket.socket,
    frames: Iterator[tuple[int, int, int, int]],
    views: list[memoryview],
    max_frame_bytes: int,
    deadline: float,
) -> int:
    total = 0
    for index, view in enumerate(views):
        expected = 0
        while True:
            got_index, offset, size, crc = next(frames)
            if got_index != index or offset != expected:
                raise DataLossError(
                    f"frame for tensor {got_index} at byte {offset} arrived where tensor "
                    f"{index} at byte {expected} was due"
                )
            if size > max_frame_bytes or offset + size > len(view):
                raise DataLossError(
                    f"tensor {index}: a {size}-byte frame at byte {offset} overruns the frame "
                    f"limit {max_frame_bytes} or the tensor's {len(view)} bytes"
                )
            got = _recv_into(conn, view[offset : offset + size], deadline, crc=0)
            if got != crc:
                raise DataLossError(f"tensor {index}: CRC-32C mismatch in the frame at {offset}")
            expected += size
            total += size
            if expected == len(view):
                break
    return total
