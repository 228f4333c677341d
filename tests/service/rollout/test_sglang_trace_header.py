"""The sglang engine's HTTP requests carry the W3C ``traceparent`` of the current span, so an
SGLang server started with ``--enable-trace`` joins the episode's trace: what our HTTP client
puts on the wire, read by a plain socket server (no SGLang involved)."""

from __future__ import annotations

import asyncio

from areal_servers.rollout.sglang_engine import http_request
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from areal_grpc import tracing


async def _capture_server(heads: list[str]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("ascii")
        heads.append(head)
        length = int(
            next(
                h.split(":")[1]
                for h in head.split("\r\n")
                if h.lower().startswith("content-length")
            )
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_http_requests_to_sglang_carry_the_spans_traceparent():
    heads: list[str] = []
    server = await _capture_server(heads)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    exporter = InMemorySpanExporter()
    tracing.init_tracing("areal-rollout", SimpleSpanProcessor(exporter))
    try:
        with tracing.span("rollout.episode") as span:
            resp = await http_request(url, "POST", "/generate", {"input_ids": [1]})
            trace_id = f"{span.get_span_context().trace_id:032x}"
        assert resp.status == 200
    finally:
        tracing.shutdown_tracing()
    # Untraced: no header at all.
    await http_request(url, "POST", "/generate", {"input_ids": [1]})
    server.close()
    await server.wait_closed()
    traced = {
        h.split(":", 1)[0].lower(): h.split(":", 1)[1].strip()
        for h in heads[0].split("\r\n")[1:]
        if ":" in h
    }
    assert traced["traceparent"].split("-")[1] == trace_id
    assert "traceparent" not in heads[1].lower()
