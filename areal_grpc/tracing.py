"""OpenTelemetry for every service: provider set-up, gRPC interceptors, trace context in messages.

A bidi stream is one RPC but carries many tasks, so a task's trace context travels inside each
streamed message (``arealgrpc.v1.TraceContext``, W3C ``traceparent``/``tracestate``), not only in
the call's metadata. :func:`to_proto` captures the current span; :func:`from_proto` turns a
message's context back into a parent for the next span.

Export: when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, spans go over OTLP/gRPC (Jaeger ingests
OTLP directly on port 4317); otherwise nothing is exported and no interceptor is installed, so
untraced runs pay nothing. Sampling follows the standard ``OTEL_TRACES_SAMPLER`` /
``OTEL_TRACES_SAMPLER_ARG`` variables (parent-based always-on by default).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import grpc
from arealgrpc.v1 import common_pb2
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Span attribute names shared by every service.
POLICY_VERSION = "areal.policy_version"
STALENESS = "areal.staleness"
TASK_ID = "areal.task_id"
ROLLOUT_SERVER = "areal.rollout_server"
TOKENS = "areal.tokens"
PRODUCER_ID = "areal.producer_id"

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None


def init_tracing(
    service_name: str, processor: SpanProcessor | None = None
) -> TracerProvider | None:
    """Sets up tracing for this process; returns the provider, or None when tracing is off.

    Tracing is on when ``processor`` is given (tests pass an in-memory one) or when
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (spans are batched to that OTLP/gRPC endpoint).
    """
    global _provider
    if processor is None and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if processor is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter())
    provider.add_span_processor(processor)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flushes and stops the provider set up by :func:`init_tracing` (no-op when off)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def enabled() -> bool:
    """True when :func:`init_tracing` turned tracing on in this process."""
    return _provider is not None


def tracer(name: str = "areal_grpc") -> trace.Tracer:
    """A tracer from this process's provider (a no-op tracer when tracing is off)."""
    if _provider is None:
        return trace.NoOpTracer()
    return _provider.get_tracer(name)


# Not traced per call: health probes (noise), and PushWeights, whose sender writes chunks with
# call.write(): OpenTelemetry's aio client interceptor awaits a stream-unary call's response
# inside the interceptor, before the caller can write, which deadlocks that style of call. The
# transfer is covered by the PublishWeights and coordinator.weight_sync spans.
UNTRACED_METHODS = ("/arealgrpc.v1.WeightSyncService/PushWeights",)


def _traced_calls() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(
        filters.any_of(
            filters.health_check(), *(filters.full_method_name(m) for m in UNTRACED_METHODS)
        )
    )


def server_interceptors() -> list[Any]:
    """aio server interceptors that open a span per RPC (none when tracing is off)."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider, filter_=_traced_calls())]


def aio_client_interceptors() -> list[Any]:
    """aio channel interceptors that open a client span per RPC (none when tracing is off)."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors as make

    return list(make(tracer_provider=_provider, filter_=_traced_calls()))


def traced_sync_channel(channel: grpc.Channel) -> grpc.Channel:
    """``channel`` with a client span per RPC (unchanged when tracing is off)."""
    if _provider is None:
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    interceptor = client_interceptor(tracer_provider=_provider, filter_=_traced_calls())
    return intercept_channel(channel, interceptor)


def to_proto(ctx: otel_context.Context | None = None) -> common_pb2.TraceContext:
    """The W3C trace context of ``ctx`` (default: the current span) as a message field."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return common_pb2.TraceContext(
        traceparent=carrier.get("traceparent", ""), tracestate=carrier.get("tracestate", "")
    )


def from_proto(msg: common_pb2.TraceContext | None) -> otel_context.Context | None:
    """A parent context from a message's trace context; None when it carries no valid one.

    A malformed ``traceparent`` (any caller can send one) counts as none, so the span falls
    back to the current span instead of starting a detached trace.
    """
    if msg is None or not msg.traceparent:
        return None
    carrier = {"traceparent": msg.traceparent}
    if msg.tracestate:
        carrier["tracestate"] = msg.tracestate
    ctx = _PROPAGATOR.extract(carrier)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def is_valid(msg: common_pb2.TraceContext | None) -> bool:
    """True when ``msg`` carries a well-formed W3C trace context."""
    return from_proto(msg) is not None


def trace_id(msg: common_pb2.TraceContext | None) -> str:
    """The 32-hex-digit trace id of a message's context ("" when it carries no valid one)."""
    ctx = from_proto(msg)
    if ctx is None:
        return ""
    return format(trace.get_current_span(ctx).get_span_context().trace_id, "032x")


# The trace context (and task id) an external producer works under in this asyncio task: set
# from a lease by areal_clients.coordinator, read by the clients when they build outgoing
# messages. A context variable, so that concurrent producer tasks each keep their own lease's.
_carried: ContextVar[tuple[common_pb2.TraceContext | None, str] | None] = ContextVar(
    "areal_carried", default=None
)


def carry(msg: common_pb2.TraceContext | None, task_id: str = "") -> None:
    """Makes ``msg`` (of task ``task_id``) the default of this asyncio task's messages.

    A lease without a valid context still replaces the previous lease's: a new lease's
    messages must never join an older lease's trace (they fall back to the current span).
    """
    _carried.set((msg if msg is not None and is_valid(msg) else None, task_id))


def carried_task_id() -> str:
    """The task id given to the last :func:`carry` of this asyncio task ("" when none)."""
    carried = _carried.get()
    return carried[1] if carried is not None else ""


def outgoing(
    explicit: common_pb2.TraceContext | None = None, *, use_carried: bool = True
) -> common_pb2.TraceContext:
    """The trace context to put in an outgoing message.

    In order: ``explicit`` (when valid), the context this task :func:`carry`-ies (a lease's;
    skipped with ``use_carried=False``, e.g. when asking for the next lease), the current
    span when tracing is on in this process, else an empty context.
    """
    if explicit is not None and is_valid(explicit):
        return explicit
    carried = _carried.get()
    if use_carried and carried is not None and carried[0] is not None:
        return carried[0]
    return to_proto() if _provider is not None else common_pb2.TraceContext()


@contextmanager
def span(
    name: str,
    parent: common_pb2.TraceContext | otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[common_pb2.TraceContext] = (),
) -> Iterator[trace.Span]:
    """A span named ``name``, child of ``parent`` (a message's context) or of the current span.

    ``links`` point at other traces this span works on: a training step consumes groups that
    each carry their own task's trace, so the step span links to all of them.
    """
    ctx = from_proto(parent) if isinstance(parent, common_pb2.TraceContext) else parent
    span_links = []
    for tc in links:
        linked = from_proto(tc)
        if linked is not None:
            span_context = trace.get_current_span(linked).get_span_context()
            if span_context.is_valid:
                span_links.append(trace.Link(span_context))
    with tracer().start_as_current_span(
        name, context=ctx, attributes=dict(attributes or {}), links=span_links
    ) as current:
        yield current
