"""``RolloutService``: episodes for the coordinator, token-in/token-out for external agents.

Bad input is answered with INVALID_ARGUMENT naming the field (``google.rpc.BadRequest``). On
the multiplexed ``RunEpisodes`` stream a bad task must not take its neighbours down, so it is
answered by its own result, outcome ``EPISODE_OUTCOME_FAILED`` with a reason that starts
``"INVALID_ARGUMENT: <field>: ..."``, and the stream goes on. A cancelled call, a cancelled
task or an expired deadline cancels its generations, which frees their engine slots at once.

An engine that dies (:class:`~areal_servers.rollout.engine.EngineDied`) fails no episode:
FAILED is for what the episode's own code did. Every ``RunEpisodes`` stream ends UNAVAILABLE
naming the death, so the coordinator runs its tasks elsewhere, every later call is UNAVAILABLE
too, and :meth:`RolloutServicer.fatal` tells the server's process to stop and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import torch
from areal_servers.rollout.engine import (
    AdapterBound,
    EngineDied,
    InferenceEngine,
    SamplingConfig,
    top_logprobs_proto,
)
from areal_servers.rollout.workflows import (
    AcceptFn,
    EpisodeContext,
    Workflow,
    build_workflow,
    get_accept_filter,
    maybe_await,
)
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from google.protobuf import json_format, struct_pb2
from transformers import PreTrainedTokenizerBase

from areal_grpc import tracing
from areal_grpc.chunks import StateDictAssembler
from areal_grpc.durations import duration
from areal_grpc.errors import ExhaustedError, FieldError, NotFoundError, abort_for
from areal_grpc.server import drain_requests
from areal_grpc.tensor_codec import (
    DEFAULT_MAX_BYTES,
    checked_nbytes,
    dtype_from_proto,
    tensor_label,
)
from areal_grpc.trajectory import validate_group

log = logging.getLogger(__name__)

# A refused LoadAdapter stream is read on for at most this many messages (drain_requests).
DRAIN_MESSAGES = 1024

# Engine kinds the contract names (others, a test's or a plug-in's, report UNSPECIFIED).
ENGINE_KINDS = {"hf": rollout_pb2.ROLLOUT_ENGINE_HF, "sglang": rollout_pb2.ROLLOUT_ENGINE_SGLANG}


@dataclass
class RolloutServiceConfig:
    """Server-side defaults of episode tasks and generation requests."""

    # Workflow of a task whose ``workflow`` is empty.
    default_workflow: str = "rlvr"
    # Parameters every task starts from; a task's workflow_params override them. The key
    # "accept" names the accept filter ("all", "nonuniform" or an import path).
    default_workflow_params: dict[str, Any] = field(default_factory=dict)
    # max_new_tokens when a request leaves it 0.
    default_max_new_tokens: int = 16
    # Largest group_size / n_samples accepted (bounds the work one message can ask for).
    max_samples: int = 1024


@dataclass
class PreparedTask:
    """A validated episode task, ready to run."""

    task: rollout_pb2.EpisodeTask
    workflow: Workflow
    accept: AcceptFn
    accept_name: str
    item: dict[str, Any]
    sampling: SamplingConfig
    group_size: int


def _failed(
    task_id: str, exc: BaseException, start_version: int = 0
) -> rollout_pb2.RunEpisodesResponse:
    if isinstance(exc, FieldError):
        reason = f"INVALID_ARGUMENT: {exc}"
    elif isinstance(exc, NotFoundError):
        reason = f"NOT_FOUND: {exc}"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    return rollout_pb2.RunEpisodesResponse(
        task_id=task_id,
        outcome=rollout_pb2.EPISODE_OUTCOME_FAILED,
        reason=reason,
        start_version=start_version,
    )


class EpisodeRunner:
    """Validates and runs ``EpisodeTask`` messages on an engine (no gRPC needed)."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutServiceConfig | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or RolloutServiceConfig()
        self.running_episodes = 0

    def prepare(self, task: rollout_pb2.EpisodeTask) -> PreparedTask:
        """Checks a task and builds its workflow; FieldError (named ``task.*``) when bad."""
        if not task.task_id:
            raise FieldError("task.task_id", "must not be empty")
        if task.group_size < 0 or task.group_size > self.config.max_samples:
            raise FieldError(
                "task.group_size",
                f"must be in [1, {self.config.max_samples}], got {task.group_size}",
            )
        sampling = SamplingConfig.from_proto(
            task.sampling,
            default_max_new_tokens=self.config.default_max_new_tokens,
            where="task.sampling",
        )
        self.engine.check_adapter(task.adapter, "task.adapter")
        params: dict[str, Any] = dict(self.config.default_workflow_params)
        params.update(json_format.MessageToDict(task.workflow_params))
        accept_name = str(params.pop("accept", "all"))
        accept = get_accept_filter(accept_name)
        workflow = build_workflow(task.workflow or self.config.default_workflow, params)
        item = json_format.MessageToDict(task.data)
        return PreparedTask(
            task=task,
            workflow=workflow,
            accept=accept,
            accept_name=accept_name,
            item=item,
            sampling=sampling,
            group_size=task.group_size or 1,
        )

    async def run(self, prepared: PreparedTask) -> rollout_pb2.RunEpisodesResponse:
        """Runs a prepared task; never raises (failures and cancellation become outcomes)."""
        task = prepared.task
        # One span per task, parented by the context the task carries: the RunEpisodes stream
        # is one RPC for many tasks, so the call's own span cannot stand for each of them.
        with tracing.span(
            "rollout.episode",
            parent=task.trace_context,
            attributes={tracing.TASK_ID: task.task_id, tracing.POLICY_VERSION: self.engine.version},
        ) as span:
            response = await self._run(prepared)
            span.set_attribute("areal.outcome", rollout_pb2.EpisodeOutcome.Name(response.outcome))
            span.set_attribute(
                tracing.TOKENS, sum(len(t.token_ids) for t in response.group.trajectories)
            )
        return response

    async def _run(self, prepared: PreparedTask) -> rollout_pb2.RunEpisodesResponse:
        task = prepared.task
        start_version = self.engine.version
        started = time.monotonic()
        self.running_episodes += 1
        try:
            ctx = EpisodeContext(
                # A task naming an adapter generates every sample with it.
                engine=cast(InferenceEngine, AdapterBound(self.engine, task.adapter))
                if task.adapter
                else self.engine,
                tokenizer=self.tokenizer,
                task_id=task.task_id,
                group_size=prepared.group_size,
                sampling=prepared.sampling,
                is_eval=task.eval,
                # Trajectories carry the episode span's context when traced, so the trainer's
                # spans for them join the same trace.
                trace_context=tracing.to_proto() if tracing.enabled() else task.trace_context,
            )
            group = await prepared.workflow.run_episode(ctx, prepared.item)
            response = rollout_pb2.RunEpisodesResponse(
                task_id=task.task_id, start_version=start_version
            )
            if group is not None:
                # Custom workflows are checked too: a malformed group never reaches a trainer.
                validate_group(group, "group", self.engine.vocab_size)
            if group is None:
                response.outcome = rollout_pb2.EPISODE_OUTCOME_REJECTED
                response.reason = "the workflow returned no group"
            elif not task.eval and not await maybe_await(prepared.accept(group)):
                response.outcome = rollout_pb2.EPISODE_OUTCOME_REJECTED
                response.reason = f"accept filter {prepared.accept_name!r} dropped the group"
            else:
                response.outcome = rollout_pb2.EPISODE_OUTCOME_ACCEPTED
                response.group.CopyFrom(group)
        except EngineDied:
            raise
        except asyncio.CancelledError:
            # Our own cancellation (CancelEpisode or the stream ending): report, don't raise.
            response = rollout_pb2.RunEpisodesResponse(
                task_id=task.task_id,
                outcome=rollout_pb2.EPISODE_OUTCOME_CANCELLED,
                reason="cancelled",
                start_version=start_version,
            )
        except Exception as exc:  # a workflow bug must not end the stream
            if self.engine.failure is not None:
                # Whatever the workflow made of it, the engine under it died: not its fault.
                raise EngineDied(self.engine.kind, self.engine.failure) from exc
            log.warning("episode %s failed: %s", task.task_id, exc, exc_info=True)
            response = _failed(task.task_id, exc, start_version)
        finally:
            self.running_episodes -= 1
        response.elapsed.CopyFrom(duration(time.monotonic() - started))
        return response


