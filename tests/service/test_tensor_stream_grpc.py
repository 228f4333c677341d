"""A state dict streamed through a real gRPC server on loopback and back, bit for bit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
import pytest
import torch
from arealgrpc.v1 import tensor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from areal_grpc.chunk_wire import CHUNK_SERIALIZERS, stream_channel_options
from areal_grpc.chunks import (
    ChunkView,
    assemble,
    assemble_async,
    assemble_or_abort,
    iter_chunk_views,
)
from areal_grpc.errors import field_violations
from areal_grpc.server import ChannelOptions, Service, aio_channel, start_server, sync_channel

SERVICE = "areal.test.TensorEcho"
METHOD = f"/{SERVICE}/Echo"
MiB = 1 << 20


async def echo(
    requests: AsyncIterator[ChunkView], context: grpc.aio.ServicerContext
) -> AsyncIterator[ChunkView]:
    """Reassembles the incoming state dict, then streams it back."""
    sd = await assemble_or_abort(requests, context)
    for view in iter_chunk_views(sd):
        yield view


def echo_service() -> Service:
    encode, decode = CHUNK_SERIALIZERS
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Echo": grpc.stream_stream_rpc_method_handler(
                echo, request_deserializer=decode, response_serializer=encode
            )
        },
    )
    return Service(
        name=SERVICE, servicer=handler, add=lambda h, server: server.add_generic_rpc_handlers((h,))
    )


async def round_trip(address: str, chunks: Iterable[object]) -> dict[str, torch.Tensor]:
    encode, decode = CHUNK_SERIALIZERS
    opts = ChannelOptions(extra=stream_channel_options())
    async with aio_channel(address, opts) as channel:
        call = channel.stream_stream(
            METHOD, request_serializer=encode, response_deserializer=decode
        )
        return await assemble_async(call(iter(chunks)))


def sync_round_trip_error(address: str, chunks: list[tensor_pb2.TensorChunk]) -> grpc.RpcError:
    """The error a blocking client gets for ``chunks`` (AssertionError if none)."""
    encode, decode = CHUNK_SERIALIZERS
    with sync_channel(address) as channel:
        call = channel.stream_stream(
            METHOD, request_serializer=encode, response_deserializer=decode
        )
        try:
            assemble(call(iter(chunks)))
        except grpc.RpcError as e:
            return e
    raise AssertionError("the corrupt stream was accepted")


def state_dict_64mib() -> dict[str, torch.Tensor]:
    """A mix of dtypes and shapes; the big ones span many 1 MiB chunks."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(2048, 2048, generator=g),  # 16 MiB float32
        "lm_head.weight": torch.randn(4096, 2048, generator=g).to(torch.bfloat16),  # 16 MiB
        "proj.weight": torch.randn(2048, 1024, generator=g).half(),  # 4 MiB float16
        "ids": torch.randint(-(2**62), 2**62, (1 << 20,), generator=g),  # 8 MiB int64
        "counts": torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g).int(),  # 4 MiB
        "q8": torch.randint(-128, 127, (3 << 20,), generator=g).to(torch.int8),  # 3 MiB
        "bytes": torch.randint(0, 255, (3 << 20,), generator=g).to(torch.uint8),  # 3 MiB
        "mask": torch.rand(1 << 20, generator=g) > 0.5,  # 1 MiB bool
        "transposed": torch.randn(1024, 1536, generator=g).t(),  # 6 MiB, not contiguous
        "scalar": torch.tensor(float("nan")),
        "empty": torch.empty(0, 3, dtype=torch.int32),
    }
    for i in range(200):  # many small tensors: ~ 3 MiB in all
        sd[f"layers.{i}.norm.weight"] = torch.randn(4000, generator=g).to(torch.bfloat16)
        sd[f"layers.{i}.bias"] = torch.randn(2000, generator=g)
    sd["layers.0.norm.weight"][0] = -0.0
    return sd


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a = a.contiguous().reshape(-1).view(torch.uint8)
    flat_b = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(flat_a, flat_b)


def test_64mib_state_dict_round_trips_bit_identical():
    sd = state_dict_64mib()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    assert total >= 64 * MiB

    async def main() -> dict[str, torch.Tensor]:
        server = await start_server([echo_service()])
        try:
            return await round_trip(server.address, iter_chunk_views(sd))
        finally:
            await server.stop(0)

    out = asyncio.run(main())
    assert list(out) == list(sd)  # order kept
    for name, t in sd.items():
        assert bit_identical(out[name], t), name


def test_corrupt_chunk_is_invalid_argument_and_server_keeps_serving():
    sd = {"a": torch.arange(10, dtype=torch.float32), "x": torch.randn(3000)}
    chunks = [c.to_proto() for c in iter_chunk_views(sd, max_chunk_bytes=1000)]
    target = next(i for i, c in enumerate(chunks) if c.name == "x" and c.chunk_index == 3)
    bad = list(chunks)
    bad[target] = tensor_pb2.TensorChunk.FromString(chunks[target].SerializeToString())
    bad[target].data = bytes([bad[target].data[0] ^ 0x80]) + bad[target].data[1:]

    async def main() -> tuple[list[grpc.RpcError], dict[str, torch.Tensor], list[str]]:
        server = await start_server([echo_service()])
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await round_trip(server.address, bad)
            sync_error = await asyncio.to_thread(sync_round_trip_error, server.address, bad)
            good = await round_trip(server.address, chunks)
            async with aio_channel(server.address) as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                replies = stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
                names = [s.name async for r in replies for s in r.list_services_response.service]
            return [err.value, sync_error], good, names
        finally:
            await server.stop(0)

    errors, good, names = asyncio.run(main())
    for error in errors:  # asyncio and blocking clients alike
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert 'tensor["x"].chunk[3].crc32c' in (error.details() or "")
        assert [f for f, _ in field_violations(error)] == ['tensor["x"].chunk[3].crc32c']
    for name, t in sd.items():
        assert bit_identical(good[name], t), name
    assert SERVICE in names
