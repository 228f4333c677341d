"""Tensors on the wire: torch tensor <-> ``TensorProto`` and state dicts as ``TensorChunk`` streams.

Raw bytes are little-endian, C order (``protos/arealgrpc/v1/tensor.proto``). Nothing here unpickles
or ``torch.load``s anything: a received tensor is the validated raw bytes viewed as a dtype.

Two layers:

* The contract layer: :func:`tensor_to_proto` / :func:`tensor_from_proto`, :func:`iter_chunks`
  (``TensorChunk`` messages) and :class:`StateDictAssembler`, which checks every chunk and writes
  it straight into a preallocated per-tensor buffer. Every malformed input raises
  :class:`~areal_grpc.errors.FieldError` naming the tensor and the field, e.g.
  ``tensor["w"].chunk[3].crc32c``.
* The fast path for gRPC streams (:data:`CHUNK_SERIALIZERS`, :func:`iter_chunk_views`,
  :func:`encode_chunk`, :func:`decode_chunk`, :func:`stream_channel_options`): the sender
  builds a chunk's wire bytes with one copy out of tensor memory, the receiver slices ``data``
  out of the received bytes without copying, and the CRC-32C is computed on tensor memory in
  place. The bytes are a plain ``TensorChunk`` encoding any protobuf library parses.

A process that moves many chunks should call :func:`tune_malloc` once at start (without it,
glibc returns each freed message buffer to the kernel and faults it in again, zeroed, for the
next one), and a receiver should use :func:`assemble_or_abort` in its handler.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import google_crc32c
import grpc
import numpy as np
import torch
from arealgrpc.v1 import tensor_pb2
from google.protobuf.message import DecodeError

from areal_grpc.errors import FieldError, abort_with, invalid_argument

if sys.byteorder != "little":  # pragma: no cover - no big-endian host in sight
    # Tensors are sent as their in-memory bytes; a big-endian host would need byte swapping.
    raise ImportError("areal_grpc.tensor_codec supports little-endian hosts only")

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = MiB
# Upper bound on the bytes a receiver allocates for one state dict (or one tensor) when the
# caller gives none: a corrupt or hostile shape must not make us reserve petabytes.
DEFAULT_MAX_BYTES = 1 << 36

_TO_PROTO: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}
_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_TO_PROTO)


def dtype_to_proto(dtype: torch.dtype) -> int:
    """The ``Dtype`` enum value of a torch dtype; ValueError for dtypes the contract lacks."""
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no arealgrpc.v1.Dtype") from None


def dtype_from_proto(value: int, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a ``Dtype`` enum value; FieldError on ``field`` when unknown/unset."""
    try:
        return _FROM_PROTO[value]
    except (KeyError, TypeError):
        raise FieldError(field, f"unknown or unspecified dtype {value!r}") from None


def tensor_label(name: str) -> str:
    """The field-path prefix of a named tensor, e.g. ``tensor["w"]``."""
    return f"tensor[{json.dumps(name, ensure_ascii=False)}]"


def _checked_nbytes(shape: Sequence[int], dtype: torch.dtype, field: str, max_bytes: int) -> int:
    """Byte size of ``shape`` x ``dtype``; FieldError for negative dims or a size over the cap."""
    numel = 1
    for i, dim in enumerate(shape):
        if dim < 0:
            raise FieldError(f"{field}[{i}]", f"dimension {dim} is negative")
        numel *= dim
        # Python ints never overflow, but a huge product is pointless to keep multiplying.
        if numel * dtype.itemsize > max_bytes:
            raise FieldError(
                field,
                f"shape {list(shape)} needs more than the {max_bytes}-byte limit",
            )
    return numel * dtype.itemsize


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (a copy only if it was not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # Lazy negation/conjugation bits would not be in the bytes; materialise them.
    t = t.resolve_neg().resolve_conj().contiguous()
    return t.reshape(-1).view(torch.uint8)


def fits_buffer(
    t: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], device: torch.device | str = "cpu"
) -> bool:
    """Whether ``t`` can take a tensor of ``dtype`` x ``shape`` on ``device`` in place."""
    return (
        t.dtype == dtype
        and list(t.shape) == list(shape)
        and t.device == torch.device(device)
        and t.is_contiguous()
    )


