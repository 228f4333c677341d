"""Streaming a 256 MiB state dict over gRPC on loopback vs a raw TCP socket, MB/s.

Run by hand: ``.venv/bin/python bench/tensor_stream.py [--reps N] [--mib M] [--cases ...]``.

Every case sends the same state dict (a few large float32/bf16 matrices and ~170 small
tensors) from this process (the client) to a server in another process that reassembles it
into one buffer per tensor, allocated as the tensor's header arrives
(:func:`areal_grpc.host_memory.empty_buffer` in every case), and answers once the whole
state dict is in place; the time is from the first byte sent to that answer.

* ``tcp``: the baseline. A length-prefixed framing per tensor (name length, byte count, name)
  then ``sendall`` straight from tensor memory; the server ``recv_into``s the tensor's buffer.
* ``tensor_stream_naive``: gRPC with plain protobuf ``TensorChunk`` messages (1 MiB chunks,
  ``SerializeToString`` / ``FromString``), default channel settings, glibc malloc defaults
  on the server.
* ``tensor_stream``: gRPC with :mod:`areal_grpc.chunk_wire`'s fast path (wire bytes built
  with one copy out of tensor memory, data sliced out of received bytes without a copy, CRC-32C
  on memory in place), its channel options and ``tune_malloc`` on the server.
* ``grpc_ceiling``: what grpcio's Python transport alone reaches: the same number of bytes as
  1 MiB messages serialised before the clock starts (no framing, no CRC, identity
  serialisers) on the fast case's channel settings, each copied into one preallocated buffer
  on arrival. ``tensor_stream`` (the STREAM weight-sync path) is reported against it too.
* ``side_channel``: the SOCKET method's side channel (:mod:`areal_grpc.side_channel`): a new
  connection per state dict (as per update), the preamble with a token and version, then
  1 MiB frames with CRC-32C sent from tensor memory (each frame checksummed just before it
  is sent) and read with ``recv_into`` into buffers allocated from the tensor list (which
  the protocol announces over gRPC beforehand), each piece checksummed as it arrives. Its
  target is 0.9 of raw TCP ([data-plane]); the gRPC cases' is 0.8.

The client process (shared by all cases) and the TCP server call ``tune_malloc`` too. Each
gRPC server is checked once, untimed, to hold exactly the bytes sent (a digest of every
tensor). Then one warm-up round and ``--reps`` timed rounds run, the cases interleaved within
each round so that load from other processes hits them alike. MB/s (10**6 B/s) is the median
over rounds; CPU seconds per GiB of each side are reported too.

``--link GBIT`` puts every server on a second "host": a network namespace reached over a veth
pair shaped to GBIT Gbit/s each way (``bench/link.py``; needs root); the cases' names end in
``_link<GBIT>gbit``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc
import link as shaped
import torch
from arealgrpc.v1 import tensor_pb2
from results import result

from areal_grpc import side_channel as sc
from areal_grpc.checksum import crc32c
from areal_grpc.chunk_wire import CHUNK_SERIALIZERS, stream_channel_options
from areal_grpc.chunks import assemble_or_abort, iter_chunk_views, iter_chunks
from areal_grpc.host_memory import empty_buffer, tune_malloc
from areal_grpc.server import (
    ChannelOptions,
    ServerOptions,
    channel_options,
    server_options,
)

MiB = 1 << 20
SERVICE = "areal.bench.TensorSink"
FRAME = struct.Struct("<QQ")  # name length, data length; (0, 0) ends the stream


def make_state_dict(total_mib: int) -> dict[str, torch.Tensor]:
    """A model-like mix: a few big float32/bf16 matrices and many small tensors."""
    g = torch.Generator().manual_seed(0)
    scale = total_mib / 256
    rows = max(1, int(4096 * scale))
    sd: dict[str, torch.Tensor] = {
        "embed_tokens.weight": torch.randn(rows, 4096, generator=g),  # 64 MiB
        "lm_head.weight": torch.randn(rows * 2, 4096, generator=g).to(torch.bfloat16),  # 64 MiB
    }
    for i in range(6):  # 6 x 16 MiB, bf16 and float32
        dtype = torch.bfloat16 if i % 2 else torch.float32
        n_rows = max(1, rows // (2 if dtype == torch.bfloat16 else 4))
        sd[f"layers.{i}.mlp.up_proj.weight"] = torch.randn(n_rows, 4096, generator=g).to(dtype)
    small = int(32 * MiB * scale)
    i = 0
    while small > 0:  # ~170 small tensors (32 MiB): norms, biases, 32 KiB .. 512 KiB
        n = 8192 << (i % 5)
        sd[f"layers.{i}.norm.weight"] = torch.randn(n, generator=g)
        small -= n * 4
        i += 1
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# --- gRPC -------------------------------------------------------------------------------------


def _naive_decode(buf: bytes) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk.FromString(buf)


def _naive_encode(msg: tensor_pb2.TensorChunk) -> bytes:
    return msg.SerializeToString()


def _summary(sd: dict[str, torch.Tensor]) -> bytes:
    """The server's answer: tensor count, byte count, and its process CPU seconds so far."""
    return struct.pack("<QQd", len(sd), nbytes(sd), time.process_time())


