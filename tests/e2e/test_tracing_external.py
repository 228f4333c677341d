"""One trace per external lease: lease -> generate -> submission -> training step.

The whole mesh: a real run (``python -m areal_grpc.coordinator``: a rollout server and two
FSDP2 trainer ranks as child processes) exports its spans over OTLP to a real receiver on
loopback. This process is an external producer using only the typed clients, with tracing of
its own (exported to the same receiver): it takes a lease inside its own span, generates at
the lease's rollout server, scores, and submits. Nothing passes trace contexts by hand: the
clients do it. (A CoordinatorService in this process: tests/service/test_tracing_external.py.)
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from areal_clients.coordinator import CoordinatorClient
from areal_clients.rollout import RolloutClient
from arealgrpc.v1 import common_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from areal_grpc import tracing
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.errors import retry_delay_s
from areal_grpc.model import load_tokenizer

PRODUCER = "py-agent"


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