def _check_bool_bytes(raw: torch.Tensor, field: str) -> None:
    # A bool byte other than 0/1 is undefined behaviour in torch, i.e. a silently wrong tensor.
    if raw.numel() and bool((raw > 1).any()):
        raise FieldError(field, "bool tensor holds a byte other than 0 or 1")


def tensor_spec(name: str, t: torch.Tensor) -> tensor_pb2.TensorSpec:
    """Name, dtype and shape of ``t`` as a ``TensorSpec``."""
    return tensor_pb2.TensorSpec(name=name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape))


def tensor_to_proto(t: torch.Tensor) -> tensor_pb2.TensorProto:
    """``t`` (any device, any strides) as a ``TensorProto`` of raw little-endian bytes."""
    dtype = dtype_to_proto(t.dtype)
    raw = _byte_view(t)
    return tensor_pb2.TensorProto(dtype=dtype, shape=list(t.shape), data=raw.numpy().tobytes())


def tensor_from_bytes(
    data: bytes | bytearray | memoryview,
    dtype: int,
    shape: Sequence[int],
    *,
    name: str = "",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> torch.Tensor:
    """A CPU tensor over ``data`` after validation; zero-copy when ``data`` is a bytearray.

    A writable buffer (bytearray, writable memoryview) is shared with the result, so the
    caller hands it over; read-only ``bytes`` are copied once.
    """
    label = tensor_label(name)
    torch_dtype = dtype_from_proto(dtype, f"{label}.dtype")
    nbytes = _checked_nbytes(shape, torch_dtype, f"{label}.shape", max_bytes)
    if len(data) != nbytes:
        raise FieldError(
            f"{label}.data",
            f"has {len(data)} bytes; shape {list(shape)} of {torch_dtype} needs {nbytes}",
        )
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        data = bytearray(data)
    raw = torch.frombuffer(data, dtype=torch.uint8)
    if torch_dtype == torch.bool:
        _check_bool_bytes(raw, f"{label}.data")
    return raw.view(torch_dtype).reshape(tuple(shape))


def tensor_from_proto(
    proto: tensor_pb2.TensorProto, *, name: str = "", max_bytes: int = DEFAULT_MAX_BYTES
) -> torch.Tensor:
    """The tensor in ``proto``, validated; FieldError naming ``tensor[name]`` and the field."""
    return tensor_from_bytes(
        proto.data, proto.dtype, list(proto.shape), name=name, max_bytes=max_bytes
    )


# ---------------------------------------------------------------------------------------------
# CRC-32C on memory in place.
#
# google_crc32c.value() only takes ``bytes``; checksumming a slice of tensor memory through it
# would cost a copy per chunk. The C library it bundles has crc32c_extend(crc, ptr, len), which
# we call on the tensor's memory directly (ctypes releases the GIL for the call).


def _load_crc_lib() -> Any:
    pkg_dir = os.path.dirname(google_crc32c.__file__)
    # The wheel's bundled copy first, then a system libcrc32c.
    candidates = sorted(glob.glob(os.path.join(pkg_dir, "..", "google_crc32c.libs", "libcrc32c*")))
    system = ctypes.util.find_library("crc32c")
    for path in [*candidates, *([system] if system else [])]:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        return fn
    return None


_crc_extend = _load_crc_lib()


def crc32c_at(address: int, nbytes: int) -> int:
    """CRC-32C of ``nbytes`` of memory at ``address`` (which the caller keeps alive)."""
    if nbytes == 0:
        return 0
    if _crc_extend is not None:
        return int(_crc_extend(0, address, nbytes))
    return google_crc32c.value(ctypes.string_at(address, nbytes))  # pragma: no cover


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of a bytes-like object, computed in place (no copy)."""
    if isinstance(data, bytes):
        return google_crc32c.value(data)
    if len(data) == 0:
        return 0
    # numpy takes any contiguous buffer, read-only or not, and tells us where it lives.
    arr = np.frombuffer(data, dtype=np.uint8)
    return crc32c_at(arr.ctypes.data, arr.nbytes)


# ---------------------------------------------------------------------------------------------
# Receive buffers.
#
# Filling freshly allocated memory is dominated by page faults (4 KiB each, ~1.5 GB/s here);
# with transparent huge pages in "madvise" mode, advising a big buffer first makes it ~4x
# faster to fill. Best effort: where madvise is missing or refused, nothing changes.
_HUGE_PAGE = 2 * MiB
_MADV_HUGEPAGE = 14


def _load_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def empty_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised flat uint8 CPU tensor of ``nbytes``, huge-page backed when large."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if _madvise is not None and nbytes >= 2 * _HUGE_PAGE:
        # Only whole pages inside the allocation; the kernel uses huge pages for the
        # 2 MiB-aligned stretches within it.
        start = (buf.data_ptr() + 4095) & ~4095
        end = (buf.data_ptr() + nbytes) & ~4095
        _madvise(start, end - start, _MADV_HUGEPAGE)
    return buf


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(
    mmap_threshold_bytes: int = 32 * MiB, trim_threshold_bytes: int = 256 * MiB
) -> bool:
    """Process-wide: keep freed message buffers mapped for reuse (glibc only; True if applied).

    A chunk stream allocates and frees a ~1 MiB buffer per message on both sides (and gRPC
    its read buffers). With glibc's defaults those are handed back to the kernel and faulted
    in again, zeroed, on the next message, which costs as much CPU as the copies themselves.
    Allocations up to ``mmap_threshold_bytes`` then come from the heap, and up to
    ``trim_threshold_bytes`` of free heap stays mapped. Call once at process start.

    Setting a threshold turns off glibc's own adaptive one, which grows up to 32 MiB as large
    blocks are freed. A fixed 4 MiB here made every 4-32 MiB activation of a training step an
    mmap, a munmap and a page fault per 4 KiB (a trainer rank of the 135M model: 7x the faults
    and 1.3x the step time of the same rank without tuning), so the default is 32 MiB, the
    adaptive threshold's cap: nothing is mapped afresh that the adaptive one would reuse.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    return mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1 and ok


# ---------------------------------------------------------------------------------------------
# Chunked state dicts.


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
        raw = _byte_view(t)
        nbytes = raw.numel()
        base = raw.data_ptr()
        mem = memoryview(raw.numpy()) if nbytes else memoryview(b"")
        count = max(1, -(-nbytes // max_chunk_bytes))
        for k in range(count):
            start = k * max_chunk_bytes
            end = min(nbytes, start + max_chunk_bytes)
            yield ChunkView(
                name=name,
                tensor_index=index,
                chunk_index=k,
                chunk_count=count,
                dtype=dtype if k == 0 else 0,
                shape=shape if k == 0 else (),
                offset=start,
                data=mem[start:end],
                crc32c=crc32c_at(base + start, end - start),
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
            got = crc32c_at(p.buffer.data_ptr() + start, n)
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
        nbytes = _checked_nbytes(shape, dtype, f"{label}.shape", room)
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
        if chunk.dtype and chunk.dtype != _TO_PROTO[p.dtype]:
            raise FieldError(f"{where}.dtype", f"is {chunk.dtype}, chunk 0 said {p.dtype}")
        shape = list(chunk.shape)
        if shape and shape != p.shape:
            raise FieldError(f"{where}.shape", f"is {shape}, chunk 0 said {p.shape}")

    def _complete(self, p: _Pending) -> None:
        if p.dtype == torch.bool:
            _check_bool_bytes(p.buffer, f"{p.label}.data")
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


# ---------------------------------------------------------------------------------------------
# Wire format fast path: TensorChunk bytes built and read by hand.
#
# Field numbers and wire types of TensorChunk (tensor.proto); keys are (field << 3) | wire_type.
_VARINT, _I64, _LEN, _START_GROUP, _END_GROUP, _I32 = 0, 1, 2, 3, 4, 5
_F_NAME, _F_TENSOR, _F_CHUNK, _F_COUNT, _F_DTYPE = 1, 2, 3, 4, 5
_F_SHAPE, _F_OFFSET, _F_DATA, _F_CRC = 6, 7, 8, 9
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


def _put_varint(out: bytearray, value: int) -> None:
    value &= _U64  # negative int64/enum values go out as 10-byte two's complement
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_key(out: bytearray, field: int, wire_type: int) -> None:
    _put_varint(out, (field << 3) | wire_type)


def _chunk_header(chunk: ChunkLike, data_len: int) -> bytearray:
    """Wire bytes of fields 1-7 and the key/length of field 8 (everything before ``data``)."""
    out = bytearray()
    if chunk.name:
        name = chunk.name.encode()
        _put_key(out, _F_NAME, _LEN)
        _put_varint(out, len(name))
        out += name
    for field, value in (
        (_F_TENSOR, chunk.tensor_index),
        (_F_CHUNK, chunk.chunk_index),
        (_F_COUNT, chunk.chunk_count),
        (_F_DTYPE, chunk.dtype),
    ):
        if value:
            _put_key(out, field, _VARINT)
            _put_varint(out, value)
    if len(chunk.shape):
        packed = bytearray()
        for dim in chunk.shape:
            _put_varint(packed, dim)
        _put_key(out, _F_SHAPE, _LEN)
        _put_varint(out, len(packed))
        out += packed
    if chunk.offset:
        _put_key(out, _F_OFFSET, _VARINT)
        _put_varint(out, chunk.offset)
    if data_len:
        _put_key(out, _F_DATA, _LEN)
        _put_varint(out, data_len)
    return out


def encode_chunk(
    chunk: ChunkLike | tensor_pb2.TensorChunk, *, wrap_field: int | None = None
) -> bytes:
    """Wire bytes of ``chunk`` as a ``TensorChunk``, copying ``data`` exactly once.

    With ``wrap_field``, the bytes are those of an outer message whose field ``wrap_field``
    holds the chunk (e.g. ``PushWeightsRequest.chunk`` is field 2).
    """
    if isinstance(chunk, tensor_pb2.TensorChunk) and wrap_field is None:
        return chunk.SerializeToString()
    data = chunk.data
    n = len(data)
    head = _chunk_header(chunk, n)
    tail = bytearray()
    if chunk.crc32c:
        _put_key(tail, _F_CRC, _VARINT)
        _put_varint(tail, chunk.crc32c)
    if wrap_field is not None:
        outer = bytearray()
        _put_key(outer, wrap_field, _LEN)
        _put_varint(outer, len(head) + n + len(tail))
        head = outer + head
    # bytes.join sizes the result once and copies each part in: the data's only copy.
    return b"".join((head, data, tail)) if n else bytes(head + tail)


def _get_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def _get_key(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    key, pos = _get_varint(buf, pos, end)
    if key > _U32 or key >> 3 == 0:
        raise DecodeError(f"invalid field key {key}")
    return key, pos


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def _signed32(value: int) -> int:
    value &= _U32
    return value - (1 << 32) if value >> 31 else value


def _skip(buf: bytes, pos: int, end: int, wire_type: int, group: int = 0) -> int:
    if wire_type == _VARINT:
        return _get_varint(buf, pos, end)[1]
    if wire_type == _I64:
        pos += 8
    elif wire_type == _I32:
        pos += 4
    elif wire_type == _LEN:
        length, pos = _get_varint(buf, pos, end)
        pos += length
    elif wire_type == _START_GROUP:
        # A (deprecated) group in an unknown field: skip up to its matching end marker.
        while True:
            key, pos = _get_key(buf, pos, end)
            if key & 7 == _END_GROUP:
                if key >> 3 != group:
                    raise DecodeError("mismatched end group")
                return pos
            pos = _skip(buf, pos, end, key & 7, key >> 3)
    else:
        raise DecodeError(f"unsupported wire type {wire_type}")
    if pos > end:
        raise DecodeError("truncated field")
    return pos


def decode_chunk(buf: bytes, *, wrap_field: int | None = None) -> ChunkView:
    """A ``TensorChunk`` parsed from wire bytes, ``data`` a view of ``buf`` (no copy).

    Accepts any valid encoding (fields in any order, repeated scalars, packed or unpacked
    shape, unknown fields); malformed bytes raise protobuf's ``DecodeError``.

    With ``wrap_field``, ``buf`` must be an outer message made of that one length-delimited
    field and nothing else (as :func:`encode_chunk` writes it); anything else (another field
    such as a oneof sibling, a repeated or mistyped occurrence) raises ``DecodeError`` so the
    caller falls back to the full protobuf parser, which knows the outer message's rules.
    """
    start, end = 0, len(buf)
    if wrap_field is not None:
        key, pos = _get_key(buf, 0, end)
        if key != (wrap_field << 3) | _LEN:
            raise DecodeError(f"not a message holding only field {wrap_field}")
        length, pos = _get_varint(buf, pos, end)
        if pos + length != end:
            raise DecodeError(f"not a message holding only field {wrap_field}")
        start = pos
    view = memoryview(buf)
    out = ChunkView()
    shape: list[int] = []
    pos = start
    while pos < end:
        key, pos = _get_key(buf, pos, end)
        field, wt = key >> 3, key & 7
        if wt == _VARINT and field in (
            _F_TENSOR,
            _F_CHUNK,
            _F_COUNT,
            _F_DTYPE,
            _F_OFFSET,
            _F_CRC,
            _F_SHAPE,
        ):
            value, pos = _get_varint(buf, pos, end)
            if field == _F_TENSOR:
                out.tensor_index = value & _U32
            elif field == _F_CHUNK:
                out.chunk_index = value & _U32
            elif field == _F_COUNT:
                out.chunk_count = value & _U32
            elif field == _F_DTYPE:
                out.dtype = _signed32(value)
            elif field == _F_OFFSET:
                out.offset = value
            elif field == _F_CRC:
                out.crc32c = value & _U32
            else:
                shape.append(_signed64(value))
        elif wt == _LEN and field in (_F_NAME, _F_DATA, _F_SHAPE):
            length, pos = _get_varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise DecodeError("truncated field")
            if field == _F_NAME:
                try:
                    out.name = bytes(view[pos:stop]).decode("utf-8")
                except UnicodeDecodeError:
                    raise DecodeError("name is not valid UTF-8") from None
            elif field == _F_DATA:
                out.data = view[pos:stop]
            else:
                while pos < stop:
                    value, pos = _get_varint(buf, pos, stop)
                    shape.append(_signed64(value))
            pos = stop
        # A known field with another wire type is an unknown field to protobuf parsers.
        else:
            pos = _skip(buf, pos, end, wt, field)
    out.shape = shape
    return out


def _decode_chunk_request(buf: bytes) -> ChunkView:
    return decode_chunk(buf)


#: (request_serializer, request_deserializer) for a ``TensorChunk`` stream: pass the first to a
#: client's ``stream_stream``/``stream_unary`` and the second to the server's method handler.
CHUNK_SERIALIZERS = (encode_chunk, _decode_chunk_request)


def stream_channel_options() -> list[tuple[str, Any]]:
    """Channel arguments for bulk chunk streams (give them to client and server alike).

    Larger HTTP/2 DATA frames (fewer frame headers to write and parse) and a fixed 64 MiB
    flow-control window instead of BDP probing, so a sender never waits for the window to grow.
    On loopback here their effect was within the run-to-run noise (bench/tensor_stream.py);
    the per-process :func:`tune_malloc` is what cuts the CPU cost of a stream.
    """
    return [
        ("grpc.http2.max_frame_size", 16 * MiB - 1),
        ("grpc.http2.lookahead_bytes", 64 * MiB),
        ("grpc.http2.bdp_probe", 0),
    ]


__all__ = [
    "CHUNK_SERIALIZERS",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_BYTES",
    "SUPPORTED_DTYPES",
    "ChunkLike",
    "ChunkView",
    "StateDictAssembler",
    "assemble",
    "assemble_async",
    "assemble_or_abort",
    "crc32c",
    "crc32c_at",
    "decode_chunk",
    "dtype_from_proto",
    "dtype_to_proto",
    "empty_buffer",
    "encode_chunk",
    "fits_buffer",
    "iter_chunk_views",
    "iter_chunks",
    "stream_channel_options",
    "tensor_from_bytes",
    "tensor_from_proto",
    "tensor_label",
    "tensor_spec",
    "tensor_to_proto",
    "tune_malloc",
]
