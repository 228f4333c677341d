"""Typed asyncio client of ``arealgrpc.v1.RolloutService`` (what the coordinator drives).

A :class:`RolloutClient` wraps one server's channel. Episodes go over one long-lived
``RunEpisodes`` call per server, an :class:`EpisodeStream`: tasks are written as they are
admitted and results are read in completion order. Example::

    client = RolloutClient("127.0.0.1:50061")
    stream = client.episodes()
    stream.submit(rollout_pb2.EpisodeTask(task_id="t0", data=item_struct, group_size=8))
    async for result in stream:
        ...
    await client.close()
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from google.protobuf import struct_pb2

from areal_grpc import tracing
from areal_grpc.server import aio_channel

if TYPE_CHECKING:
    import torch

__all__ = ["EpisodeStream", "RolloutClient", "adapter_requests", "item_struct"]

# Unary calls (status, pause, resume) answer at once; a hung peer must not hang the loop.
DEFAULT_TIMEOUT_S = 30.0

_END = object()


def adapter_requests(
    name: str, tensors: Mapping[str, torch.Tensor], rank: int, alpha: float
) -> Iterator[rollout_pb2.LoadAdapterRequest]:
    """A ``LoadAdapter`` stream: the header, then ``tensors`` as chunks (1 MiB each)."""
    # Imported here: the chunker imports torch, which this client's other users never need.
    from areal_grpc.named_adapters import adapter_requests as requests

    return requests(name, tensors, rank, alpha)


def item_struct(item: Mapping[str, Any]) -> struct_pb2.Struct:
    """A dataset item (a JSON-like dict) as a ``google.protobuf.Struct``."""
    struct = struct_pb2.Struct()
    struct.update(dict(item))
    return struct


class EpisodeStream:
    """One ``RunEpisodes`` call: write tasks and cancellations, read results as they finish.

    Iterating yields every result until the server ends the stream; it ends after
    :meth:`close` once the tasks already sent have reported. Errors of the call (the server
    went away) surface as :class:`grpc.aio.AioRpcError` from the iteration.
    """

    def __init__(self, stub: rollout_pb2_grpc.RolloutServiceStub) -> None:
        self._outbox: asyncio.Queue[object] = asyncio.Queue()
        self._closed = False
        self._call = stub.RunEpisodes(self._requests())

    async def _requests(self) -> AsyncIterator[rollout_pb2.RunEpisodesRequest]:
        while True:
            msg = await self._outbox.get()
            if msg is _END:
                return
            assert isinstance(msg, rollout_pb2.RunEpisodesRequest)
            yield msg

    def submit(self, task: rollout_pb2.EpisodeTask) -> None:
        """Queues a task for the server (non-blocking)."""
        if self._closed:
            raise RuntimeError("the episode stream is closed")
        self._outbox.put_nowait(rollout_pb2.RunEpisodesRequest(task=task))

    def cancel(self, task_id: str) -> None:
        """Asks the server to cancel a task sent earlier (it reports EPISODE_OUTCOME_CANCELLED)."""
        if not self._closed:
            self._outbox.put_nowait(
                rollout_pb2.RunEpisodesRequest(cancel=rollout_pb2.CancelEpisode(task_id=task_id))
            )

    def close(self) -> None:
        """Ends the request side; the server reports the tasks already sent, then ends."""
        if not self._closed:
            self._closed = True
            self._outbox.put_nowait(_END)

    def abort(self) -> None:
        """Cancels the call at once (the server cancels every task of the stream)."""
        self.close()  # ends _requests(): see _iterate
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[rollout_pb2.RunEpisodesResponse]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[rollout_pb2.RunEpisodesResponse]:
        try:
            async for response in self._call:
                yield response
        finally:
            # The call is over, however it ended. grpc's task feeding it from _requests() is
            # not cancelled then (grpc/grpc#29518): left waiting on the outbox it is destroyed
            # pending, and asyncio logs "Task was destroyed but it is pending" / "aclose():
            # asynchronous generator is already running". Ending the generator lets it finish.
            self.close()


class RolloutClient:
    """Client of one rollout server."""

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        self.address = address
        self._channel = channel or aio_channel(address)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)

    async def status(
        self, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> rollout_pb2.GetRolloutStatusResponse:
        """Version, load, engine, model and vocabulary size of the server."""
        return await self.stub.GetRolloutStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=timeout_s
        )

    async def pause(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, *, return_immediately: bool = False
    ) -> rollout_pb2.PauseGenerationResponse:
        """Interrupts generation at the next token boundary (``return_immediately``: see
        ``PauseGenerationRequest``)."""
        return await self.stub.PauseGeneration(
            rollout_pb2.PauseGenerationRequest(return_immediately=return_immediately),
            timeout=timeout_s,
        )

    async def resume(
        self, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> rollout_pb2.ResumeGenerationResponse:
        """Resumes generation after :meth:`pause`."""
        return await self.stub.ResumeGeneration(
            rollout_pb2.ResumeGenerationRequest(), timeout=timeout_s
        )

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: common_pb2.SamplingParams | None = None,
        timeout_s: float | None = None,
        *,
        trace_context: common_pb2.TraceContext | None = None,
        request_id: str = "",
        adapter: str = "",
    ) -> rollout_pb2.GenerateResponse:
        """Token-in / token-out generation of ``sampling.n_samples`` completions.

        The request carries ``trace_context`` (default: the lease this asyncio task took last
        with ``CoordinatorClient.acquire``, else the current span), so the server's generate
        span joins the producer's trace; ``request_id`` (default: that lease's id) labels it;
        ``adapter``: the named adapter (:meth:`load_adapter`) that generates, "" the run's own.
        """
        return await self.stub.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=list(input_ids),
                sampling=sampling or common_pb2.SamplingParams(),
                request_id=request_id or tracing.carried_task_id(),
                trace_context=tracing.outgoing(trace_context),
                adapter=adapter,
            ),
            timeout=timeout_s,
        )

    def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling: common_pb2.SamplingParams | None = None,
        timeout_s: float | None = None,
        *,
        trace_context: common_pb2.TraceContext | None = None,
        request_id: str = "",
        adapter: str = "",
    ) -> AsyncIterator[rollout_pb2.GenerateStreamResponse]:
        """One completion as it decodes (``GenerateStream``; cancel the iteration to stop it)."""
        return self.stub.GenerateStream(
            rollout_pb2.GenerateStreamRequest(
                input_ids=list(input_ids),
                sampling=sampling or common_pb2.SamplingParams(),
                request_id=request_id or tracing.carried_task_id(),
                trace_context=tracing.outgoing(trace_context),
                adapter=adapter,
            ),
            timeout=timeout_s,
        )

    async def load_adapter(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        rank: int,
        alpha: float,
        timeout_s: float | None = None,
    ) -> rollout_pb2.LoadAdapterResponse:
        """Has the server hold a LoRA adapter as ``name`` (``LoadAdapter``): ``tensors`` by
        peft's saved names ("<module>.lora_A.weight", ...), streamed in chunks."""
        return await self.stub.LoadAdapter(
            adapter_requests(name, tensors, rank, alpha), timeout=timeout_s
        )

    async def remove_adapter(
        self, name: str, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> rollout_pb2.RemoveAdapterResponse:
        """Has the server stop serving the named adapter ``name``."""
        return await self.stub.RemoveAdapter(
            rollout_pb2.RemoveAdapterRequest(name=name), timeout=timeout_s
        )

    def episodes(self) -> EpisodeStream:
        """Opens a ``RunEpisodes`` stream."""
        return EpisodeStream(self.stub)

    async def close(self) -> None:
        """Closes the channel (cancelling calls still open on it)."""
        await self._channel.close()
