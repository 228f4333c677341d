"""TrainerService: one trainer rank behind gRPC (grpc.aio).

All torch work (process-group set-up, steps, checkpoints, export) runs on one dedicated worker
thread, so the event loop keeps answering (status, health) while a step runs, and the
collectives of successive calls run in the order the calls arrived.

Lock-step rule: the coordinator makes the same sequence of collective calls (TrainStep,
SaveCheckpoint, LoadCheckpoint, ExportModel) on every rank. Every TrainStep call joins one
agreement collective *before* any training collective, whatever happened while reading its
stream: a rank that got bad input answers INVALID_ARGUMENT naming the field, the other ranks
answer ABORTED, no rank trains, and all of them are ready for the next step. A step whose
global batch has no trajectories is INVALID_ARGUMENT on every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import torch
import torch.distributed as dist
from areal_servers.trainer.engine import (
    DistConfig,
    StepResult,
    TrainerEngine,
    init_distributed,
    resolve_device,
)
from areal_servers.trainer.publish.base import PublisherConfig
from areal_servers.trainer.weight_publisher import (
    METHODS,
    PublishSession,
    WeightPublisher,
    run_publication,
)
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc, weight_sync_pb2
from opentelemetry import trace

from areal_grpc.batch import groups_to_batch
from areal_grpc.config import ModelConfig, TrainerConfig
from areal_grpc.durations import duration, seconds
from areal_grpc.errors import (
    AbortedError,
    FieldError,
    PreconditionError,
    UnavailableError,
    abort_for,
    abort_with,
    status,
    status_proto,
)
from areal_grpc.paths import check_replaceable, open_roots, resolve_inside

log = logging.getLogger(__name__)

BACKENDS = {
    "gloo": weight_sync_pb2.COLLECTIVE_BACKEND_GLOO,
    "nccl": weight_sync_pb2.COLLECTIVE_BACKEND_NCCL,
}
PHASES = {
    "received": trainer_pb2.STEP_PHASE_RECEIVED,
    "logprobs": trainer_pb2.STEP_PHASE_LOGPROBS,
    "update": trainer_pb2.STEP_PHASE_UPDATE,
}

T = TypeVar("T")

# Local verdicts exchanged by the agreement collective.
OK, BAD_INPUT, CONFLICT = 0, 1, 2


class StepAborted(AbortedError):
    """Another rank rejected its part of the step; nothing was trained."""


class GroupBroken(UnavailableError):
    """An earlier collective failed unexpectedly: this rank's process group is unusable."""


