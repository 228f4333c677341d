"""Each task on a RunEpisodes stream gets its own span, in the trace its message carries."""

from __future__ import annotations

from arealgrpc.v1 import common_pb2, rollout_pb2
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from areal_grpc import tracing
from tests.support.rollout import rollout_server, task_msg


async def test_episode_spans_join_the_trace_carried_by_each_task():
    exporter = InMemorySpanExporter()
    tracing.init_tracing("areal-rollout", SimpleSpanProcessor(exporter))
    try:
        parents = {}
        requests = []
        for i in range(3):
            with tracing.span(f"coordinator.task.{i}") as span:
                parents[f"t{i}"] = span.get_span_context()
                msg = task_msg(f"t{i}", {"prompt": "abc=", "answer": "a"}, group_size=2)
                msg.task.trace_context.CopyFrom(tracing.to_proto())
                requests.append(msg)
        async with rollout_server() as (stub, _):
            results = [r async for r in stub.RunEpisodes(iter(requests))]
        assert {r.outcome for r in results} == {rollout_pb2.EPISODE_OUTCOME_ACCEPTED}
        episodes = [s for s in exporter.get_finished_spans() if s.name == "rollout.episode"]
        assert len(episodes) == 3
        for span in episodes:
            task_id = span.attributes[tracing.TASK_ID]
            parent = parents[task_id]
            # Three tasks on one stream, three separate traces: each follows its own message.
            assert span.context.trace_id == parent.trace_id
            assert span.parent.span_id == parent.span_id
            assert span.attributes["areal.outcome"] == "EPISODE_OUTCOME_ACCEPTED"
            assert span.attributes[tracing.TOKENS] > 0
        for result in results:
            trace_id = f"{parents[result.task_id].trace_id:032x}"
            for traj in result.group.trajectories:
                assert traj.trace_context.traceparent.split("-")[1] == trace_id
    finally:
        tracing.shutdown_tracing()


async def test_generate_and_generate_stream_spans_join_the_trace_their_request_carries():
    exporter = InMemorySpanExporter()
    tracing.init_tracing("areal-rollout", SimpleSpanProcessor(exporter))
    try:
        with tracing.span("producer.lease") as lease:
            parent = lease.get_span_context()
            carried = tracing.to_proto()
        sampling = common_pb2.SamplingParams(max_new_tokens=4, temperature=1.0)
        async with rollout_server() as (stub, _):
            unary = await stub.Generate(
                rollout_pb2.GenerateRequest(
                    input_ids=[5, 6, 7], sampling=sampling, request_id="g1", trace_context=carried
                )
            )
            streamed = [
                m
                async for m in stub.GenerateStream(
                    rollout_pb2.GenerateStreamRequest(
                        input_ids=[5, 6, 7],
                        sampling=sampling,
                        request_id="s1",
                        trace_context=carried,
                    )
                )
            ]
        spans = {s.name: s for s in exporter.get_finished_spans()}
        for name, task_id, generated in (
            ("rollout.generate", "g1", len(unary.completions[0].output_ids)),
            ("rollout.generate_stream", "s1", sum(len(m.output_ids) for m in streamed)),
        ):
            span = spans[name]
            assert span.context.trace_id == parent.trace_id
            assert span.parent.span_id == parent.span_id
            assert span.attributes[tracing.TASK_ID] == task_id
            assert span.attributes[tracing.TOKENS] == 3 + generated
    finally:
        tracing.shutdown_tracing()
