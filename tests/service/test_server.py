"""Server scaffolding: health, reflection, message limits, graceful stop, retries, kept
channels, entry points' help (their processes serving: tests/e2e/test_server.py)."""

from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest
from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from areal_grpc.errors import FieldError, abort_with, field_violations, invalid_argument
from areal_grpc.launch import python_module_argv
from areal_grpc.server import (
    BackgroundServer,
    ChannelCache,
    ChannelOptions,
    ServerOptions,
    Service,
    aio_channel,
    service,
    start_server,
    sync_channel,
)


class EchoRollout(rollout_pb2_grpc.RolloutServiceServicer):
    """A servicer for scaffolding tests: Generate echoes its input, or rejects bad input."""

    async def Generate(self, request, context):
        if any(t < 0 for t in request.input_ids):
            await abort_with(context, invalid_argument(FieldError("input_ids", "negative id")))
        done = rollout_pb2.Completion(output_ids=list(request.input_ids))
        return rollout_pb2.GenerateResponse(completions=[done])

    async def GetRolloutStatus(self, request, context):
        await asyncio.sleep(0.5)  # long enough to be in flight during a graceful stop
        return rollout_pb2.GetRolloutStatusResponse(model="echo")


def run(coro):
    return asyncio.run(coro)


async def _start(**opts):
    return await start_server([_echo_service()], ServerOptions(**opts))


def test_health_serving_for_each_service_and_overall():
    async def body():
        running = await _start()
        try:
            async with aio_channel(running.address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                for name in ("", "arealgrpc.v1.RolloutService"):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(health_pb2.HealthCheckRequest(service="nope.Service"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await running.stop(0)

    run(body())


def _echo_service():
    return service(
        EchoRollout(), rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2
    )


def test_reflection_lists_services_and_resolves_messages():
    with BackgroundServer([_echo_service()]) as server, sync_channel(server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        names = set(db.get_services())
        assert {"arealgrpc.v1.RolloutService", "grpc.health.v1.Health"} <= names
        file_desc = db.FindFileContainingSymbol("arealgrpc.v1.GenerateRequest")
        assert file_desc.name == "arealgrpc/v1/rollout.proto"


def test_bad_input_gets_invalid_argument_naming_field_and_server_stays_up():
    async def body():
        running = await _start()
        try:
            async with aio_channel(running.address) as ch:
                stub = rollout_pb2_grpc.RolloutServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[1, -2]))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "input_ids" in err.value.details()
                ok = await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[5, 6]))
                assert list(ok.completions[0].output_ids) == [5, 6]
        finally:
            await running.stop(0)

    run(body())


def test_bad_request_details_readable_by_sync_clients():
    with BackgroundServer([_echo_service()]) as server, sync_channel(server.address) as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(rollout_pb2.GenerateRequest(input_ids=[-1]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(err.value) == [("input_ids", "negative id")]


def test_message_size_limit_rejects_oversized_request_and_server_stays_up():
    async def body():
        running = await _start(max_message_bytes=1 << 16)
        try:
            big = ChannelOptions(max_message_bytes=1 << 24)
            async with aio_channel(running.address, big) as ch:
                stub = rollout_pb2_grpc.RolloutServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[7] * 100_000))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                ok = await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[1, 2, 3]))
                assert list(ok.completions[0].output_ids) == [1, 2, 3]
        finally:
            await running.stop(0)

    run(body())


def test_graceful_stop_finishes_in_flight_calls_and_reports_not_serving():
    async def body():
        running = await _start(grace_s=5)
        async with aio_channel(running.address) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            in_flight = asyncio.ensure_future(
                stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
            )
            await asyncio.sleep(0.1)
            stopping = asyncio.ensure_future(running.stop())
            await asyncio.sleep(0.05)
            state = await running.health.Check(health_pb2.HealthCheckRequest(service=""), None)
            assert state.status == health_pb2.HealthCheckResponse.NOT_SERVING
            reply = await in_flight
            assert reply.model == "echo"
            await stopping

    run(body())


@pytest.mark.parametrize(
    "module",
    ["areal_servers.rollout", "areal_servers.trainer", "areal_grpc.coordinator.serve"],
)
def test_entry_points_help(module):
    out = subprocess.run(
        python_module_argv(module, "--help"), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--host" in out.stdout and "--port" in out.stdout


class Flaky(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers UNAVAILABLE to the first ``failures`` calls of each method."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, int] = {}

    async def _maybe_fail(self, name, context):
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")

    async def GetRolloutStatus(self, request, context):
        await self._maybe_fail("status", context)
        return rollout_pb2.GetRolloutStatusResponse(model="flaky")

    async def Generate(self, request, context):
        await self._maybe_fail("generate", context)
        return rollout_pb2.GenerateResponse()


def test_idempotent_calls_are_retried_on_unavailable_others_fail_fast():
    flaky = Flaky(failures=2)
    svc = service(flaky, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2)
    with BackgroundServer([svc]) as server, sync_channel(server.address) as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        reply = stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=30)
        assert reply.model == "flaky"
        assert flaky.calls["status"] == 3
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(rollout_pb2.GenerateRequest(input_ids=[1]), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert flaky.calls["generate"] == 1


async def _echo_stream(requests, context):
    async for request in requests:
        yield request


def _strict_decode(raw: bytes) -> bytes:
    if not raw.startswith(b"ok"):
        raise ValueError("must start with ok")
    return raw


def test_unparsable_request_bytes_are_invalid_argument_for_any_handler():
    """Generated and hand-made handlers alike answer INVALID_ARGUMENT naming the message."""
    custom = grpc.method_handlers_generic_handler(
        "test.Raw",
        {
            "Echo": grpc.stream_stream_rpc_method_handler(
                _echo_stream, request_deserializer=_strict_decode, response_serializer=bytes
            )
        },
    )
    raw = Service("test.Raw", custom, lambda h, server: server.add_generic_rpc_handlers((h,)))
    with BackgroundServer([_echo_service(), raw]) as server, sync_channel(server.address) as ch:
        generate = ch.unary_unary("/arealgrpc.v1.RolloutService/Generate")
        with pytest.raises(grpc.RpcError) as err:
            generate(b"\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid arealgrpc.v1.GenerateRequest" in err.value.details()
        echo = ch.stream_stream("/test.Raw/Echo")
        assert list(echo(iter([b"ok1", b"ok2"]), timeout=10)) == [b"ok1", b"ok2"]
        with pytest.raises(grpc.RpcError) as err:
            list(echo(iter([b"ok1", b"bad"]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must start with ok" in err.value.details()
        # The server goes on serving well-formed calls.
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        ok = stub.Generate(rollout_pb2.GenerateRequest(input_ids=[3]), timeout=10)
        assert list(ok.completions[0].output_ids) == [3]


def test_kept_channels_are_reused_and_one_whose_server_went_away_is_replaced():
    """A server restarted at the same address is reached through a fresh channel at once, not
    through the old one's reconnect backoff; live ones are reused across exchanges."""

    async def body():
        cache = ChannelCache()
        first = await _start()
        try:
            channel = cache.get(first.address)
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
            cache.prune()
            assert cache.get(first.address) is channel  # still serving: kept
            port = first.port
        finally:
            await first.stop(0)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
        second = await _start(port=port)
        try:
            cache.prune()
            fresh = cache.get(second.address)
            assert fresh is not channel
            reply = await rollout_pb2_grpc.RolloutServiceStub(fresh).GetRolloutStatus(
                rollout_pb2.GetRolloutStatusRequest(), timeout=10
            )
            assert reply is not None
        finally:
            await cache.aclose()
            await second.stop(0)

    run(body())