@dataclass
class TrainerServiceConfig:
    """A rank: the run's ``trainer`` and ``model`` sections, and what is this process's own."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    # Per process: this rank's device (None: trainer.device), the run's step count (the
    # learning-rate schedule decays to it) and the sampling temperature (see TrainerEngine).
    device: str | None = None
    total_steps: int | None = None
    temperature: float = 1.0
    dist: DistConfig = field(default_factory=DistConfig)
    # Join a process group (False: a single plain process, for tools and tests).
    distributed: bool = True
    # Checkpoint and export paths must lie inside one of these (none: the default root under
    # the working directory, see areal_grpc.paths); the first is where relative paths point.
    path_roots: tuple[str, ...] = ()
    # How PublishWeights sends weights (disk root, bucket size, group address).
    weights: PublisherConfig = field(default_factory=PublisherConfig)


@dataclass
class _Shard:
    """What one TrainStep stream delivered, or why it was refused."""

    begin: trainer_pb2.StepBegin | None = None
    groups: list[common_pb2.TrajectoryGroup] = field(default_factory=list)
    error: Exception | None = None


def _stats_proto(r: StepResult) -> trainer_pb2.StepStats:
    return trainer_pb2.StepStats(
        global_step=r.global_step,
        policy_version=r.policy_version,
        loss=r.loss,
        grad_norm=r.grad_norm,
        clip_fraction=r.clip_fraction,
        entropy=r.entropy,
        importance_weight_mean=r.importance_weight_mean,
        importance_weight_max=r.importance_weight_max,
        reward_mean=r.reward_mean,
        trained_tokens=r.trained_tokens,
        sequences=r.sequences,
        learning_rate=r.learning_rate,
        elapsed=duration(r.elapsed_seconds),
        extra={**r.extra, "microbatches": float(r.microbatches)},
    )


def _check_publish(request: trainer_pb2.PublishWeightsRequest) -> tuple[list[str], list[int]]:
    """(addresses, methods) of a PublishWeights request; FieldError naming the bad field."""
    addresses = list(request.rollout_addresses)
    seen: set[str] = set()
    for i, address in enumerate(addresses):
        if not address or address.startswith(":") or ":" not in address:
            raise FieldError(f"rollout_addresses[{i}]", f"{address!r} is not host:port")
        if address in seen:
            raise FieldError(f"rollout_addresses[{i}]", f"{address!r} is listed twice")
        seen.add(address)
    # Empty: the publisher's order for the rank's device (weight_publisher.default_methods).
    methods = list(request.methods)
    for i, m in enumerate(methods):
        if m not in METHODS:
            raise FieldError(f"methods[{i}]", f"unknown or unspecified method {m}")
    if len(set(methods)) != len(methods):
        raise FieldError("methods", "lists a method twice")
    if request.bucket_bytes < 0:
        raise FieldError("bucket_bytes", f"is negative ({request.bucket_bytes})")
    if seconds(request.timeout) < 0:
        raise FieldError("timeout", f"is negative ({seconds(request.timeout)} s)")
    return addresses, methods


class TrainerService(trainer_pb2_grpc.TrainerServiceServicer):
    """TrainerService for one rank; the engine is built on the worker thread at start."""

    def __init__(self, cfg: TrainerServiceConfig) -> None:
        self.cfg = cfg
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-torch")
        # Resolved here, so a rank without a GPU of its own fails at start with a clear error.
        wanted = cfg.device or (None if cfg.trainer.device == "auto" else cfg.trainer.device)
        self.device = resolve_device(wanted, cfg.dist.rank or 0)
        self._busy = False
        self.engine: TrainerEngine | None = None
        # Building starts now so a launcher can start every rank before any is ready (the
        # process group's rendezvous waits for all of them).
        self._ready: Future[TrainerEngine] = self._executor.submit(self._build)
        # Rank 0's sender; it keeps the distributed weight group between publications.
        self.publisher = WeightPublisher(cfg.weights, device=self.device)
        self._model_config_json: str | None = None
        self.roots = open_roots(cfg.path_roots, "trainer")
        # Why the process group broke (None while it works). A collective that failed
        # unexpectedly (a peer died, a timeout) leaves the ranks at different points of the
        # collective sequence, so this rank refuses further collective calls at once instead
        # of pairing them with the wrong collectives or waiting out a timeout: the trainer
        # group must be restarted (the coordinator does that, or torchrun under attach mode).
        self.broken: str | None = None

    def _build(self) -> TrainerEngine:
        if self.cfg.distributed:
            init_distributed(self.cfg.dist, self.device)
        self.engine = TrainerEngine(
            self.cfg.trainer,
            self.cfg.model,
            device=str(self.device),
            total_steps=self.cfg.total_steps,
            temperature=self.cfg.temperature,
        )
        log.info(
            "trainer rank %d/%d ready (%s, %s)",
            self.engine.rank,
            self.engine.world_size,
            self.engine.backend,
            self.cfg.model.source,
        )
        return self.engine

    def wait_ready(self, timeout: float | None = None) -> TrainerEngine:
        """Blocks until the engine is built (raises what building raised)."""
        return self._ready.result(timeout)

    def close(self) -> None:
        """Stops the worker thread after the work already queued."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.publisher.close()

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """After the server drained: lets the running job finish (bounded), then closes.

        A TrainStep whose caller went away still runs its collectives with the other ranks;
        exiting under it would leave gloo's threads mid-operation (std::terminate at exit).
        """
        self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            await asyncio.wait_for(asyncio.to_thread(self._executor.shutdown, wait=True), timeout_s)
        except TimeoutError:
            log.warning("a collective call is still running after %.0fs; exiting anyway", timeout_s)
        await self.publisher.aclose()

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn`` on the torch worker thread once the engine is ready."""
        await asyncio.wrap_future(self._ready)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._collective, fn, *args)

    def _collective(self, fn: Callable[..., T], *args: object) -> T:
        """Worker-thread wrapper of every collective call: refuses them once the group broke."""
        if self.broken is not None:
            raise GroupBroken(
                f"this rank's process group is broken ({self.broken}); restart the trainer group"
            )
        # Busy for the whole call: a rank stuck in a collective must not look idle and fresh.
        self._busy = True
        try:
            return fn(*args)
        except (StepAborted, GroupBroken, PreconditionError):
            raise
        except RuntimeError as exc:
            # Errors of bad input or unreadable checkpoints are raised alike on every rank
            # before or instead of a collective (FieldError, OSError, ValueError, ...); a
            # RuntimeError out of a multi-rank call is a collective that failed (gloo / NCCL
            # errors and timeouts are RuntimeErrors).
            engine = self.engine
            if engine is not None and engine.distributed and engine.world_size > 1:
                self.broken = f"{type(exc).__name__}: {exc}"[:500]
                log.error("process group broken: %s", self.broken)
            raise
        finally:
            self._busy = False

    def _check_path(self, path: str, where: str = "path") -> Path:
        """``path`` resolved inside this server's roots (FieldError naming ``where`` if not)."""
        return resolve_inside(self.roots, path, where)

    # -- TrainStep ----------------------------------------------------------------------------

    async def _read_shard(self, requests: AsyncIterator[trainer_pb2.TrainStepRequest]) -> _Shard:
        """Reads begin, groups, end; records the first problem instead of raising it."""
        shard = _Shard()
        ended = False
        try:
            async for req in requests:
                kind = req.WhichOneof("kind")
                if kind == "begin":
                    if shard.begin is not None:
                        raise FieldError("begin", "StepBegin sent twice")
                    shard.begin = req.begin
                elif kind == "group":
                    if shard.begin is None:
                        raise FieldError("group", "a group arrived before StepBegin")
                    shard.groups.append(req.group)
                elif kind == "end":
                    if shard.begin is None:
                        raise FieldError("end", "StepEnd arrived before StepBegin")
                    ended = True
                    break
                else:
                    raise FieldError("kind", "empty request: set begin, group or end")
            if not ended:
                if shard.begin is None:
                    raise FieldError("begin", "the stream ended without StepBegin")
                raise FieldError("end", "the stream ended without StepEnd")
            begin = shard.begin
            assert begin is not None
            if begin.group_count != len(shard.groups):
                raise FieldError(
                    "begin.group_count",
                    f"announced {begin.group_count} groups, {len(shard.groups)} arrived",
                )
        except (FieldError, PreconditionError) as exc:
            shard.error = exc
        return shard

    def _prepare(self, shard: _Shard) -> dict[str, torch.Tensor] | None:
        """Validates the shard into a batch (None when empty); raises FieldError."""
        engine = self.engine
        assert engine is not None and shard.begin is not None
        if shard.begin.policy_version != engine.version:
            raise PreconditionError(
                f"begin.policy_version is {shard.begin.policy_version} but this rank's "
                f"weights are version {engine.version}"
            )
        if not shard.groups:
            return None
        batch = groups_to_batch(
            shard.groups, pad_token_id=engine.pad_token_id, vocab_size=engine.vocab_size
        )
        budget = self.cfg.trainer.max_tokens_per_mb
        if budget is not None:
            for g, group in enumerate(shard.groups):
                for i, traj in enumerate(group.trajectories):
                    if len(traj.token_ids) > budget:
                        raise FieldError(
                            f"groups[{g}].trajectories[{i}].token_ids",
                            f"{len(traj.token_ids)} tokens exceed max_tokens_per_mb {budget}",
                        )
        return batch

    def _agree(self, verdict: int, rows: int, global_step: int) -> None:
        """The step's agreement collective: every rank learns every rank's verdict."""
        engine = self.engine
        assert engine is not None
        mine = torch.tensor([verdict, rows, global_step], dtype=torch.int64)
        if engine.distributed and engine.world_size > 1:
            everyone = [torch.zeros_like(mine) for _ in range(engine.world_size)]
            dist.all_gather(everyone, mine)
        else:
            everyone = [mine]
        verdicts = [int(t[0]) for t in everyone]
        if verdict != OK:
            return  # the caller reports its own error
        bad = [r for r, v in enumerate(verdicts) if v != OK]
        if bad:
            raise StepAborted(f"rank(s) {bad} rejected their part of the step; nothing trained")
        steps = {int(t[2]) for t in everyone}
        if len(steps) > 1:
            raise PreconditionError(f"ranks disagree on begin.global_step: {sorted(steps)}")
        if sum(int(t[1]) for t in everyone) == 0:
            raise FieldError("groups", "the step's global batch has no trajectories on any rank")

    def _step_job(self, shard: _Shard, progress: Callable[[str, int, int], None]) -> StepResult:
        """Worker-thread body of TrainStep: validate, agree, train."""
        engine = self.engine
        assert engine is not None
        self._busy = True
        try:
            batch = None
            error = shard.error
            if error is None:
                try:
                    batch = self._prepare(shard)
                except (FieldError, PreconditionError) as exc:
                    error = exc
            verdict = OK
            if error is not None:
                verdict = CONFLICT if isinstance(error, PreconditionError) else BAD_INPUT
            rows = 0 if batch is None else int(batch["rewards"].shape[0])
            step = shard.begin.global_step if shard.begin is not None else -1
            self._agree(verdict, rows, step)
            if error is not None:
                raise error
            result = engine.train_step(batch, progress)
            # Report the coordinator's step number, not the engine's own counter.
            result.global_step = step
            return result
        finally:
            self._busy = False

    async def TrainStep(
        self,
        request_iterator: AsyncIterator[trainer_pb2.TrainStepRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[trainer_pb2.TrainStepResponse]:
        """Reads this rank's shard, joins the step on every rank, streams progress and stats."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[trainer_pb2.StepProgress] = asyncio.Queue()

        # The RPC's server span (current here, not in the worker thread) records each
        # micro-batch as an event.
        span = trace.get_current_span()

        def progress(phase: str, done: int, total: int) -> None:
            msg = trainer_pb2.StepProgress(
                microbatches_done=done, microbatches_total=total, phase=PHASES[phase]
            )
            span.add_event(
                "microbatch", {"areal.phase": phase, "areal.done": done, "areal.total": total}
            )
            loop.call_soon_threadsafe(queue.put_nowait, msg)

        try:
            await asyncio.wrap_future(self._ready)
        except Exception as exc:
            await abort_with(context, status(grpc.StatusCode.UNAVAILABLE, f"not ready: {exc}"))
        try:
            # Headers go out at once: a caller can tell the rank has taken the step on.
            await context.send_initial_metadata(())
            shard = await self._read_shard(request_iterator)
        except BaseException as exc:
            # The stream broke (cancelled, deadline): still take part in the step's agreement
            # so the other ranks are released, then let the cancellation proceed.
            broken = _Shard(error=FieldError("stream", f"broken before StepEnd: {exc!r}"))
            self._executor.submit(self._collective, self._step_job, broken, lambda *_: None)
            raise
        # Submitted even if this call is cancelled from here on: the other ranks wait for it.
        job = asyncio.wrap_future(
            self._executor.submit(self._collective, self._step_job, shard, progress)
        )
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({job, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield trainer_pb2.TrainStepResponse(progress=getter.result())
                continue
            getter.cancel()
            break
        while not queue.empty():
            yield trainer_pb2.TrainStepResponse(progress=queue.get_nowait())
        try:
            result = job.result()
        except Exception as exc:
            await abort_for(context, exc)
        yield trainer_pb2.TrainStepResponse(stats=_stats_proto(result))

    # -- checkpoints, export, status ----------------------------------------------------------

    async def _unary(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return await self._run(fn)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        # torch.distributed.checkpoint's CheckpointException derives from BaseException: without
        # catching it the call would never be answered.
        except BaseException as exc:
            if type(exc).__name__ == "CheckpointException" or isinstance(
                exc, (KeyError, pickle.UnpicklingError, EOFError)
            ):
                exc = PreconditionError(f"path: unreadable checkpoint: {exc!r}")
            await abort_for(context, exc)

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        """Sharded, atomic checkpoint of model, optimizer, scheduler, version, step."""

        def job() -> trainer_pb2.SaveCheckpointResponse:
            engine = self.engine
            assert engine is not None
            # Validation failures here are identical on every rank (same request), so no rank
            # is left waiting in the checkpoint's collectives.
            path = self._check_path(request.path)
            engine.check_checkpoint_target(path)
            engine.save_checkpoint(str(path), request.global_step or None)
            return trainer_pb2.SaveCheckpointResponse(path=str(path), policy_version=engine.version)

        return await self._unary(context, job)

    async def LoadCheckpoint(
        self, request: trainer_pb2.LoadCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.LoadCheckpointResponse:
        """Restores a SaveCheckpoint directory (version raised to min_policy_version if lower)."""

        def job() -> trainer_pb2.LoadCheckpointResponse:
            engine = self.engine
            assert engine is not None
            path = self._check_path(request.path)
            if request.min_policy_version < 0:
                raise FieldError(
                    "min_policy_version", f"must be >= 0, got {request.min_policy_version}"
                )
            step, version = engine.load_checkpoint(str(path), request.min_policy_version)
            return trainer_pb2.LoadCheckpointResponse(global_step=step, policy_version=version)

        return await self._unary(context, job)

    async def ExportModel(
        self, request: trainer_pb2.ExportModelRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ExportModelResponse:
        """Writes the full model in Hugging Face format (rank 0 writes)."""

        def job() -> trainer_pb2.ExportModelResponse:
            engine = self.engine
            assert engine is not None
            path = self._check_path(request.path)
            check_replaceable(path)
            engine.export_hf(str(path))
            return trainer_pb2.ExportModelResponse(path=str(path), policy_version=engine.version)

        return await self._unary(context, job)

    async def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        """Gathers the full weights piece by piece (every rank); rank 0 sends them.

        Validation depends on the request only, so every rank refuses the same bad request
        before any collective and none is left waiting.
        """
        try:
            addresses, methods = _check_publish(request)
        except FieldError as exc:
            await abort_for(context, exc)
        loop = asyncio.get_running_loop()
        wcfg = self.cfg.weights
        bucket_bytes = request.bucket_bytes or wcfg.bucket_bytes
        timeout_s = seconds(request.timeout) or wcfg.timeout_s
        # Rank 0 negotiates with the servers at once, while its torch thread lists the
        # tensors; a session that cannot be made still lets every rank join the gathers.
        session: PublishSession | None = None
        refused: Exception | None = None
        with contextlib.suppress(Exception):  # _run reports a failed build
            await asyncio.wrap_future(self._ready)
        if self.engine is not None and self.engine.rank == 0 and self.broken is None:
            try:
                session = self.publisher.session(
                    addresses,
                    methods,
                    bucket_bytes=bucket_bytes,
                    timeout_s=timeout_s,
                    config_json=self._config_json(),
                )
                session.begin()
            except Exception as exc:
                refused = exc

        def job() -> trainer_pb2.PublishWeightsResponse:
            engine = self.engine
            assert engine is not None
            start = time.monotonic()
            version = engine.version
            self._busy = True
            try:
                results, stats = run_publication(engine.model, version, loop, session, bucket_bytes)
            finally:
                self._busy = False
            if refused is not None:
                raise RuntimeError(f"publishing failed on rank 0: {refused!r}") from refused
            elapsed = time.monotonic() - start
            ok = sum(r.ok for r in results)
            if engine.rank == 0:
                log.info(
                    "published version %d to %d/%d servers in %.2fs",
                    version,
                    ok,
                    len(results),
                    elapsed,
                )
            return trainer_pb2.PublishWeightsResponse(
                policy_version=version,
                results=[
                    trainer_pb2.PublishTargetResult(
                        address=r.address,
                        method=r.method,  # type: ignore[arg-type]
                        policy_version=r.policy_version,
                        sent_bytes=r.sent_bytes,
                        status=r.status
                        if r.ok or r.status.code
                        else status_proto(grpc.StatusCode.UNKNOWN, "not updated"),
                    )
                    for r in results
                ],
                elapsed=duration(elapsed),
                tensor_count=stats.tensor_count,
                total_bytes=stats.total_bytes,
            )

        try:
            return await self._unary(context, job)
        finally:
            if session is not None:
                await session.abandon()  # when no job opened it (cancelled, refused)

    def _config_json(self) -> str:
        """The model's config as JSON (DISK writes it beside each version), made once."""
        if self._model_config_json is None:
            assert self.engine is not None
            self._model_config_json = self.engine.model.config.to_json_string()
        return self._model_config_json

    async def GetTrainerStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetTrainerStatusResponse:
        """Answers at once, even while a step runs (reads plain attributes, no torch work)."""
        engine = self.engine
        if engine is None:
            return trainer_pb2.GetTrainerStatusResponse(
                rank=self.cfg.dist.rank or 0,
                world_size=self.cfg.dist.world_size or 1,
                model=self.cfg.model.source,
            )
        return trainer_pb2.GetTrainerStatusResponse(
            rank=engine.rank,
            world_size=engine.world_size,
            policy_version=engine.version,
            global_step=engine.global_step,
            backend=BACKENDS.get(engine.backend, weight_sync_pb2.COLLECTIVE_BACKEND_UNSPECIFIED),
            model=self.cfg.model.source,
            busy=self._busy,
            ready=True,
            broken_reason=self.broken or "",
        )
