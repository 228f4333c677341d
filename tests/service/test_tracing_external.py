"""One trace per external lease, in this process: a CoordinatorService with tracing kept in
memory; the lease continues the producer's span and its submission joins the lease (the whole
mesh exporting over OTLP: tests/e2e/test_tracing_external.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from areal_clients.coordinator import CoordinatorClient
from arealgrpc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from areal_grpc import tracing
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.server import BackgroundServer, sync_channel
from areal_grpc.trajectory import make_group

PRODUCER = "py-agent"
VOCAB = 384


def small_group(lease_id: str) -> common_pb2.TrajectoryGroup:
    """A valid two-sample group at version 0, with no trace context of its own."""
    return make_group(lease_id, [0.0, 1.0])


@pytest.fixture
def coordinator() -> Iterator[tuple[str, WorkPool]]:
    """A CoordinatorService over a work pool, served on loopback in this process."""
    pool = WorkPool(8, 0, vocab_size=VOCAB)
    svc = CoordinatorServicer(pool).as_service()
    with BackgroundServer([svc]) as running:
        yield running.address, pool


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (services and clients alike), spans kept in memory."""
    exporter = InMemorySpanExporter()
    tracing.init_tracing("areal-test", SimpleSpanProcessor(exporter))
    yield exporter
    tracing.shutdown_tracing()


def ids_of(tc: common_pb2.TraceContext) -> tuple[int, int]:
    """(trace id, span id) of a message's trace context."""
    ctx = tracing.from_proto(tc)
    assert ctx is not None, tc
    sc = trace.get_current_span(ctx).get_span_context()
    return sc.trace_id, sc.span_id


def test_a_lease_continues_the_producers_span_and_its_submission_joins_the_lease(
    coordinator, spans
):
    address, pool = coordinator

    async def scenario() -> tuple[coordinator_pb2.RolloutLease, coordinator_pb2.RolloutLease]:
        client = CoordinatorClient(address)
        try:
            with tracing.span("producer.episode"):
                lease = await client.acquire(PRODUCER, group_size=2)
            reply = await client.submit([(lease.lease_id, small_group(lease.lease_id))])
            assert reply.accepted_groups == 1
            # The next lease, outside any span: a trace of its own, not the last lease's.
            other = await client.acquire(PRODUCER, group_size=2)
            await client.release(other.lease_id)
            return lease, other
        finally:
            await client.close()

    lease, other = asyncio.run(scenario())
    finished = spans.get_finished_spans()
    (episode,) = [s for s in finished if s.name == "producer.episode"]
    leases = {s.attributes[tracing.TASK_ID]: s for s in finished if s.name == "coordinator.lease"}
    lease_span = leases[lease.lease_id]
    # The lease span is the producer's child, and the lease hands its own context out.
    assert lease_span.parent.span_id == episode.context.span_id
    assert ids_of(lease.trace_context) == (episode.context.trace_id, lease_span.context.span_id)
    assert lease_span.attributes[tracing.PRODUCER_ID] == PRODUCER
    assert lease_span.attributes[tracing.POLICY_VERSION] == 0
    # The client put the lease's context in the trajectories; the submission is its child.
    (buffered,) = pool.buffer
    assert [ids_of(t.trace_context) for t in buffered.group.trajectories] == [
        ids_of(lease.trace_context)
    ] * 2
    (submit,) = [s for s in finished if s.name == "coordinator.submit_group"]
    assert submit.parent.span_id == lease_span.context.span_id
    assert submit.attributes["areal.outcome"] == "accepted"
    assert ids_of(other.trace_context)[0] != episode.context.trace_id


def test_an_untraced_coordinator_passes_the_producers_context_on(coordinator):
    address, _ = coordinator
    mine = common_pb2.TraceContext(traceparent=f"00-{'ab' * 16}-{'cd' * 8}-01")
    with sync_channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        lease = stub.AcquireRollout(
            coordinator_pb2.AcquireRolloutRequest(
                producer_id=PRODUCER, group_size=1, trace_context=mine
            ),
            timeout=10,
        ).lease
        assert lease.trace_context == mine
        # A malformed context is no context: the call works, the lease carries none.
        lease = stub.AcquireRollout(
            coordinator_pb2.AcquireRolloutRequest(
                producer_id=PRODUCER,
                group_size=1,
                trace_context=common_pb2.TraceContext(traceparent="00-not-a-trace"),
            ),
            timeout=10,
        ).lease
        assert lease.lease_id and not lease.HasField("trace_context")


def test_concurrent_producer_tasks_each_carry_their_own_lease(coordinator, spans):
    address, _ = coordinator

    async def one(client: CoordinatorClient) -> tuple[str, str]:
        lease = await client.acquire(PRODUCER, group_size=1)
        await asyncio.sleep(0.05)  # the other task takes its lease meanwhile
        carried = tracing.outgoing()
        await client.release(lease.lease_id)
        return tracing.trace_id(lease.trace_context), tracing.trace_id(carried)

    async def scenario() -> list[tuple[str, str]]:
        client = CoordinatorClient(address)
        try:
            return await asyncio.gather(one(client), one(client))
        finally:
            await client.close()

    (a_lease, a_carried), (b_lease, b_carried) = asyncio.run(scenario())
    assert a_lease and b_lease and a_lease != b_lease
    assert (a_carried, b_carried) == (a_lease, b_lease)
