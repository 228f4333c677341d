"""A real OTLP/gRPC trace receiver on loopback, for the tests of tracing."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from areal_grpc.server import BackgroundServer, service


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver (the protocol Jaeger speaks on port 4317)."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.got = threading.Event()
        self.address = ""

    async def Export(self, request, context):
        self.requests.append(request)
        self.got.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    def env(self) -> dict[str, str]:
        """OTEL_* variables that make a child process export its spans here, quickly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{self.address}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }

    def spans(self) -> list[tuple[str, Any]]:
        """(service.name, span) for every span received so far."""
        out = []
        for req in list(self.requests):
            for rs in req.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((attrs["service.name"], s) for s in ss.spans)
        return out

    @staticmethod
    def attr(span: Any, key: str) -> Any:
        """A span attribute's value (int or string), None when absent."""
        for a in span.attributes:
            if a.key == key:
                return a.value.int_value if a.value.HasField("int_value") else a.value.string_value
        return None


@contextlib.contextmanager
def serve_otlp_collector() -> Iterator[OtlpCollector]:
    """An :class:`OtlpCollector` served on a free loopback port for the block."""
    collector = OtlpCollector()
    svc = service(
        collector, trace_service_pb2_grpc.add_TraceServiceServicer_to_server, trace_service_pb2
    )
    with BackgroundServer([svc]) as receiver:
        collector.address = receiver.address
        yield collector
