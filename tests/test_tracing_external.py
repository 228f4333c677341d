"""One trace per external lease: lease -> generate -> submission -> training step.

The fast tests run a CoordinatorService in this process with tracing kept in memory. The slow
one is the whole mesh: a real run (``python -m areal_grpc.coordinator``: a rollout server and
two FSDP2 trainer ranks as child processes) exports its spans over OTLP to a real receiver on
loopback. This process is an external producer using only the typed clients, with tracing of
its own (exported to the same receiver): it takes a lease inside its own span, generates at
the lease's rollout server, scores, and submits. Nothing passes trace contexts by hand: the
clients do it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from areal_clients.coordinator import CoordinatorClient
from areal_clients.rollout import RolloutClient
from arealgrpc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from areal_grpc import tracing
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.errors import retry_delay_s
from areal_grpc.model import load_tokenizer
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


async def produce(address: str) -> tuple[str, int, str, int]:
    """One episode as an external producer: (lease id, lease version, rollout address, the
    episode span's id). Only the typed clients; no trace context is passed by hand."""
    tokenizer = load_tokenizer("builtin:micro")
    client = CoordinatorClient(address)
    try:
        with tracing.span("agent.episode") as root:
            while True:
                try:
                    lease = await client.acquire(PRODUCER, group_size=2)
                    break
                except grpc.aio.AioRpcError as exc:
                    # A busy run says when to come back.
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    delay = retry_delay_s(exc)
                    assert delay is not None, exc
                    await asyncio.sleep(delay)
            rollout = RolloutClient(lease.rollout_address)
            try:
                ids = tokenizer.encode("ab=", add_special_tokens=False)
                reply = await rollout.generate(
                    ids, common_pb2.SamplingParams(n_samples=2, max_new_tokens=2, temperature=1.0)
                )
            finally:
                await rollout.close()
            group = common_pb2.TrajectoryGroup(task_id=lease.lease_id, group_id=lease.lease_id)
            for c in reply.completions:
                group.trajectories.add(
                    token_ids=[*ids, *c.output_ids],
                    logprobs=[0.0] * len(ids) + list(c.output_logprobs),
                    versions=[-1] * len(ids) + list(c.output_versions),
                    loss_mask=[False] * len(ids) + [True] * len(c.output_ids),
                    reward=1.0 if c.output_ids[0] == ids[0] else 0.0,
                    prompt_length=len(ids),
                    task_id=lease.lease_id,
                )
            submitted = await client.submit([(lease.lease_id, group)])
            assert submitted.accepted_groups == 1, submitted
            # The caller's group is left as it was built (the client sends a copy).
            assert not group.trajectories[0].HasField("trace_context")
        return (
            lease.lease_id,
            lease.policy_version,
            lease.rollout_address,
            root.get_span_context().span_id,
        )
    finally:
        await client.close()


@pytest.mark.slow
def test_an_external_producers_lease_is_one_trace_through_generate_submit_and_train(
    tmp_path: Path, otlp_collector, coordinator_command
) -> None:
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out,
        *coordinator_command.SMALL_RUN,
        # Stopped with Ctrl-C once the producer's group is trained (how fast it gets a
        # lease must not race a fixed step count).
        "total_steps=100000",
        "weight_sync.methods=[stream]",
        env=otlp_collector.env(),
    )
    rest: list[str] = []
    # The producer's own spans go to the same receiver (service.name areal-test-agent).
    exporter = OTLPSpanExporter(endpoint=otlp_collector.address, insecure=True)
    tracing.init_tracing("areal-test-agent", SimpleSpanProcessor(exporter))
    try:
        address = coordinator_command.address(proc)
        drain = threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True)
        drain.start()
        lease_id, lease_version, rollout_address, root_span_id = asyncio.run(produce(address))
        tracing.shutdown_tracing()

        def trained_step() -> int | None:
            for rec in read_jsonl(out / "batches.jsonl"):
                if any(g["task_id"] == lease_id for g in rec["groups"]):
                    return int(rec["step"])
            return None

        deadline = time.monotonic() + 120
        while trained_step() is None:
            assert time.monotonic() < deadline, "".join(rest)
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, "".join(rest)  # every child stopped, flushed
        drain.join(timeout=10)
    finally:
        tracing.shutdown_tracing()
    step = trained_step()

    attr = otlp_collector.attr
    # Children flush on SIGTERM from the stopping run; the receiver may still be writing.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
        s.name == "rollout.generate" for _, s in otlp_collector.spans()
    ):
        time.sleep(0.2)
    spans = otlp_collector.spans()

    def one(service: str, name: str) -> object:
        found = [
            s
            for svc, s in spans
            if svc == service and s.name == name and attr(s, "areal.task_id") == lease_id
        ]
        assert len(found) == 1, (service, name, [(svc, s.name) for svc, s in spans])
        return found[0]

    (root,) = [s for svc, s in spans if svc == "areal-test-agent" and s.name == "agent.episode"]
    lease = one("areal-coordinator", "coordinator.lease")
    generate = one("areal-rollout", "rollout.generate")
    submit = one("areal-coordinator", "coordinator.submit_group")
    trace_id = root.trace_id
    # One trace: the producer's span -> the lease -> {generation, submission}, over three
    # processes, though no call carried trace metadata of the lease.
    assert int.from_bytes(root.span_id, "big") == root_span_id
    assert lease.trace_id == generate.trace_id == submit.trace_id == trace_id
    assert lease.parent_span_id == root.span_id
    assert generate.parent_span_id == lease.span_id
    assert submit.parent_span_id == lease.span_id
    # What each span says about the lease.
    assert attr(lease, "areal.policy_version") == lease_version
    assert attr(lease, "areal.producer_id") == PRODUCER
    assert attr(lease, "areal.rollout_server") == rollout_address
    assert attr(generate, "areal.samples") == 2
    assert attr(submit, "areal.outcome") == "accepted"
    assert attr(submit, "areal.producer_id") == PRODUCER
    # The training step that trained the group links to the lease's trace.
    steps = [s for _, s in spans if s.name == "coordinator.train_step"]
    linking = [s for s in steps if any(ln.trace_id == trace_id for ln in s.links)]
    assert len(linking) == 1, [attr(s, "areal.step") for s in steps]
    assert attr(linking[0], "areal.step") == step
    (link,) = [ln for ln in linking[0].links if ln.trace_id == trace_id]
    assert link.span_id == lease.span_id
