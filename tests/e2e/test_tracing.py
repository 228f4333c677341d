"""Tracing across processes: a server process exporting spans over OTLP to a real receiver, a
training run's mesh as one connected trace (in this process: tests/service/test_tracing.py)."""

from __future__ import annotations

import contextlib
import signal
import time

import grpc
from arealgrpc.v1 import coordinator_pb2, coordinator_pb2_grpc

from areal_grpc.launch import python_module_argv, start_child, stop_children
from areal_grpc.server import sync_channel


def test_server_process_exports_spans_over_otlp(tmp_path, otlp_collector):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{otlp_collector.address}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    child = start_child(
        "coordinator",
        python_module_argv("areal_grpc.coordinator.serve", "--port", "0"),
        log_dir=tmp_path,
        env=env,
    )
    try:
        with sync_channel(child.address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            # An error status (UNIMPLEMENTED today) is traced too; the span is what counts.
            with contextlib.suppress(grpc.RpcError):
                stub.GetCoordinatorStatus(coordinator_pb2.GetCoordinatorStatusRequest(), timeout=10)
        child.process.send_signal(signal.SIGTERM)  # shutdown flushes the batch
        assert child.process.wait(timeout=30) == 0
    finally:
        stop_children([child])
    deadline = time.monotonic() + 10
    while not otlp_collector.requests and time.monotonic() < deadline:
        otlp_collector.got.wait(0.1)
    spans_by_service: dict[str, list[str]] = {}
    for name, span in otlp_collector.spans():
        spans_by_service.setdefault(name, []).append(span.name)
    assert "/arealgrpc.v1.CoordinatorService/GetCoordinatorStatus" in spans_by_service.get(
        "areal-coordinator", []
    ), spans_by_service


def test_one_training_run_is_one_connected_trace_across_the_mesh(
    tmp_path, otlp_collector, coordinator_command
):
    code, log = coordinator_command.run(
        tmp_path,
        *coordinator_command.SMALL_RUN,
        "total_steps=2",
        "weight_sync.methods=[stream]",
        env=otlp_collector.env(),
    )
    assert code == 0, log
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
        name == "areal-trainer" for name, _ in otlp_collector.spans()
    ):
        time.sleep(0.2)
    spans = otlp_collector.spans()
    services = {name for name, _ in spans}
    assert {"areal-coordinator", "areal-rollout", "areal-trainer"} <= services, services
    by_id = {s.span_id: (name, s) for name, s in spans}

    def attr(span, key):
        for a in span.attributes:
            if a.key == key:
                return a.value.int_value or a.value.string_value
        return None

    # A task's trace: coordinator.submit -> rollout.episode (another process), same trace.
    episodes = [s for name, s in spans if s.name == "rollout.episode" and name == "areal-rollout"]
    assert episodes
    for ep in episodes:
        parent_service, parent = by_id[ep.parent_span_id]
        assert (parent_service, parent.name) == ("areal-coordinator", "coordinator.submit")
        assert parent.trace_id == ep.trace_id
        assert attr(ep, "areal.task_id") == attr(parent, "areal.task_id")
    # A training step links to the episodes it trained, and its TrainStep calls reach both
    # ranks as children of it.
    steps = [s for _, s in spans if s.name == "coordinator.train_step"]
    assert len(steps) == 2
    episode_ids = {(e.trace_id, e.span_id) for e in episodes}
    for step in steps:
        assert step.links and all((ln.trace_id, ln.span_id) in episode_ids for ln in step.links)
    trainer_calls = [
        s
        for name, s in spans
        if name == "areal-trainer" and s.name == "/arealgrpc.v1.TrainerService/TrainStep"
    ]
    assert len(trainer_calls) == 4  # 2 steps x 2 ranks
    step_ids = {s.span_id for s in steps}
    for call in trainer_calls:
        client_service, client = by_id[call.parent_span_id]
        assert client_service == "areal-coordinator"
        assert client.parent_span_id in step_ids
    assert any(s.name == "coordinator.weight_sync" for _, s in spans)
    # Attributes and finer spans: where each task ran, rewards under their episode, staleness
    # of each step, micro-batches as events on the ranks' step spans.
    submits = [s for _, s in spans if s.name == "coordinator.submit"]
    assert all(str(attr(s, "areal.rollout_server")).startswith("127.0.0.1:") for s in submits)
    episode_span_ids = {e.span_id for e in episodes}
    rewards = [s for _, s in spans if s.name == "rollout.reward"]
    assert rewards and all(r.parent_span_id in episode_span_ids for r in rewards)
    assert all(attr(s, "areal.staleness") is not None for s in steps)
    for call in trainer_calls:
        assert any(ev.name == "microbatch" for ev in call.events)
