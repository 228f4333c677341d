"""State dicts as ``TensorChunk`` streams: chunking, and the assembler that checks each chunk.

:class:`StateDictAssembler` writes every chunk straight into a preallocated per-tensor buffer;
a malformed chunk raises :class:`~areal_grpc.errors.FieldError` naming the tensor and the field,
e.g. ``tensor["w"].chunk[3].crc32c``. A receiver should use :func:`assemble_or_abort` in its
gRPC handler. :mod:`areal_grpc.chunk_wire` builds and reads the same chunks' wire bytes fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch
from arealgrpc.v1 import tensor_pb2

from areal_grpc.checksum import crc32c
from areal_grpc.errors import FieldError, abort_with, invalid_argument
from areal_grpc.host_memory import empty_buffer
from areal_grpc.tensor_codec import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_BYTES,
    byte_view,
    check_bool_bytes,
    checked_nbytes,
    dtype_from_proto,
    dtype_to_proto,
    tensor_label,
)


class ChunkLike(Protocol):
    """What :class:`StateDictAssembler` reads: a ``TensorChunk`` or a :class:`ChunkView`."""

    name: str
    tensor_index: int
    chunk_index: int
    chunk_count: int
    dtype: int
    offset: int
    crc32c: int

    @property
    def shape(self) -> Sequence[int]:
        """Dimensions (chunk 0)."""
        ...

    @property
    def data(self) -> bytes | memoryview:
        """This chunk's bytes."""
        ...


@dataclass
class ChunkView:
    """A ``TensorChunk`` whose ``data`` is a view (of tensor memory or of received bytes)."""

    name: str = ""
    tensor_index: int = 0
    chunk_index: int = 0
    chunk_count: int = 0
    dtype: int = 0
    shape: Sequence[int] = ()
    offset: int = 0
    data: bytes | memoryview = b""
    crc32c: int = 0

    def to_proto(self) -> tensor_pb2.TensorChunk:
        """The equivalent ``TensorChunk`` message (copies ``data``)."""
        return tensor_pb2.TensorChunk(
            name=self.name,
            tensor_index=self.tensor_index,
            chunk_index=self.chunk_index,
            chunk_count=self.chunk_count,
            dtype=self.dtype,  # type: ignore[arg-type]
            shape=list(self.shape),
            offset=self.offset,
            data=bytes(self.data),
            crc32c=self.crc32c,
        )


