"""A rollout server whose engine dies, on a real gRPC server on loopback with the hf engine
over the built-in micro model: its decode loop is killed by a forward hook that raises, as a
kernel failure would. No episode is failed for it (the coordinator would count those against
the run's own code): every RunEpisodes stream ends UNAVAILABLE naming the death, later calls
are UNAVAILABLE, and the serving loop stops with health NOT_SERVING."""

from __future__ import annotations

import asyncio

import grpc
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_grpc.server import aio_channel, serve_until_signal
from areal_grpc.tasks import task_dataset
from tests.support.rollout import rollout_server, task_msg

DEATH = "the hf engine died: its decode loop failed"


def kill_decode_loop(servicer) -> None:
    """Makes the engine's next forward raise, which ends its decode loop."""

    def boom(module, args, kwargs):
        raise RuntimeError("simulated kernel failure")

    servicer.engine.model.register_forward_pre_hook(boom, with_kwargs=True)


async def wait_running(stub, episodes: int) -> None:
    while True:
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        if st.running_episodes >= episodes and st.generated_tokens > 0:
            return
        await asyncio.sleep(0.01)


async def until_error(call, most: int):
    """What a stream answered before it failed (up to ``most`` answers), and its error."""
    answered = []
    try:
        async for res in call:
            answered.append(res)
            if len(answered) == most:
                return answered, None
    except grpc.aio.AioRpcError as exc:
        return answered, exc
    return answered, None


async def test_an_engine_that_dies_under_64_episodes_fails_none_and_every_call_is_unavailable():
    items = task_dataset("first3", "train", seed=0)[:64]
    async with rollout_server() as (stub, servicer):
        fatal = asyncio.ensure_future(servicer.fatal())
        sent: asyncio.Queue[rollout_pb2.RunEpisodesRequest | None] = asyncio.Queue()

        async def requests():
            while (req := await sent.get()) is not None:
                yield req

        call = stub.RunEpisodes(requests())
        for i, item in enumerate(items):
            # Long budgets: all 64 are still generating when the engine dies.
            sent.put_nowait(task_msg(f"t{i}", item, group_size=2, max_new_tokens=400))
        await asyncio.wait_for(wait_running(stub, 64), 60)
        kill_decode_loop(servicer)
        answered, error = await asyncio.wait_for(until_error(call, 64), 60)
        # Not one episode was reported failed (or at all): the stream ended first.
        assert [(r.task_id, r.reason) for r in answered] == []
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert DEATH in error.details() and "simulated kernel failure" in error.details()
        assert DEATH in await asyncio.wait_for(fatal, 10)
        assert servicer.runner.running_episodes == 0

        # Every later call says the same, at once: a new stream, a generate, a token stream.
        later = stub.RunEpisodes(iter([task_msg("late", items[0])]))
        try:
            got = [r async for r in later]
            raise AssertionError(f"a stream on a dead engine answered {got}")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and DEATH in exc.details()
        sampling = common_pb2.SamplingParams(max_new_tokens=2)
        for ask in (
            stub.Generate(rollout_pb2.GenerateRequest(input_ids=[5, 6], sampling=sampling)),
            _drain(stub.GenerateStream(rollout_pb2.GenerateStreamRequest(input_ids=[5, 6]))),
        ):
            try:
                await ask
                raise AssertionError("a generate on a dead engine answered")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and DEATH in exc.details()
        sent.put_nowait(None)


async def _drain(call):
    return [r async for r in call]


async def test_the_serving_loop_turns_not_serving_and_stops_when_the_engine_dies():
    """What a rollout server's process does with a dead engine (areal_grpc.cli.serve_main then
    exits with code 3, for its launcher to replace it): health turns NOT_SERVING, the stream
    in flight ends UNAVAILABLE, and serve_until_signal returns the death's reason."""
    from areal_grpc.server import ServerOptions, service, start_server

    item = task_dataset("first3", "train", seed=0)[0]
    async with rollout_server() as (_, servicer):
        # A server of its own over the same servicer: the one serve_until_signal stops.
        running = await start_server(
            [service(servicer, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2)],
            ServerOptions(host="127.0.0.1", port=0),
        )
        channel = aio_channel(running.address)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        states: list[int] = []

        async def watch():
            async for msg in health.Watch(health_pb2.HealthCheckRequest(service="")):
                states.append(msg.status)

        watcher = asyncio.ensure_future(watch())
        serving = asyncio.ensure_future(serve_until_signal(running))
        call = stub.RunEpisodes(iter([task_msg("t0", item, max_new_tokens=400)]))
        await asyncio.wait_for(wait_running(stub, 1), 60)
        kill_decode_loop(servicer)
        reason = await asyncio.wait_for(serving, 30)
        assert reason is not None and DEATH in reason
        try:
            [r async for r in call]
            raise AssertionError("the stream ended OK after the engine died")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and DEATH in exc.details()
        watcher.cancel()
        await channel.close()
        assert states[0] == health_pb2.HealthCheckResponse.SERVING
        assert health_pb2.HealthCheckResponse.NOT_SERVING in states
