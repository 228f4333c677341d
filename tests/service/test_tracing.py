"""Tracing in this process: trace context inside messages, per-RPC spans (OTLP export from
processes: tests/e2e/test_tracing.py)."""

from __future__ import annotations

import pytest
from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from areal_grpc import tracing
from areal_grpc.server import BackgroundServer, service, sync_channel


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.init_tracing("areal-test", SimpleSpanProcessor(exporter))
    yield exporter
    tracing.shutdown_tracing()


def test_off_by_default_costs_nothing(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert tracing.init_tracing("areal-test") is None
    assert not tracing.enabled()
    assert tracing.server_interceptors() == []
    assert tracing.to_proto().traceparent == ""
    with tracing.span("noop") as s:
        assert not s.get_span_context().is_valid


def test_trace_context_travels_inside_a_message(spans):
    with tracing.span("coordinator.step", attributes={tracing.POLICY_VERSION: 3}) as parent:
        carried = tracing.to_proto()
    assert carried.traceparent.startswith("00-")
    # Later, elsewhere (another process in real use): a child span from the message alone.
    with tracing.span("rollout.episode", parent=carried, attributes={tracing.TASK_ID: "t1"}):
        pass
    by_name = {s.name: s for s in spans.get_finished_spans()}
    child, root = by_name["rollout.episode"], by_name["coordinator.step"]
    assert child.context.trace_id == parent.get_span_context().trace_id
    assert child.parent.span_id == root.context.span_id
    assert child.attributes[tracing.TASK_ID] == "t1"
    assert root.attributes[tracing.POLICY_VERSION] == 3
    assert root.resource.attributes["service.name"] == "areal-test"


class Echo(rollout_pb2_grpc.RolloutServiceServicer):
    async def Generate(self, request, context):
        with tracing.span("rollout.generate", attributes={tracing.TOKENS: len(request.input_ids)}):
            return rollout_pb2.GenerateResponse()


def test_rpcs_get_client_and_server_spans_in_one_trace(spans):
    svc = service(Echo(), rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2)
    with BackgroundServer([svc]) as server, sync_channel(server.address) as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        with tracing.span("agent.turn"):
            rollout_pb2_grpc.RolloutServiceStub(ch).Generate(
                rollout_pb2.GenerateRequest(input_ids=[1, 2, 3]), timeout=10
            )
    finished = spans.get_finished_spans()
    names = [s.name for s in finished]
    assert not any("Health" in n for n in names), names  # health checks are not traced
    rpc = [s for s in finished if s.name == "/arealgrpc.v1.RolloutService/Generate"]
    kinds = sorted(s.kind.name for s in rpc)
    assert kinds == ["CLIENT", "SERVER"]
    turn = next(s for s in finished if s.name == "agent.turn")
    inner = next(s for s in finished if s.name == "rollout.generate")
    assert {s.context.trace_id for s in [*rpc, turn, inner]} == {turn.context.trace_id}
    server_span = next(s for s in rpc if s.kind.name == "SERVER")
    assert inner.parent.span_id == server_span.context.span_id
    assert inner.attributes[tracing.TOKENS] == 3