_INPUT_DONE = object()


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """The gRPC handlers of ``arealgrpc.v1.RolloutService`` over one engine."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutServiceConfig | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or RolloutServiceConfig()
        self.runner = EpisodeRunner(engine, tokenizer, self.config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._died: asyncio.Event | None = None
        # The result queues of the open RunEpisodes streams, ended at once if the engine dies.
        self._streams: set[asyncio.Queue[Any]] = set()
        engine.on_death(self._engine_died)

    def _engine_died(self, reason: str) -> None:
        """The engine's death listener (it may call from any thread): ends every stream and
        wakes :meth:`fatal`."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def on_loop() -> None:
            error = EngineDied(self.engine.kind, reason)
            for results in self._streams:
                results.put_nowait(error)
            if self._died is not None:
                self._died.set()

        # RuntimeError: the loop closed meanwhile, and nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(on_loop)

    def _attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._died = asyncio.Event()

    async def fatal(self) -> str:
        """Returns (why) once this server can serve no more: its engine died."""
        self._attach()
        assert self._died is not None
        if self.engine.failure is None:
            await self._died.wait()
        assert self.engine.failure is not None
        return str(EngineDied(self.engine.kind, self.engine.failure))

    async def aclose(self) -> None:
        """Closes the engine once the server has stopped (``areal-rollout`` calls it): an
        engine with processes of its own (vllm) stops them rather than leaving them."""
        await self.engine.close()

    # --------------------------------------------------------------------------- episodes

    async def RunEpisodes(
        self,
        request_iterator: AsyncIterator[rollout_pb2.RunEpisodesRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rollout_pb2.RunEpisodesResponse]:
        """Runs streamed tasks concurrently; yields each result as its task finishes."""
        self._attach()
        results: asyncio.Queue[Any] = asyncio.Queue()
        active: dict[str, asyncio.Task[rollout_pb2.RunEpisodesResponse]] = {}

        def finished(task_id: str, fut: asyncio.Task[rollout_pb2.RunEpisodesResponse]) -> None:
            active.pop(task_id, None)
            if fut.cancelled():
                response = rollout_pb2.RunEpisodesResponse(
                    task_id=task_id,
                    outcome=rollout_pb2.EPISODE_OUTCOME_CANCELLED,
                    reason="cancelled before it started",
                )
            elif isinstance(fut.exception(), EngineDied):
                results.put_nowait(fut.exception())
                return
            else:
                response = fut.result()
            results.put_nowait(response)

        def start(req: rollout_pb2.EpisodeTask) -> None:
            if self.engine.failure is not None:
                results.put_nowait(EngineDied(self.engine.kind, self.engine.failure))
                return
            try:
                if req.task_id in active:
                    raise FieldError("task.task_id", f"{req.task_id!r} is already running")
                prepared = self.runner.prepare(req)
            except Exception as exc:
                results.put_nowait(_failed(req.task_id, exc, self.engine.version))
                return
            job = asyncio.create_task(self.runner.run(prepared))
            active[req.task_id] = job
            job.add_done_callback(lambda fut, tid=req.task_id: finished(tid, fut))

        async def read() -> None:
            try:
                async for req in request_iterator:
                    kind = req.WhichOneof("kind")
                    if kind == "task":
                        start(req.task)
                    elif kind == "cancel":
                        job = active.get(req.cancel.task_id)
                        # Unknown ids are ignored: the task may have finished already.
                        if job is not None:
                            job.cancel()
                    else:
                        results.put_nowait(
                            _failed("", FieldError("kind", "set either task or cancel"))
                        )
            except Exception as exc:
                results.put_nowait(exc)
                return
            results.put_nowait(_INPUT_DONE)

        reader = asyncio.create_task(read())
        self._streams.add(results)
        input_done = False
        try:
            if self.engine.failure is not None:
                results.put_nowait(EngineDied(self.engine.kind, self.engine.failure))
            while not (input_done and not active and results.empty()):
                item = await results.get()
                if item is _INPUT_DONE:
                    input_done = True
                elif isinstance(item, EngineDied):
                    # UNAVAILABLE: the coordinator runs this stream's tasks elsewhere.
                    await abort_for(context, item)
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self._streams.discard(results)
            reader.cancel()
            for job in list(active.values()):
                job.cancel()

    # ------------------------------------------------------------------------- generation

    def _sampling(self, msg: common_pb2.SamplingParams) -> SamplingConfig:
        cfg = SamplingConfig.from_proto(
            msg, default_max_new_tokens=self.config.default_max_new_tokens
        )
        if cfg.n_samples > self.config.max_samples:
            raise FieldError(
                "sampling.n_samples", f"must be <= {self.config.max_samples}, got {cfg.n_samples}"
            )
        return cfg

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        """All ``n_samples`` completions of one prompt, decoded concurrently."""
        try:
            cfg = self._sampling(request.sampling)
            self.engine.check_prompt(request.input_ids, cfg)
            self.engine.check_adapter(request.adapter)
            log.debug(
                "generate %s traceparent=%s", request.request_id, request.trace_context.traceparent
            )
            # Parented by the message's context (an external producer's lease), so this
            # generation joins the lease's trace even when the call itself carries no metadata.
            with tracing.span(
                "rollout.generate",
                parent=request.trace_context,
                attributes={
                    tracing.TASK_ID: request.request_id,
                    tracing.POLICY_VERSION: self.engine.version,
                    "areal.samples": cfg.n_samples,
                },
            ) as span:
                results = await self.engine.generate_n(
                    list(request.input_ids), cfg, request.adapter
                )
                span.set_attribute(
                    tracing.TOKENS, len(request.input_ids) + sum(len(r.output_ids) for r in results)
                )
        except Exception as exc:
            await abort_for(context, exc)
        return rollout_pb2.GenerateResponse(
            completions=[r.to_proto() for r in results], policy_version=self.engine.version
        )

    async def GenerateStream(
        self, request: rollout_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateStreamResponse]:
        """One completion, one message per decoded token, the finish reason last."""
        try:
            cfg = self._sampling(request.sampling)
            if cfg.n_samples != 1:
                raise FieldError("sampling.n_samples", f"must be 0 or 1, got {cfg.n_samples}")
            self.engine.check_prompt(request.input_ids, cfg)
            self.engine.check_adapter(request.adapter)
        except Exception as exc:
            await abort_for(context, exc)
            return
        stream = self.engine.stream(list(request.input_ids), cfg, request.adapter)
        # Parented like Generate's span; it covers the whole stream (the handler is one task,
        # so the span's context stays attached across the yields).
        with tracing.span(
            "rollout.generate_stream",
            parent=request.trace_context,
            attributes={
                tracing.TASK_ID: request.request_id,
                tracing.POLICY_VERSION: self.engine.version,
            },
        ) as span:
            generated = 0
            try:
                async for event in stream:
                    generated += len(event.token_ids)
                    yield rollout_pb2.GenerateStreamResponse(
                        output_ids=event.token_ids,
                        output_logprobs=event.logprobs,
                        output_versions=event.versions,
                        finish_reason=int(event.finish or 0),  # type: ignore[arg-type]
                        output_top_logprobs=top_logprobs_proto(event.top),
                    )
            except EngineDied as exc:
                await abort_for(context, exc)
            finally:
                span.set_attribute(tracing.TOKENS, len(request.input_ids) + generated)
                # Runs when the client cancels too, so the request's slot is freed at once.
                await stream.aclose()

    # ---------------------------------------------------------------------- pause, status

    async def PauseGeneration(
        self, request: rollout_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseGenerationResponse:
        """Interrupts running generations at the next token boundary."""
        interrupted = await self.engine.pause(wait=not request.return_immediately)
        return rollout_pb2.PauseGenerationResponse(
            interrupted_requests=interrupted, policy_version=self.engine.version
        )

    async def ResumeGeneration(
        self, request: rollout_pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeGenerationResponse:
        """Resumes generation; interrupted episodes continue from their partial output."""
        await self.engine.resume()
        return rollout_pb2.ResumeGenerationResponse(policy_version=self.engine.version)

    async def GetRolloutStatus(
        self, request: rollout_pb2.GetRolloutStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetRolloutStatusResponse:
        """Version, load, engine and model."""
        st = self.engine.status()
        return rollout_pb2.GetRolloutStatusResponse(
            policy_version=st.version,
            running_requests=st.running,
            queued_requests=st.queued,
            running_episodes=self.runner.running_episodes,
            paused=st.paused,
            engine=ENGINE_KINDS.get(self.engine.kind, rollout_pb2.ROLLOUT_ENGINE_UNSPECIFIED),
            model=self.engine.model_name,
            vocab_size=self.engine.vocab_size,
            generated_tokens=st.generated_tokens,
            adapters=self.engine.adapters(),
        )

    # --------------------------------------------------------------------- named adapters

    async def LoadAdapter(
        self,
        request_iterator: AsyncIterator[rollout_pb2.LoadAdapterRequest],
        context: grpc.aio.ServicerContext,
    ) -> rollout_pb2.LoadAdapterResponse:
        """Reads the header and the adapter's tensors, then has the engine hold them."""
        try:
            header, tensors = await _read_adapter(request_iterator, self.engine.max_adapter_bytes)
            loaded = await self.engine.load_adapter(header.name, tensors, header.rank, header.alpha)
        except Exception as exc:
            await drain_requests(request_iterator, DRAIN_MESSAGES)
            await abort_for(context, exc)
        return rollout_pb2.LoadAdapterResponse(
            name=loaded.name,
            adapter_bytes=loaded.nbytes,
            adapted_layers=loaded.adapted_layers,
            replaced=loaded.replaced,
        )

    async def RemoveAdapter(
        self, request: rollout_pb2.RemoveAdapterRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RemoveAdapterResponse:
        """Stops serving a named adapter."""
        try:
            held = await self.engine.remove_adapter(request.name)
        except Exception as exc:
            await abort_for(context, exc)
        return rollout_pb2.RemoveAdapterResponse(adapter_bytes=held)


async def _read_adapter(
    requests: AsyncIterator[rollout_pb2.LoadAdapterRequest], max_bytes: int
) -> tuple[rollout_pb2.AdapterHeader, dict[str, torch.Tensor]]:
    """The header and the tensors of a LoadAdapter stream, every message checked on arrival:
    FieldError naming the field, ExhaustedError once the tensors outgrow ``max_bytes`` (the
    engine's whole adapter budget), NotImplementedError for an engine without adapters."""
    first = await anext(aiter(requests), None)
    if first is None or first.WhichOneof("kind") != "header":
        raise FieldError("header", "the stream must start with the adapter's header")
    header = first.header
    if max_bytes <= 0:
        raise NotImplementedError("this rollout server's engine serves no named adapters")
    if header.tensor_count < 1:
        raise FieldError("header.tensor_count", "must be >= 1")
    asm = StateDictAssembler(expected_tensors=header.tensor_count, max_total_bytes=max_bytes)
    async for msg in requests:
        if msg.WhichOneof("kind") != "chunk":
            raise FieldError("header", "only the stream's first message may be a header")
        chunk = msg.chunk
        if chunk.chunk_index == 0:
            # Refused before anything is allocated: more than the budget is the cap's answer,
            # not a malformed tensor's.
            dtype = dtype_from_proto(chunk.dtype, f"{tensor_label(chunk.name)}.dtype")
            nbytes = checked_nbytes(
                list(chunk.shape), dtype, f"{tensor_label(chunk.name)}.shape", DEFAULT_MAX_BYTES
            )
            if asm.total_bytes + nbytes > max_bytes:
                raise ExhaustedError(
                    f"adapter {header.name!r} outgrows the server's {max_bytes} bytes for named "
                    "adapters (rollout.max_adapter_mib)"
                )
        asm.add(chunk)
    return header, asm.finish()


def item_to_struct(item: Mapping[str, Any]) -> struct_pb2.Struct:
    """A dataset item as a ``google.protobuf.Struct`` (for building EpisodeTask.data)."""
    struct = struct_pb2.Struct()
    struct.update(dict(item))
    return struct


__all__ = [
    "EpisodeRunner",
    "PreparedTask",
    "RolloutServiceConfig",
    "RolloutServicer",
    "item_to_struct",
]