def _digest(sd: dict[str, torch.Tensor]) -> int:
    """CRC-32C over every tensor's name, dtype, shape and bytes, in order."""
    parts = []
    for name, t in sd.items():
        raw = t.reshape(-1).view(torch.uint8)
        header = f"{name}|{t.dtype}|{list(t.shape)}".encode()
        parts.append(header + struct.pack("<I", crc32c(memoryview(raw.numpy()))))
    return crc32c(b"".join(parts))


def grpc_server_main(host: str, fast: bool, ready: Any) -> None:
    """Server process: a grpc.aio server reassembling each incoming stream."""
    torch.set_num_threads(1)
    if fast:
        tune_malloc()

    async def sink(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        sd = await assemble_or_abort(requests, context)
        meta = dict(context.invocation_metadata() or ())
        if meta.get("verify") == "1":
            return struct.pack("<QQQ", len(sd), nbytes(sd), _digest(sd))
        return _summary(sd)

    decode = CHUNK_SERIALIZERS[1] if fast else _naive_decode
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Push": grpc.stream_unary_rpc_method_handler(
                sink, request_deserializer=decode, response_serializer=bytes
            )
        },
    )
    _serve(handler, host, fast, ready)


def _serve(handler: grpc.GenericRpcHandler, host: str, fast: bool, ready: Any) -> None:
    """Serves ``handler`` on ``host`` until killed, after sending the port to ``ready``.

    A bare grpc.aio server: start_server (areal_grpc.server) takes no extra channel
    arguments, and health/reflection play no part here.
    """

    async def main() -> None:
        options = server_options(ServerOptions())
        if fast:
            options += stream_channel_options()
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        ready.send(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _channel(host: str, port: int, fast: bool) -> grpc.Channel:
    """A channel to a benchmark server, with the fast path's options when ``fast``."""
    extra = stream_channel_options() if fast else []
    return grpc.insecure_channel(
        f"{host}:{port}", options=channel_options(ChannelOptions(extra=extra))
    )


def grpc_push(
    host: str, port: int, sd: dict[str, torch.Tensor], fast: bool, verify: bool = False
) -> bytes:
    """Client side: one stream of the whole state dict; returns the server's answer."""
    channel = _channel(host, port, fast)
    try:
        encode = CHUNK_SERIALIZERS[0] if fast else _naive_encode
        call = channel.stream_unary(
            f"/{SERVICE}/Push", request_serializer=encode, response_deserializer=bytes
        )
        chunks: Iterator[Any] = iter_chunk_views(sd) if fast else iter_chunks(sd)
        return call(chunks, metadata=(("verify", "1" if verify else "0"),))
    finally:
        channel.close()


# --- grpcio's own ceiling ---------------------------------------------------------------------


def grpc_ceiling_server_main(host: str, ready: Any) -> None:
    """Server process: drains a stream of raw byte messages into one preallocated buffer."""
    torch.set_num_threads(1)
    tune_malloc()
    buf = bytearray(0)

    async def drain(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal buf
        meta = dict(context.invocation_metadata() or ())
        total = int(meta["bytes"])
        if len(buf) < total:
            buf = bytearray(total)
        view, got = memoryview(buf), 0
        async for msg in requests:
            view[got : got + len(msg)] = msg
            got += len(msg)
        return struct.pack("<QQd", int(meta["tensors"]), got, time.process_time())

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Drain": grpc.stream_unary_rpc_method_handler(drain)}
    )
    _serve(handler, host, True, ready)


def grpc_ceiling_push(host: str, port: int, messages: list[bytes], tensors: int) -> bytes:
    """Client side: one stream of pre-serialised messages; returns the server's answer."""
    channel = _channel(host, port, True)
    try:
        call = channel.stream_unary(f"/{SERVICE}/Drain")
        total = sum(len(m) for m in messages)
        return call(iter(messages), metadata=(("bytes", str(total)), ("tensors", str(tensors))))
    finally:
        channel.close()


# --- raw TCP ----------------------------------------------------------------------------------


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while len(view):
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed mid-frame")
        view = view[n:]


def tcp_server_main(host: str, ready: Any) -> None:
    """Server process: reads framed tensors into preallocated buffers, acks each state dict."""
    torch.set_num_threads(1)
    tune_malloc()  # as the fast gRPC server does, so neither side has an edge
    lsock = socket.create_server((host, 0))
    ready.send(lsock.getsockname()[1])
    head = bytearray(FRAME.size)
    while True:
        conn, _ = lsock.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                sd: dict[str, torch.Tensor] = {}
                try:
                    _recv_exact(conn, memoryview(head))
                except ConnectionError:
                    break
                name_len, size = FRAME.unpack(head)
                while (name_len, size) != (0, 0):
                    name = bytearray(name_len)
                    _recv_exact(conn, memoryview(name))
                    buf = empty_buffer(size)  # same allocation as the assembler's
                    if size:
                        _recv_exact(conn, memoryview(buf.numpy()))
                    sd[name.decode()] = buf
                    _recv_exact(conn, memoryview(head))
                    name_len, size = FRAME.unpack(head)
                conn.sendall(_summary(sd))


def tcp_push(conn: socket.socket, sd: dict[str, torch.Tensor]) -> bytes:
    """Client side: every tensor framed and sent from its own memory; waits for the ack."""
    for name, t in sd.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        key = name.encode()
        conn.sendall(FRAME.pack(len(key), raw.numel()) + key)
        if raw.numel():
            conn.sendall(memoryview(raw.numpy()))
    conn.sendall(FRAME.pack(0, 0))
    reply = bytearray(24)
    _recv_exact(conn, memoryview(reply))
    return bytes(reply)


# --- the SOCKET side channel -----------------------------------------------------------------

TOKEN = b"t" * sc.TOKEN_BYTES


def side_channel_server_main(host: str, sizes: list[int], ready: Any) -> None:
    """Server process: per connection, one state dict of tensors of ``sizes`` bytes, read
    into buffers allocated as the announcement (here: known sizes) arrives; acks each."""
    torch.set_num_threads(1)
    tune_malloc()
    lsock = socket.create_server((host, 0))
    ready.send(lsock.getsockname()[1])
    while True:
        conn = sc.accept(lsock, time.monotonic() + 3600)
        with conn:
            dests = [empty_buffer(n) for n in sizes]
            sc.receive_tensors(
                conn, TOKEN, 1, dests, sc.DEFAULT_FRAME_BYTES, time.monotonic() + 600
            )
            sd = {str(i): d for i, d in enumerate(dests)}
            conn.sendall(_summary(sd))
            # Freed before the next state dict's buffers are allocated, as the TCP server's
            # are: otherwise this server fills fresh memory (page faults) where that one
            # refills what it just freed.
            del sd, dests


def side_channel_push(host: str, port: int, sd: dict[str, torch.Tensor]) -> bytes:
    """Client side: a connection, the preamble, every tensor as frames, the end; the ack."""
    with socket.create_connection((host, port)) as conn:
        sc.tune(conn)
        sc.send_preamble(conn, TOKEN, 1)
        tensors = [(i, t.detach().contiguous()) for i, t in enumerate(sd.values())]
        sc.send_tensors(conn, tensors, sc.DEFAULT_FRAME_BYTES)
        sc.send_end(conn)
        reply = bytearray(24)
        _recv_exact(conn, memoryview(reply))
        return bytes(reply)


# --- driver -----------------------------------------------------------------------------------


def _server(link: shaped.Link | None, target: Callable[..., None], *args: Any) -> None:
    """A server process's entry: across ``link`` when given, else on loopback."""
    if link is not None:
        shaped.enter(link.netns)
    target(link.peer_ip if link else "127.0.0.1", *args)


def spawn(
    link: shaped.Link | None, target: Callable[..., None], *args: Any
) -> tuple[mp.Process, int]:
    """Starts a server process (across ``link`` when given); returns it and its port."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(link, target, *args, child), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start (exit code {proc.exitcode})")
    port = parent.recv()
    return proc, port


class Case:
    """One way of moving the state dict, with its server process and per-run records."""

    def __init__(self, name: str, sd: dict[str, torch.Tensor], link: shaped.Link | None) -> None:
        self.name = name
        self.sd = sd
        self.host = link.peer_ip if link else "127.0.0.1"
        self.seconds: list[float] = []
        self.client_cpu: list[float] = []
        self.server_cpu: list[float] = []
        self._last_server_cpu: float | None = None
        self.conn: socket.socket | None = None
        if name == "side_channel":
            sizes = [t.numel() * t.element_size() for t in sd.values()]
            self.proc, self.port = spawn(link, side_channel_server_main, sizes)
        elif name == "grpc_ceiling":
            self.proc, self.port = spawn(link, grpc_ceiling_server_main)
            data = b"".join(bytes(t.reshape(-1).view(torch.uint8).numpy()) for t in sd.values())
            self.messages = [data[i : i + MiB] for i in range(0, len(data), MiB)]
        elif name == "tcp":
            self.proc, self.port = spawn(link, tcp_server_main)
            self.conn = socket.create_connection((self.host, self.port))
            self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.fast = name == "tensor_stream"
            self.proc, self.port = spawn(link, grpc_server_main, self.fast)
            # One untimed check that the server really holds the same bytes.
            reply = grpc_push(self.host, self.port, sd, self.fast, verify=True)
            if struct.unpack("<QQQ", reply[:24])[2] != _digest(sd):
                raise RuntimeError(f"{name}: the server's digest differs")

    def run(self, expect: bytes, record: bool) -> None:
        """Moves the state dict once; records wall time and CPU time of both sides."""
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if self.name == "side_channel":
            answer = side_channel_push(self.host, self.port, self.sd)
        elif self.name == "grpc_ceiling":
            answer = grpc_ceiling_push(self.host, self.port, self.messages, len(self.sd))
        elif self.conn is not None:
            answer = tcp_push(self.conn, self.sd)
        else:
            answer = grpc_push(self.host, self.port, self.sd, self.fast)
        dt = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        if answer[:16] != expect:
            raise RuntimeError(f"{self.name}: server answered {answer[:16]!r}, not {expect!r}")
        server_cpu = struct.unpack("<d", answer[16:24])[0]
        if record and self._last_server_cpu is not None:
            self.seconds.append(dt)
            self.client_cpu.append(cpu)
            self.server_cpu.append(server_cpu - self._last_server_cpu)
        self._last_server_cpu = server_cpu

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.proc.kill()
        self.proc.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument(
        "--cases",
        default="tcp,grpc_ceiling,tensor_stream_naive,tensor_stream,side_channel",
        help="comma-separated",
    )
    shaped.add_option(parser, "the servers")
    args = parser.parse_args()
    with shaped.from_args(parser, args.link) as link:
        run(args, link)


def run(args: argparse.Namespace, link: shaped.Link | None) -> None:
    """The benchmark proper (the servers across ``link`` when given)."""
    torch.set_num_threads(1)
    # Client process of every case (naive included): buffers stay mapped for reuse.
    tune_malloc()
    sd = make_state_dict(args.mib)
    total = nbytes(sd)
    expect = _summary(sd)[:16]
    print(
        f"state dict: {len(sd)} tensors, {total / MiB:.1f} MiB; 1 warm-up + {args.reps} rounds, "
        "cases interleaved within each round; MB/s = 10**6 B/s, median over rounds"
        + (f"; the servers across a {link.gbit:g} Gbit/s link" if link else "")
    )
    cases = [Case(name, sd, link) for name in args.cases.split(",")]
    try:
        for r in range(args.reps + 1):
            for case in cases:
                case.run(expect, record=r > 0)
    finally:
        for case in cases:
            case.close()
    gib = total / (1 << 30)
    for case in cases:
        mbs = [total / t / 1e6 for t in case.seconds]
        print(
            f"{case.name:20s} median {statistics.median(mbs):6.0f} MB/s "
            f"(min {min(mbs):.0f}, max {max(mbs):.0f}); CPU s/GiB: client "
            f"{statistics.median(case.client_cpu) / gib:.2f}, server "
            f"{statistics.median(case.server_cpu) / gib:.2f}",
            flush=True,
        )
    base = next((c for c in cases if c.name == "tcp"), None)
    if base is None:
        return
    base_mbs = total / statistics.median(base.seconds) / 1e6
    for case in cases:
        if case is base:
            continue
        value = total / statistics.median(case.seconds) / 1e6
        rounds = [b / c for b, c in zip(base.seconds, case.seconds, strict=True)]
        print(
            f"{case.name}: per-round ratio median {statistics.median(rounds):.2f} "
            f"(min {min(rounds):.2f}, max {max(rounds):.2f})"
        )
    for case in cases:
        if case is base:
            continue
        value = total / statistics.median(case.seconds) / 1e6
        name, target = {
            "side_channel": ("tensor_stream_side_channel", "0.9"),
            "grpc_ceiling": ("tensor_stream_grpc_ceiling", "none"),
        }.get(case.name, (case.name, "0.8"))
        name += f"_{link.label}" if link else ""
        result(name, value, "MB/s", base_mbs, target)
    by_name = {c.name: c for c in cases}
    if "grpc_ceiling" in by_name and "tensor_stream" in by_name:
        # The STREAM path against what its transport allows at all (target: none set).
        value = total / statistics.median(by_name["tensor_stream"].seconds) / 1e6
        ceiling = total / statistics.median(by_name["grpc_ceiling"].seconds) / 1e6
        name = "tensor_stream_vs_grpc_ceiling" + (f"_{link.label}" if link else "")
        result(name, value, "MB/s", ceiling, "none")


if __name__ == "__main__":
    sys.exit(main())
