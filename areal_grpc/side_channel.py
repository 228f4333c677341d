"""The SOCKET side channel's wire format: a preamble, then CRC-32C-checked frames that land
straight in their destination tensors.

gRPC carries the control of a SOCKET transfer (negotiation, the version, the tensor list, the
commit); the bytes go over one plain TCP connection, sender to receiver, in large frames
(see ``UpdateFromSocketRequest`` in weight_sync.proto for the layout). Both ends work on the
tensors' own memory: the sender writes each frame's payload from the tensor, the receiver
reads it with ``recv_into`` into the tensor that will be served, and the CRC of a frame is
computed on that memory in place. Blocking calls: run them in a thread.
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from areal_grpc import tensor_codec as tc
from areal_grpc.checksum import crc32c_at
from areal_grpc.errors import DataLossError, DeadlineError, DeniedError, PreconditionError

__all__ = [
    "DEFAULT_FRAME_BYTES",
    "END_INDEX",
    "MAGIC",
    "TOKEN_BYTES",
    "Frame",
    "FrameFeed",
    "accept",
    "frames_of",
    "receive_tensors",
    "send_end",
    "send_frames",
    "send_preamble",
    "send_tensor",
    "tune",
]

MAGIC = b"AREALSK1"
TOKEN_BYTES = 32
END_INDEX = 0xFFFFFFFF
# Large enough that a frame's header and CRC cost nothing next to its payload.
DEFAULT_FRAME_BYTES = 16 << 20
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
    data = tc.byte_view(tensor)
    view = memoryview(data.numpy())  # type: ignore[arg-type]
    base = data.data_ptr()
    n = len(view)
    if n == 0:
        yield _FRAME.pack(index, 0, 0, 0), view
        return
    for offset in range(0, n, frame_bytes):
        size = min(frame_bytes, n - offset)
        header = _FRAME.pack(index, offset, size, crc32c_at(base + offset, size))
        yield header, view[offset : offset + size]


def frames_of(index: int, tensor: torch.Tensor, frame_bytes: int) -> list[Frame]:
    """One tensor as (header, payload) frames of at most ``frame_bytes``, CRCs computed once
    (the payloads are views of the tensor's memory: keep it alive while they are sent)."""
    return list(_iter_frames(index, tensor, frame_bytes))


class FrameFeed:
    """The frames of some tensors, checksummed by a thread of its own while any number of
    senders iterate over them: a frame's CRC overlaps with sending the frames before it."""

    def __init__(self, tensors: Sequence[tuple[int, torch.Tensor]], frame_bytes: int) -> None:
        self._frames: list[Frame] = []
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        # The payloads are views of these tensors' memory.
        self._tensors = list(tensors)
        threading.Thread(
            target=self._run, args=(frame_bytes,), name="frame-crc", daemon=True
        ).start()

    def _run(self, frame_bytes: int) -> None:
        try:
            for index, tensor in self._tensors:
                for frame in _iter_frames(index, tensor, frame_bytes):
                    with self._cond:
                        self._frames.append(frame)
                        self._cond.notify_all()
        except BaseException as exc:  # handed to the senders
            self._error = exc
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def __iter__(self) -> Iterator[Frame]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._frames) and not self._done:
                    self._cond.wait()
                if i >= len(self._frames):
                    if self._error is not None:
                        raise self._error
                    return
                frame = self._frames[i]
            yield frame
            i += 1


def send_frames(sock: socket.socket, frames: Iterable[Frame]) -> int:
    """Sends frames; the payload bytes sent."""
    sent = 0
    for header, payload in frames:
        sock.sendall(header)
        sock.sendall(payload)
        sent += len(payload)
    return sent


def send_tensor(sock: socket.socket, index: int, tensor: torch.Tensor, frame_bytes: int) -> int:
    """Sends one tensor as frames of at most ``frame_bytes``; the payload bytes sent."""
    return send_frames(sock, frames_of(index, tensor, frame_bytes))


def send_end(sock: socket.socket) -> None:
    """Ends a transfer."""
    sock.sendall(_FRAME.pack(END_INDEX, 0, 0, 0))


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            n = sock.recv_into(view[got:], len(view) - got)
        except TimeoutError:
            raise DeadlineError("the side channel stalled past the update's deadline") from None
        if n == 0:
            raise DataLossError(f"the side channel closed {len(view) - got} bytes short of a frame")
        got += n


def _frames(sock: socket.socket, deadline: float) -> Iterator[tuple[int, int, int, int]]:
    header = bytearray(_FRAME.size)
    while True:
        _recv_into(sock, memoryview(header), deadline)
        yield _FRAME.unpack(header)


def accept(listener: socket.socket, deadline: float) -> socket.socket:
    """The sender's connection (DeadlineError when none arrives in time)."""
    listener.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        raise DeadlineError("no side-channel connection arrived in time") from None
    tune(conn)
    return conn


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
    total = 0
    frames = _frames(conn, deadline)
    # Each frame's CRC is checked by a thread of its own while the next frame arrives; a
    # mismatch found late still fails the transfer before anything is installed.
    with ThreadPoolExecutor(1, thread_name_prefix="frame-crc") as checker:
        checks: deque[tuple[Future[int], int, int, int]] = deque()
        total = _read_frames(conn, frames, views, dests, max_frame_bytes, deadline, checker, checks)
        while checks:
            _check(checks.popleft())
    end_index, _, size, _ = next(frames)
    if end_index != END_INDEX or size:
        raise DataLossError("the side channel sent more frames than the tensors announced")
    return total


def _check(item: tuple[Future[int], int, int, int]) -> None:
    future, crc, index, offset = item
    if future.result() != crc:
        raise DataLossError(f"tensor {index}: CRC-32C mismatch in the frame at {offset}")


def _read_frames(
    conn: socket.socket,
    frames: Iterator[tuple[int, int, int, int]],
    views: list[memoryview],
    dests: Sequence[torch.Tensor],
    max_frame_bytes: int,
    deadline: float,
    checker: ThreadPoolExecutor,
    checks: deque[tuple[Future[int], int, int, int]],
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
            part = view[offset : offset + size]
            _recv_into(conn, part, deadline)
            address = dests[index].data_ptr() + offset
            checks.append((checker.submit(crc32c_at, address, size), crc, index, offset))
            while checks and checks[0][0].done():
                _check(checks.popleft())
            expected += size
            total += size
            if expected == len(view):
                break
    return total
