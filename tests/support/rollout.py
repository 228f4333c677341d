"""RolloutService over the built-in micro model on a real gRPC server on loopback, in this
process, and the RunEpisodes tasks the rollout tests send it."""

from __future__ import annotations

import contextlib

from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.service import RolloutServiceConfig, RolloutServicer, item_to_struct
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.model import load_tokenizer
from areal_grpc.server import ServerOptions, aio_channel, service, start_server

TOK = load_tokenizer("builtin:micro")


TOK = load_tokenizer("builtin:micro")


@contextlib.asynccontextmanager
async def rollout_server(max_running_requests=256, lora=None, **rollout):
    """Serves an hf engine for the block: yields (RolloutService stub, servicer); ``lora``: the
    run's LoraSettings; ``rollout``: further settings of the ``rollout`` section (e.g.
    max_adapters; dtype float32 unless given: these tests compare with fp32 references)."""
    engine = HFEngine(
        ModelConfig(source="builtin:micro", seed=0, **({"lora": lora} if lora else {})),
        RolloutConfig(max_running_requests=max_running_requests, **{"dtype": "float32", **rollout}),
    )
    servicer = RolloutServicer(engine, TOK, RolloutServiceConfig(default_max_new_tokens=4))
    running = await start_server(
        [service(servicer, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2)],
        ServerOptions(host="127.0.0.1", port=0),
    )
    channel = aio_channel(running.address)
    try:
        yield rollout_pb2_grpc.RolloutServiceStub(channel), servicer
    finally:
        await channel.close()
        await running.stop(0)
        await engine.close()


def task_msg(task_id, item, group_size=4, max_new_tokens=2, workflow="", **kw):
    """A RunEpisodes request of one task (``max_new_tokens`` each, EOS ignored, a fixed trace
    context)."""
    return rollout_pb2.RunEpisodesRequest(
        task=rollout_pb2.EpisodeTask(
            task_id=task_id,
            data=item_to_struct(item),
            group_size=group_size,
            workflow=workflow,
            sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
            trace_context=common_pb2.TraceContext(traceparent=f"00-{'1' * 32}-{'2' * 16}-01"),
            **kw,
        )
    )