def iter_chunk_views(
    state_dict: Mapping[str, torch.Tensor], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[ChunkView]:
    """``state_dict`` as chunk views over the tensors' own memory (no copies of data).

    Each tensor is made contiguous and CPU first (a copy only when it is not already). dtype
    and shape are set on chunk 0 only, as the contract allows. The views alias the tensors:
    do not modify them until the stream is sent.
    """
    if max_chunk_bytes < 1:
        raise ValueError("max_chunk_bytes must be >= 1")
    for index, (name, t) in enumerate(state_dict.items()):
        dtype = dtype_to_proto(t.dtype)
        shape = list(t.shape)
        raw = byte_view(t)
        nbytes = raw.numel()
        mem = memoryview(raw.numpy()) if nbytes else memoryview(b"")
        count = max(1, -(-nbytes // max_chunk_bytes))
        for k in range(count):
            start = k * max_chunk_bytes
            end = min(nbytes, start + max_chunk_bytes)
            data = mem[start:end]
            yield ChunkView(
                name=name,
                tensor_index=index,
                chunk_index=k,
                chunk_count=count,
                dtype=dtype if k == 0 else 0,
                shape=shape if k == 0 else (),
                offset=start,
                data=data,
                crc32c=crc32c(data),
            )


def iter_chunks(
    state_dict: Mapping[str, torch.Tensor], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tensor_pb2.TensorChunk]:
    """``state_dict`` as ``TensorChunk`` messages, each with at most ``max_chunk_bytes`` of data."""
    for view in iter_chunk_views(state_dict, max_chunk_bytes):
        yield view.to_proto()


@dataclass
class _Pending:
    """The tensor being reassembled."""

    name: str
    label: str
    index: int
    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    chunk_count: int
    buffer: torch.Tensor  # flat uint8, nbytes long
    mem: memoryview
    next_chunk: int = 0
    next_offset: int = 0


class StateDictAssembler:
    """Reassembles a chunk stream into a state dict, validating every chunk on arrival.

    Each tensor's bytes go straight from the chunk into one preallocated buffer, which
    becomes the tensor (no lists of chunks, no joins). After the first error the assembler
    is spent: every later call raises that error again.
    """

    def __init__(
        self,
        *,
        expected_tensors: int | None = None,
        max_total_bytes: int = DEFAULT_MAX_BYTES,
        buffers: MutableMapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``buffers``: tensors to receive into by name (taken out of the mapping when used).

        A tensor whose buffer is a contiguous CPU tensor of exactly its byte size is written
        into that memory (whatever the buffer's dtype) instead of a fresh allocation: filling
        fresh memory costs a page fault per page, reused memory does not.
        """
        self.expected_tensors = expected_tensors
        self.max_total_bytes = max_total_bytes
        self.buffers = buffers
        # The buffers taken out of ``buffers`` so far (a caller gives them back on failure).
        self.taken: dict[str, torch.Tensor] = {}
        self.total_bytes = 0
        self._tensors: dict[str, torch.Tensor] = {}
        self._pending: _Pending | None = None
        self._error: FieldError | None = None

    @property
    def tensors_done(self) -> int:
        """Number of complete tensors so far."""
        return len(self._tensors)

    def add(self, chunk: ChunkLike) -> None:
        """Checks ``chunk`` against the stream so far and copies its data into place."""
        if self._error is not None:
            raise self._error
        try:
            self._add(chunk)
        except FieldError as e:
            self._error = e
            self._pending = None
            raise

    def finish(self) -> dict[str, torch.Tensor]:
        """The state dict; FieldError if the stream ended mid-tensor or short of tensors."""
        if self._error is not None:
            raise self._error
        p = self._pending
        if p is not None:
            self._error = FieldError(
                f"{p.label}.chunk[{p.next_chunk}]",
                f"stream ended after {p.next_chunk} of {p.chunk_count} chunks",
            )
            raise self._error
        if self.expected_tensors is not None and len(self._tensors) != self.expected_tensors:
            self._error = FieldError(
                "tensors", f"stream ended after {len(self._tensors)} of {self.expected_tensors}"
            )
            raise self._error
        return self._tensors

    def _add(self, chunk: ChunkLike) -> None:
        p = self._pending
        if p is None:
            p = self._start(chunk)
        else:
            self._check_continuation(p, chunk)
        data = chunk.data
        n = len(data)
        k = p.next_chunk
        where = f"{p.label}.chunk[{k}]"
        if chunk.offset != p.next_offset:
            raise FieldError(f"{where}.offset", f"is {chunk.offset}, expected {p.next_offset}")
        if n > p.nbytes - p.next_offset:
            raise FieldError(
                f"{where}.data",
                f"{n} bytes at offset {p.next_offset} overrun the tensor's {p.nbytes} bytes",
            )
        if n == 0 and p.nbytes:
            # Empty chunks of a non-empty tensor would let chunk_count grow without bound.
            raise FieldError(f"{where}.data", "is empty")
        last = k == p.chunk_count - 1
        if last and p.next_offset + n != p.nbytes:
            raise FieldError(
                f"{where}.data",
                f"last chunk ends at byte {p.next_offset + n} of {p.nbytes}",
            )
        if n:
            start = p.next_offset
            p.mem[start : start + n] = data
            got = crc32c(p.mem[start : start + n])
        else:
            got = 0
        if got != chunk.crc32c:
            raise FieldError(f"{where}.crc32c", f"is {chunk.crc32c:#010x}, data has {got:#010x}")
        p.next_chunk += 1
        p.next_offset += n
        if last:
            self._complete(p)

    def _start(self, chunk: ChunkLike) -> _Pending:
        name = chunk.name
        label = tensor_label(name)
        index = len(self._tensors)
        if chunk.tensor_index != index:
            if chunk.tensor_index < index:
                raise FieldError(
                    f"{label}.tensor_index",
                    f"is {chunk.tensor_index}: tensor {chunk.tensor_index} was already received",
                )
            raise FieldError(
                f"{label}.tensor_index", f"is {chunk.tensor_index}, expected {index} (missing)"
            )
        if self.expected_tensors is not None and index >= self.expected_tensors:
            raise FieldError(
                f"{label}.tensor_index", f"more tensors than the {self.expected_tensors} expected"
            )
        if chunk.chunk_index != 0:
            raise FieldError(
                f"{label}.chunk[0]", f"missing: the tensor starts with chunk {chunk.chunk_index}"
            )
        if not name:
            raise FieldError(f"{label}.name", "is empty")
        if name in self._tensors:
            raise FieldError(f"{label}.name", "duplicate tensor name")
        dtype = dtype_from_proto(chunk.dtype, f"{label}.dtype")
        shape = [int(d) for d in chunk.shape]
        room = self.max_total_bytes - self.total_bytes
        nbytes = checked_nbytes(shape, dtype, f"{label}.shape", room)
        count = chunk.chunk_count
        if count < 1 or count > max(1, nbytes):
            raise FieldError(
                f"{label}.chunk_count",
                f"is {count}; a {nbytes}-byte tensor needs 1..{max(1, nbytes)}",
            )
        buffer = self._reusable(name, nbytes)
        if buffer is None:
            buffer = empty_buffer(nbytes)
        mem = memoryview(buffer.numpy()) if nbytes else memoryview(bytearray())
        self.total_bytes += nbytes
        p = _Pending(name, label, index, dtype, shape, nbytes, count, buffer, mem)
        self._pending = p
        return p

    def _reusable(self, name: str, nbytes: int) -> torch.Tensor | None:
        """The caller's buffer for ``name`` as flat bytes, if it fits exactly; else None."""
        if self.buffers is None or not nbytes:
            return None
        t = self.buffers.pop(name, None)
        if (
            t is None
            or t.device.type != "cpu"
            or not t.is_contiguous()
            or t.numel() * t.element_size() != nbytes
        ):
            return None
        self.taken[name] = t
        return t.detach().reshape(-1).view(torch.uint8)

    def _check_continuation(self, p: _Pending, chunk: ChunkLike) -> None:
        k = p.next_chunk
        where = f"{p.label}.chunk[{k}]"
        if chunk.tensor_index != p.index or chunk.name != p.name:
            # Another tensor began (or a stray chunk arrived) before this one was complete.
            raise FieldError(
                where,
                f"missing: got {tensor_label(chunk.name)} (tensor_index {chunk.tensor_index}) "
                f"after {k} of {p.chunk_count} chunks",
            )
        if chunk.chunk_index != k:
            if chunk.chunk_index < k:
                raise FieldError(
                    f"{p.label}.chunk[{chunk.chunk_index}].chunk_index",
                    f"duplicate chunk {chunk.chunk_index} (expected {k})",
                )
            raise FieldError(where, f"missing: got chunk {chunk.chunk_index} next")
        if chunk.chunk_count != p.chunk_count:
            raise FieldError(
                f"{where}.chunk_count", f"is {chunk.chunk_count}, chunk 0 said {p.chunk_count}"
            )
        if chunk.dtype and chunk.dtype != dtype_to_proto(p.dtype):
            raise FieldError(f"{where}.dtype", f"is {chunk.dtype}, chunk 0 said {p.dtype}")
        shape = list(chunk.shape)
        if shape and shape != p.shape:
            raise FieldError(f"{where}.shape", f"is {shape}, chunk 0 said {p.shape}")

    def _complete(self, p: _Pending) -> None:
        if p.dtype == torch.bool:
            check_bool_bytes(p.buffer, f"{p.label}.data")
        self._tensors[p.name] = p.buffer.view(p.dtype).reshape(p.shape)
        self._pending = None


def assemble(
    chunks: Iterator[ChunkLike] | Sequence[ChunkLike],
    *,
    expected_tensors: int | None = None,
    max_total_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, torch.Tensor]:
    """A state dict from a whole chunk sequence (see :class:`StateDictAssembler`)."""
    asm = StateDictAssembler(expected_tensors=expected_tensors, max_total_bytes=max_total_bytes)
    for chunk in chunks:
        asm.add(chunk)
    return asm.finish()


async def assemble_async(
    chunks: AsyncIterator[ChunkLike],
    *,
    expected_tensors: int | None = None,
    max_total_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, torch.Tensor]:
    """A state dict from an async chunk stream, e.g. a gRPC handler's request iterator."""
    asm = StateDictAssembler(expected_tensors=expected_tensors, max_total_bytes=max_total_bytes)
    async for chunk in chunks:
        asm.add(chunk)
    return asm.finish()


async def assemble_or_abort(
    requests: AsyncIterator[ChunkLike],
    context: grpc.aio.ServicerContext,
    *,
    expected_tensors: int | None = None,
    max_total_bytes: int = DEFAULT_MAX_BYTES,
    drain_messages: int = 1024,
) -> dict[str, torch.Tensor]:
    """In a gRPC handler: the streamed state dict, or the call ends with INVALID_ARGUMENT.

    On a bad chunk the rest of the stream (up to ``drain_messages``) is read and dropped
    before aborting: a grpc.aio client still writing when the status arrives reports
    ``INTERNAL: Internal error from Core`` instead of the server's status (grpc/grpc#36066).
    """
    asm = StateDictAssembler(expected_tensors=expected_tensors, max_total_bytes=max_total_bytes)
    try:
        async for chunk in requests:
            asm.add(chunk)
        return asm.finish()
    except FieldError as e:
        error = e
    drained = 0
    async for _ in requests:
        drained += 1
        if drained >= drain_messages:
            break
    await abort_with(context, invalid_argument(error))


__all__ = [
    "ChunkLike",
    "ChunkView",
    "StateDictAssembler",
    "assemble",
    "assemble_async",
    "assemble_or_abort",
    "iter_chunk_views",
    "iter_chunks",
]
