"""The fast path for ``TensorChunk`` streams over gRPC: wire bytes built and read by hand.

The sender builds a chunk's wire bytes with one copy out of tensor memory
(:func:`encode_chunk`), the receiver slices ``data`` out of the received bytes without copying
(:func:`decode_chunk`), and the CRC-32C is computed on tensor memory in place. The bytes are a
plain ``TensorChunk`` encoding any protobuf library parses; :data:`CHUNK_SERIALIZERS` plugs the
pair into a gRPC stub or handler, :func:`stream_channel_options` sizes the channel for it.
"""

from __future__ import annotations

from typing import Any

from arealgrpc.v1 import tensor_pb2
from google.protobuf.message import DecodeError

from areal_grpc.chunks import ChunkLike, ChunkView
from areal_grpc.tensor_codec import MiB

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


__all__ = ["CHUNK_SERIALIZERS", "decode_chunk", "encode_chunk", "stream_channel_options"]
