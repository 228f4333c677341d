"""Shared test set-up: one torch thread per process (CI has 2 cores); an OTLP receiver."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from areal_grpc.server import BackgroundServer, service

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """The suite runs on the CPU wherever it runs; ``-m gpu`` selects the GPU tests instead.

    Hiding GPUs (before anything initialises CUDA) keeps every CPU test, and every server
    process it starts, on the CPU even on a GPU machine, where "auto" devices would otherwise
    put two trainer ranks on one GPU.
    """
    if "gpu" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


# -- a real OTLP trace receiver on loopback (tests of tracing) --------------------------------


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


@pytest.fixture
def otlp_collector() -> Iterator[OtlpCollector]:
    """An :class:`OtlpCollector` served on a free loopback port for the test."""
    collector = OtlpCollector()
    svc = service(
        collector, trace_service_pb2_grpc.add_TraceServiceServicer_to_server, trace_service_pb2
    )
    with BackgroundServer([svc]) as receiver:
        collector.address = receiver.address
        yield collector
