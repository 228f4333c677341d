"""One tensor on the wire: torch dtype <-> ``Dtype``, tensor <-> ``TensorProto``.

Raw bytes are little-endian, C order (``protos/arealgrpc/v1/tensor.proto``). Nothing here
unpickles or ``torch.load``s anything: a received tensor is the validated raw bytes viewed as a
dtype, and every malformed input raises :class:`~areal_grpc.errors.FieldError` naming the
tensor and the field.

State dicts travel as ``TensorChunk`` streams: :mod:`areal_grpc.chunks` (the contract layer:
chunking and the checking assembler) and :mod:`areal_grpc.chunk_wire` (the fast path for gRPC
streams); :mod:`areal_grpc.checksum` (CRC-32C on memory in place) and
:mod:`areal_grpc.host_memory` (receive buffers, allocator tuning) serve both.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import torch
from arealgrpc.v1 import tensor_pb2

from areal_grpc.errors import FieldError

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


def checked_nbytes(shape: Sequence[int], dtype: torch.dtype, field: str, max_bytes: int) -> int:
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


def byte_view(t: torch.Tensor) -> torch.Tensor:
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


def take_buffer(
    spare: dict[str, torch.Tensor],
    name: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A receive buffer for ``name``: taken out of ``spare`` when the one there fits, else a
    fresh one."""
    t = spare.pop(name, None)
    if t is None or not fits_buffer(t, dtype, shape, device):
        t = torch.empty(list(shape), dtype=dtype, device=device)
    return t


def check_bool_bytes(raw: torch.Tensor, field: str) -> None:
    # A bool byte other than 0/1 is undefined behaviour in torch, i.e. a silently wrong tensor.
    if raw.numel() and bool((raw > 1).any()):
        raise FieldError(field, "bool tensor holds a byte other than 0 or 1")


def tensor_spec(name: str, t: torch.Tensor) -> tensor_pb2.TensorSpec:
    """Name, dtype and shape of ``t`` as a ``TensorSpec``."""
    return tensor_pb2.TensorSpec(name=name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape))


def tensor_to_proto(t: torch.Tensor) -> tensor_pb2.TensorProto:
    """``t`` (any device, any strides) as a ``TensorProto`` of raw little-endian bytes."""
    dtype = dtype_to_proto(t.dtype)
    raw = byte_view(t)
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
    nbytes = checked_nbytes(shape, torch_dtype, f"{label}.shape", max_bytes)
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
        check_bool_bytes(raw, f"{label}.data")
    return raw.view(torch_dtype).reshape(tuple(shape))


def tensor_from_proto(
    proto: tensor_pb2.TensorProto, *, name: str = "", max_bytes: int = DEFAULT_MAX_BYTES
) -> torch.Tensor:
    """The tensor in ``proto``, validated; FieldError naming ``tensor[name]`` and the field."""
    return tensor_from_bytes(
        proto.data, proto.dtype, list(proto.shape), name=name, max_bytes=max_bytes
    )


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_BYTES",
    "SUPPORTED_DTYPES",
    "MiB",
    "byte_view",
    "check_bool_bytes",
    "checked_nbytes",
    "dtype_from_proto",
    "dtype_to_proto",
    "fits_buffer",
    "take_buffer",
    "tensor_from_bytes",
    "tensor_from_proto",
    "tensor_label",
    "tensor_spec",
    "tensor_to_proto",
]
