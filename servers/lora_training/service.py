"""LoraTrainingService: many tenants' LoRA runs on one base model (the Tinker primitives).

Every long call becomes an operation in a queue per tenant; one worker takes the queues in
turn (round robin), so no tenant waits behind another's backlog, and runs each call on the
engine. A run's calls execute in their ``sequence_number`` order. Requests are checked here,
before anything is queued, so a malformed one is answered INVALID_ARGUMENT and changes
nothing; a call that fails in the engine fails its own operation only.

Calls that change nothing (sampling, forward-only passes) that come next in the round-robin
order run as one batch, each row with its own adapter (:meth:`LoraEngine.sample_batch`,
:meth:`LoraEngine.forward_batch`): a batch is a stretch of the order the worker would follow
anyway, so no call overtakes another, and since none of them writes, running them together
reads the same state as running them in turn. Each call's result is its own, as alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from areal_servers.lora_training.engine import (
    LOSS_CONFIG_DEFAULTS,
    LOSS_FIELDS,
    AdamParams,
    AdapterSpec,
    Datum,
    ForwardJob,
    LoraEngine,
    SampleJob,
    UnknownIdError,
)
from areal_servers.lora_training.fleet import SamplerFleet
from arealgrpc.v1 import common_pb2, rollout_pb2
from arealgrpc.v1 import lora_training_pb2 as pb
from arealgrpc.v1 import lora_training_pb2_grpc as pb_grpc
from google.protobuf import json_format, timestamp_pb2

from areal_grpc.config import TINKER_AUTOSAVE_ID, TinkerConfig
from areal_grpc.durations import seconds
from areal_grpc.errors import (
    FieldError,
    abort_with,
    invalid_argument,
    resource_exhausted,
    status,
    status_proto_of,
)
from areal_grpc.paths import write_dir, write_marker
from areal_grpc.sampling import MIN_TEMPERATURE

log = logging.getLogger(__name__)

ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}")
CHECKPOINT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
# The contract's losses by the engine's names (the engine says what each needs and takes).
LOSSES = {
    pb.LOSS_FUNCTION_CROSS_ENTROPY: "cross_entropy",
    pb.LOSS_FUNCTION_IMPORTANCE_SAMPLING: "importance_sampling",
    pb.LOSS_FUNCTION_PPO: "ppo",
    pb.LOSS_FUNCTION_CISPO: "cispo",
    pb.LOSS_FUNCTION_DRO: "dro",
}
MAX_RANK = 256
MAX_SAMPLES = 64
WAIT_DEFAULT_S = 30.0
WAIT_MAX_S = 60.0
# The index of saved checkpoints, in the service's root.
INDEX_FILE = "checkpoints.json"
# How long a finished operation stays readable.
OPERATION_TTL_S = 3600.0
# How long a call waits for the call numbered before it: a gap that never fills fails the
# call (FAILED_PRECONDITION) instead of hanging it.
SEQUENCE_WAIT_S = 120.0
# The most rows (sequences sampled, datums passed) and padded tokens of one batch of calls.
BATCH_MAX_ROWS = 64
BATCH_MAX_TOKENS = 65536
# What a rollout server answers LoadAdapter with for an adapter it cannot hold at all.
FLEET_CANNOT_SERVE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)


def _now() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


@dataclass
class Run:
    """A training run and what the service keeps about it."""

    tenant: str
    id: str
    proto: pb.TrainingRun
    directory: Path
    enqueued: int = 0  # every sequence_number up to this one has arrived
    arrived: set[int] = field(default_factory=set)  # numbers above it that have arrived
    by_sequence: dict[int, str] = field(default_factory=dict)  # sequence_number -> operation
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    samplers: collections.deque[str] = field(default_factory=collections.deque)

    @property
    def name(self) -> str:
        return f"training_runs/{self.id}"


@dataclass
class Batchable:
    """A call that may run in a batch with others of its kind: the engine's job, its rows
    and its padded length (prompt + new tokens, or the longest datum)."""

    kind: str  # "sample" (a SampleJob) or "forward" (a ForwardJob)
    job: SampleJob | ForwardJob
    rows: int
    width: int


@dataclass
class Operation:
    """A queued or finished call."""

    tenant: str
    proto: pb.Operation
    work: Callable[[], Any] | None = None
    finish: Callable[[Any], None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float = 0.0  # time.monotonic() when done
    batch: Batchable | None = None  # set for a call that may share a batch


def joins(group: Sequence[Operation], op: Operation) -> bool:
    """Whether ``op`` may join the batch ``group`` (same kind, within the batch's bounds)."""
    first = group[0].batch
    if first is None or op.batch is None or op.batch.kind != first.kind:
        return False
    members = [o.batch for o in group if o.batch is not None] + [op.batch]
    rows = sum(b.rows for b in members)
    return rows <= BATCH_MAX_ROWS and rows * max(b.width for b in members) <= BATCH_MAX_TOKENS


@dataclass
class Saved:
    """A saved checkpoint: whose, what, where."""

    tenant: str
    proto: pb.Checkpoint
    directory: Path


def load_index(root: Path) -> dict[tuple[str, str], Saved]:
    """The checkpoints saved under ``root`` by earlier runs of the service (their files
    still there); an unreadable index is logged and ignored."""
    path = root / INDEX_FILE
    if not path.is_file():
        return {}
    out = {}
    try:
        for entry in json.loads(path.read_text()):
            proto = json_format.ParseDict(entry["checkpoint"], pb.Checkpoint())
            directory = (root / entry["directory"]).resolve()
            # Nothing in the index may point outside the root.
            if directory.is_relative_to(root.resolve()) and directory.is_dir():
                out[(entry["tenant"], proto.name)] = Saved(entry["tenant"], proto, directory)
    except (ValueError, KeyError, TypeError, json_format.ParseError) as exc:
        log.warning("ignoring the checkpoint index %s: %s", path, exc)
        return {}
    return out


def save_index(root: Path, saved: Iterable[Saved]) -> None:
    """Writes the checkpoint index (atomically: a crash leaves the old one or the new)."""
    entries = [
        {
            "tenant": s.tenant,
            "checkpoint": json_format.MessageToDict(s.proto),
            "directory": str(s.directory.relative_to(root)),
        }
        for s in saved
    ]
    tmp = root / f".{INDEX_FILE}.tmp"
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, root / INDEX_FILE)


class FairQueue:
    """Operations queued per tenant, taken one tenant at a time in turn."""

    def __init__(self) -> None:
        self._queues: dict[str, collections.deque[Operation]] = {}
        self._turn: collections.deque[str] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, op: Operation) -> None:
        """Queues ``op`` behind its tenant's earlier ones."""
        queue = self._queues.setdefault(op.tenant, collections.deque())
        if not queue and op.tenant not in self._turn:
            self._turn.append(op.tenant)
        queue.append(op)
        self._ready.set()

    def queued(self, tenant: str) -> int:
        """How many of ``tenant``'s operations wait."""
        return len(self._queues.get(tenant, ()))

    def position(self, op: Operation) -> int:
        """Operations of all tenants that run before ``op`` (round robin from now)."""
        queue = self._queues.get(op.tenant, collections.deque())
        try:
            k = queue.index(op)
        except ValueError:
            return 0
        ahead = k
        for tenant in self._turn:
            if tenant == op.tenant:
                continue
            # Tenants before op's in the turn order get k + 1 turns first, the others k.
            before = list(self._turn).index(tenant) < list(self._turn).index(op.tenant)
            ahead += min(len(self._queues[tenant]), k + 1 if before else k)
        return ahead

    async def get(self) -> Operation:
        """The next operation: the first of the tenant whose turn it is."""
        while not self._turn:
            self._ready.clear()
            await self._ready.wait()
        return self._pop()

    def extend(
        self,
        group: list[Operation],
        accept: Callable[[Sequence[Operation], Operation], bool],
    ) -> list[Operation]:
        """``group`` and the operations that would come next, in turn, as long as
        ``accept(group so far, next)`` takes each: a stretch of the round-robin order, so
        none overtakes another."""
        group = list(group)
        while self._turn and accept(group, self._queues[self._turn[0]][0]):
            group.append(self._pop())
        return group

    def _pop(self) -> Operation:
        tenant = self._turn.popleft()
        queue = self._queues[tenant]
        op = queue.popleft()
        if queue:
            self._turn.append(tenant)
        return op


class Tenants:
    """API keys to tenant names (compared in constant time)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            raise ValueError("at least one tenant is needed")
        self._keys = [(k.encode(), name) for name, k in keys.items()]

    def of(self, key: str) -> str | None:
        """The tenant whose key is ``key``; None when none is."""
        found = None
        for k, name in self._keys:
            if hmac.compare_digest(k, key.encode()):
                found = name
        return found


class LoraTrainingServicer(pb_grpc.LoraTrainingServiceServicer):
    """The service over one engine; see the module docstring."""

    def __init__(
        self,
        engine: LoraEngine,
        cfg: TinkerConfig,
        tenants: Tenants,
        root: Path,
        base_model_names: Sequence[str],
        tokenizer_id: str = "",
        fleet: SamplerFleet | None = None,
    ) -> None:
        """``fleet``: the rollout servers samplers are loaded on and sampled on
        (tinker.rollout_addresses); None: the engine samples them itself."""
        self.engine = engine
        self.fleet = fleet
        # Sample calls on the fleet, per tenant: they bypass the queue (the trainer's worker
        # is not needed) but count against the tenant's queued calls.
        self._fleet_calls: collections.Counter[str] = collections.Counter()
        self._fleet_tasks: set[asyncio.Task[None]] = set()
        # Samplers the fleet cannot serve (it refused their adapter): they sample here.
        self._off_fleet: set[str] = set()
        # Whether calls that change nothing may share a batch (tinker.batch_calls).
        self.batching = cfg.batch_calls
        self.cfg = cfg
        self.tenants = tenants
        self.root = root
        # The first name is how the model is listed; every name is accepted.
        self.base_model_names = list(base_model_names)
        self.tokenizer_id = tokenizer_id or self.base_model_names[0]
        self.runs: dict[tuple[str, str], Run] = {}
        # Every saved checkpoint by (tenant, name), kept on disk too (INDEX_FILE), so that a
        # state saved before a restart can still be loaded after it.
        self.saved: dict[tuple[str, str], Saved] = load_index(root)
        self.ops: dict[str, Operation] = {}
        self.queue = FairQueue()
        self._ids = itertools.count(1)
        self._worker: asyncio.Task[None] | None = None

    # -- plumbing -----------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the worker (on the server's event loop), after removing the samplers a
        previous service left on the fleet (they died with it)."""
        if self.fleet is not None:
            gone = await asyncio.to_thread(self.fleet.forget_stale)
            if gone:
                log.info("removed %d samplers a previous service left on the fleet", len(gone))
        self._worker = asyncio.create_task(self._work(), name="lora-training-worker")

    async def stop(self) -> None:
        """Stops the worker; queued operations fail UNAVAILABLE."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for task in list(self._fleet_tasks):
            task.cancel()
        await asyncio.gather(*self._fleet_tasks, return_exceptions=True)
        for op in self.ops.values():
            if not op.proto.done:
                self._fail(op, grpc.StatusCode.UNAVAILABLE, "the service stopped")

    async def _work(self) -> None:
        while True:
            group = [await self.queue.get()]
            if self.batching and group[0].batch is not None:
                group = self.queue.extend(group, joins)
            if len(group) == 1:
                op = group[0]
                assert op.work is not None
                try:
                    outcome: Any = await asyncio.to_thread(op.work)
                except Exception as exc:
                    outcome = exc
                self._complete(op, outcome)
                continue
            outcomes = await asyncio.to_thread(self._run_batch, group)
            for op, outcome in zip(group, outcomes, strict=True):
                self._complete(op, outcome)

    def _run_batch(self, group: list[Operation]) -> list[Any]:
        """Each operation's result or exception, computed in one batch (on the worker thread);
        the engine fails a bad call alone and falls back to one call at a time."""
        jobs = [op.batch.job for op in group if op.batch is not None]
        try:
            if group[0].batch is not None and group[0].batch.kind == "sample":
                return self.engine.sample_batch(jobs)  # type: ignore[arg-type]
            return self.engine.forward_batch(jobs)  # type: ignore[arg-type]
        except Exception as exc:  # a bug in batching must not fail the calls
            log.warning("batch of %d failed (%r); running each alone", len(group), exc)
            outcomes: list[Any] = []
            for op in group:
                assert op.work is not None
                try:
                    outcomes.append(op.work())
                except Exception as alone:
                    outcomes.append(alone)
            return outcomes

    def _complete(self, op: Operation, outcome: Any) -> None:
        """Finishes ``op`` with its result, or its error when ``outcome`` is an exception."""
        assert op.finish is not None
        try:
            if isinstance(outcome, Exception):
                raise outcome
            op.finish(outcome)
        except Exception as exc:
            log.info("operation %s failed: %r", op.proto.name, exc)
            op.proto.error.CopyFrom(status_proto_of(exc))
            if isinstance(exc, UnknownIdError):
                # A sampler that left memory after the call was queued: it is gone.
                op.proto.error.code = grpc.StatusCode.NOT_FOUND.value[0]
        op.proto.done = True
        op.work = op.finish = None
        op.batch = None
        op.finished_at = time.monotonic()
        op.done.set()

    def _fail(self, op: Operation, code: grpc.StatusCode, message: str) -> None:
        op.proto.error.code = code.value[0]
        op.proto.error.message = message
        op.proto.done = True
        op.finished_at = time.monotonic()
        op.done.set()

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                tenant = self.tenants.of(token.strip()) if scheme.lower() == "bearer" else None
                if tenant is not None:
                    return tenant
        await abort_with(
            context,
            status(grpc.StatusCode.UNAUTHENTICATED, "a tenant's API key is needed (Bearer)"),
        )

    async def _run(self, context: grpc.aio.ServicerContext, tenant: str, name: str) -> Run:
        run_id = name.removeprefix("training_runs/")
        run = self.runs.get((tenant, run_id))
        if not name.startswith("training_runs/") or run is None:
            # Another tenant's run reads exactly like a missing one.
            await abort_with(
                context, status(grpc.StatusCode.NOT_FOUND, f"no training run {name!r}")
            )
        return run

    async def _bad(self, context: grpc.aio.ServicerContext, key: str, why: str) -> None:
        await abort_with(context, invalid_argument(FieldError(key, why)))

    async def _admit(self, context: grpc.aio.ServicerContext, tenant: str) -> None:
        queued = self.queue.queued(tenant) + self._fleet_calls[tenant]
        if queued >= self.cfg.max_queued_per_tenant:
            await abort_with(
                context,
                resource_exhausted(
                    f"tenant {tenant!r} has {self.cfg.max_queued_per_tenant} calls queued "
                    "(tinker.max_queued_per_tenant); retry when some are done",
                    self.cfg.retry_after_s,
                ),
            )

    def _operation(
        self, tenant: str, work: Callable[[], Any], finish: Callable[[Any], None]
    ) -> Operation:
        # Unguessable, though a guess would only reach the tenant's own operations anyway.
        name = f"operations/{next(self._ids)}-{secrets.token_hex(6)}"
        op = Operation(tenant, pb.Operation(name=name), work, finish)
        self._forget_old()
        self.ops[name] = op
        return op

    def _forget_old(self) -> None:
        """Drops operations done more than OPERATION_TTL_S ago (a client awaits its result
        well within that), with the sequence numbers that name them."""
        horizon = time.monotonic() - OPERATION_TTL_S
        old = {n for n, o in self.ops.items() if o.proto.done and o.finished_at < horizon}
        if not old:
            return
        for name in old:
            del self.ops[name]
        for run in self.runs.values():
            for number in [k for k, v in run.by_sequence.items() if v in old]:
                del run.by_sequence[number]

    async def _sequenced(
        self,
        context: grpc.aio.ServicerContext,
        run: Run,
        sequence_number: int,
        work: Callable[[], Any],
        finish: Callable[[Any], None],
        batch: Batchable | None = None,
    ) -> pb.Operation:
        """Queues a call on ``run`` in its sequence order (a repeated number returns the
        operation already made for it); ``batch``: it may share a batch."""
        if sequence_number < 0:
            await self._bad(context, "sequence_number", f"must be >= 0, got {sequence_number}")
        if sequence_number and sequence_number in run.by_sequence:
            return self.ops[run.by_sequence[sequence_number]].proto
        if 0 < sequence_number <= run.enqueued:
            # Its operation was forgotten long ago: this is not a retry of a live call.
            await abort_with(
                context,
                status(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"sequence_number {sequence_number} of {run.name} was used already "
                    f"(the run is at {run.enqueued})",
                ),
            )
        await self._admit(context, run.tenant)
        async with run.changed:
            if sequence_number:
                try:
                    await asyncio.wait_for(
                        run.changed.wait_for(lambda: run.enqueued >= sequence_number - 1),
                        SEQUENCE_WAIT_S,
                    )
                except TimeoutError:
                    await abort_with(
                        context,
                        status(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"sequence_number {sequence_number}: call {sequence_number - 1} "
                            f"of {run.name} did not arrive within {SEQUENCE_WAIT_S:.0f} s",
                        ),
                    )
                if sequence_number in run.by_sequence:  # a retry raced the original
                    return self.ops[run.by_sequence[sequence_number]].proto
            op = self._operation(run.tenant, work, finish)
            op.batch = batch
            if sequence_number:
                run.by_sequence[sequence_number] = op.proto.name
                self._arrive(run, sequence_number)
            self.queue.put(op)
        return op.proto

    @staticmethod
    def _arrive(run: Run, sequence_number: int) -> None:
        """Counts ``sequence_number`` as arrived (queued or refused); wakes the calls after it.
        Call with ``run.changed`` held."""
        run.arrived.add(sequence_number)
        while run.enqueued + 1 in run.arrived:
            run.enqueued += 1
            run.arrived.discard(run.enqueued)
        run.changed.notify_all()

    @contextlib.asynccontextmanager
    async def _numbered(
        self, context: grpc.aio.ServicerContext, run: Run, sequence_number: int
    ) -> AsyncIterator[None]:
        """Around a numbered call's checks: one refused for good still counts as arrived, so
        the calls numbered after it do not wait for it (the SDK numbers a call before it is
        answered). A quota refusal does not count: the same number comes again."""
        try:
            yield
        except BaseException:
            final = context.code() not in (None, grpc.StatusCode.RESOURCE_EXHAUSTED)
            if sequence_number > 0 and sequence_number not in run.by_sequence and final:
                async with run.changed:
                    self._arrive(run, sequence_number)
            raise

    def _touch(self, run: Run) -> None:
        run.proto.last_request_time.CopyFrom(_now())
        run.proto.last_sequence_number = run.enqueued

    def _base_model(self, name: str) -> bool:
        return name in self.base_model_names

    # -- runs -----------------------------------------------------------------------------

    async def ListBaseModels(
        self, request: pb.ListBaseModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBaseModelsResponse:
        """The served base model."""
        await self._tenant(context)
        return pb.ListBaseModelsResponse(
            base_models=[
                pb.BaseModel(
                    name=self.base_model_names[0],
                    max_context_length=self.engine.max_context_length,
                    trainable=True,
                    sampleable=True,
                    tokenizer_id=self.tokenizer_id,
                )
            ]
        )

    async def CreateTrainingRun(
        self, request: pb.CreateTrainingRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateTrainingRunResponse:
        """Checks the request and quotas, then queues the adapter's creation."""
        tenant = await self._tenant(context)
        if not self._base_model(request.base_model):
            await self._bad(
                context,
                "base_model",
                f"{request.base_model!r} is not served; served: {self.base_model_names}",
            )
        lora = request.lora
        if not 1 <= lora.rank <= MAX_RANK:
            await self._bad(context, "lora.rank", f"must be in 1-{MAX_RANK}, got {lora.rank}")
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            await self._bad(context, "lora", "train_attn, train_mlp or train_unembed must be set")
        # Unique across restarts too: checkpoint names (kept on disk) derive from it.
        run_id = request.training_run_id or f"run-{secrets.token_hex(6)}"
        if not ID_RE.fullmatch(run_id):
            await self._bad(
                context, "training_run_id", f"{run_id!r}: letters, digits, ._:- (at most 128)"
            )
        if (tenant, run_id) in self.runs:
            await abort_with(
                context,
                status(grpc.StatusCode.ALREADY_EXISTS, f"training_runs/{run_id} exists"),
            )
        owned = [r for (t, _), r in self.runs.items() if t == tenant]
        if len(owned) >= self.cfg.max_runs_per_tenant:
            await abort_with(
                context,
                resource_exhausted(
                    f"tenant {tenant!r} has {len(owned)} runs "
                    "(tinker.max_runs_per_tenant); delete one or retry later",
                    self.cfg.retry_after_s,
                ),
            )
        used = sum(r.proto.adapter_bytes for r in owned)
        if used >= self.cfg.max_adapter_mib_per_tenant * 2**20:
            await abort_with(
                context,
                resource_exhausted(
                    f"tenant {tenant!r}'s adapters take {used / 2**20:.1f} MiB "
                    "(tinker.max_adapter_mib_per_tenant); delete a run or retry later",
                    self.cfg.retry_after_s,
                ),
            )
        await self._admit(context, tenant)
        digest = hashlib.sha256(f"{tenant}\0{run_id}".encode()).hexdigest()[:24]
        run = Run(
            tenant,
            run_id,
            pb.TrainingRun(
                name=f"training_runs/{run_id}",
                base_model=self.base_model_names[0],
                lora=lora,
                last_request_time=_now(),
            ),
            self.root / digest,
        )
        self.runs[(tenant, run_id)] = run
        spec = AdapterSpec(
            rank=lora.rank,
            train_attn=lora.train_attn,
            train_mlp=lora.train_mlp,
            train_unembed=lora.train_unembed,
            seed=lora.seed if lora.HasField("seed") else None,
        )
        key = self._key(run)

        def work() -> int:
            self.engine.create(key, spec)
            return self.engine.adapter_bytes(key)

        def finish(nbytes: int) -> None:
            run.proto.adapter_bytes = nbytes
            op.proto.training_run.CopyFrom(run.proto)

        op = self._operation(tenant, work, finish)
        self.queue.put(op)
        return pb.CreateTrainingRunResponse(operation=op.proto)

    def _key(self, run: Run) -> str:
        """The engine's name of a run's adapter: unique across tenants."""
        return f"{run.tenant}/{run.id}"

    async def GetTrainingRun(
        self, request: pb.GetTrainingRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetTrainingRunResponse:
        """One of the tenant's runs."""
        tenant = await self._tenant(context)
        run = await self._run(context, tenant, request.name)
        return pb.GetTrainingRunResponse(training_run=run.proto)

    async def ListTrainingRuns(
        self, request: pb.ListTrainingRunsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListTrainingRunsResponse:
        """The tenant's runs."""
        tenant = await self._tenant(context)
        return pb.ListTrainingRunsResponse(
            training_runs=[r.proto for (t, _), r in self.runs.items() if t == tenant]
        )

    async def DeleteTrainingRun(
        self, request: pb.DeleteTrainingRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteTrainingRunResponse:
        """Forgets the run and frees its adapter (after any call of it running now)."""
        tenant = await self._tenant(context)
        run = await self._run(context, tenant, request.name)
        del self.runs[(tenant, run.id)]
        key = self._key(run)
        samplers = [name_key(tenant, s) for s in run.samplers]

        def work() -> None:
            self.engine.delete(key)
            if self.fleet is not None:
                for sampler in samplers:
                    self.fleet.remove(sampler)

        # Through the queue: the worker may be running one of its calls now.
        op = self._operation(tenant, work, lambda _: None)
        self.queue.put(op)
        await op.done.wait()
        return pb.DeleteTrainingRunResponse()

    # -- training -------------------------------------------------------------------------

    @staticmethod
    def _data(data: Sequence[pb.Datum], needs: Sequence[str]) -> list[Datum]:
        """The request's data as the engine's datums, with the per-token fields the loss
        reads (the engine checks them: :meth:`LoraEngine.check_data`)."""
        return [
            Datum(
                input_tokens=list(d.input_tokens),
                target_tokens=list(d.target_tokens),
                weights=list(d.weights) if "weights" in needs else None,
                logprobs=list(d.logprobs) if "logprobs" in needs else None,
                advantages=list(d.advantages) if "advantages" in needs else None,
            )
            for d in data
        ]

    async def ForwardBackward(
        self, request: pb.ForwardBackwardRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForwardBackwardResponse:
        """Checks the data, then queues the pass in the run's order."""
        tenant = await self._tenant(context)
        run = await self._run(context, tenant, request.training_run)
        async with self._numbered(context, run, request.sequence_number):
            if request.loss_function not in LOSSES:
                await self._bad(
                    context,
                    "loss_function",
                    f"must be one of {sorted(pb.LossFunction.Name(k) for k in LOSSES)}",
                )
            loss = LOSSES[request.loss_function]
            needs = LOSS_FIELDS[loss]
            config = {}
            for key in ("clip_low_threshold", "clip_high_threshold", "beta"):
                if request.loss_config.HasField(key):
                    if key not in LOSS_CONFIG_DEFAULTS[loss]:
                        await self._bad(context, f"loss_config.{key}", f"{loss} has no {key}")
                    config[key] = getattr(request.loss_config, key)
            data = self._data(request.data, needs)
            try:
                # The engine's own check, before queuing: a bad datum is refused now.
                self.engine.check_data(data, loss, config)
            except FieldError as exc:
                # The engine's "config" is this request's "loss_config".
                field = re.sub(r"^config\b", "loss_config", exc.field)
                await abort_with(context, invalid_argument(FieldError(field, exc.description)))
            key = self._key(run)
            forward_only = request.forward_only

            def work() -> tuple[list[list[float]], dict[str, float]]:
                return self.engine.forward_backward(
                    key, data, loss, config, forward_only=forward_only
                )

            def finish(result: tuple[list[list[float]], dict[str, float]]) -> None:
                outputs, metrics = result
                self._touch(run)
                op.proto.forward_backward.CopyFrom(
                    pb.ForwardBackwardResult(
                        outputs=[pb.DatumOutput(logprobs=lp) for lp in outputs], metrics=metrics
                    )
                )

            batch = None
            if forward_only:
                width = max(len(d.input_tokens) for d in data)
                job = ForwardJob(key, data, loss, config)
                batch = Batchable("forward", job, len(data), width)
            proto = await self._sequenced(
                context, run, request.sequence_number, work, finish, batch
            )
            op = self.ops[proto.name]
        return pb.ForwardBackwardResponse(operation=proto)

    async def OptimStep(
        self, request: pb.OptimStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.OptimStepResponse:
        """Checks the Adam settings, then queues the step in the run's order."""
        tenant = await self._tenant(context)
        run = await self._run(context, tenant, request.training_run)
        async with self._numbered(context, run, request.sequence_number):
            a = request.adam
            checks = {
                "adam.learning_rate": a.learning_rate >= 0,
                "adam.beta1": 0 <= a.beta1 < 1,
                "adam.beta2": 0 <= a.beta2 < 1,
                "adam.eps": a.eps >= 0,
                "adam.weight_decay": a.weight_decay >= 0,
                "adam.grad_clip_norm": a.grad_clip_norm >= 0,
            }
            for key, ok in checks.items():
                value = getattr(a, key.split(".")[1])
                if not ok or not math.isfinite(value):
                    await self._bad(context, key, f"out of range: {value}")
            params = AdamParams(
                learning_rate=a.learning_rate,
                beta1=a.beta1,
                beta2=a.beta2,
                eps=a.eps,
                weight_decay=a.weight_decay,
                grad_clip_norm=a.grad_clip_norm,
            )
            key = self._key(run)

            every = self.cfg.autosave_steps

            def work() -> tuple[dict[str, float], int, tuple[int, Path] | None]:
                metrics = self.engine.optim_step(key, params)
                due = every > 0 and (run.proto.steps + 1) % every == 0
                saved = self._autosave(key, run) if due else None
                # The optimizer state exists from the first step on: the adapter's memory
                # is counted again.
                return metrics, self.engine.adapter_bytes(key), saved

            def finish(result: tuple[dict[str, float], int, tuple[int, Path] | None]) -> None:
                metrics, run.proto.adapter_bytes, saved = result
                run.proto.steps += 1
                if saved is not None:
                    name = f"{run.name}/checkpoints/{TINKER_AUTOSAVE_ID}"
                    self._record(run, name, pb.CHECKPOINT_KIND_STATE, *saved)
                self._touch(run)
                op.proto.optim_step.CopyFrom(pb.OptimStepResult(metrics=metrics))

            proto = await self._sequenced(context, run, request.sequence_number, work, finish)
            op = self.ops[proto.name]
        return pb.OptimStepResponse(operation=proto)

    # -- checkpoints ------------------------------------------------------------------------

    async def SaveWeights(
        self, request: pb.SaveWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveWeightsResponse:
        """Queues a save of the run's adapter (a sampler also stays in memory)."""
        tenant = await self._tenant(context)
        run = await self._run(context, tenant, request.training_run)
        async with self._numbered(context, run, request.sequence_number):
            if request.kind not in (pb.CHECKPOINT_KIND_STATE, pb.CHECKPOINT_KIND_SAMPLER):
                await self._bad(context, "kind", "must be CHECKPOINT_KIND_STATE or _SAMPLER")
            ckpt_id = request.checkpoint_id or f"ckpt-{next(self._ids)}"
            if not CHECKPOINT_RE.fullmatch(ckpt_id):
                await self._bad(
                    context, "checkpoint_id", f"{ckpt_id!r}: letters, digits, ._- (at most 128)"
                )
            if ckpt_id == TINKER_AUTOSAVE_ID:
                await self._bad(
                    context,
                    "checkpoint_id",
                    f"{ckpt_id!r} is the service's own (saved every tinker.autosave_steps steps)",
                )
            name = f"{run.name}/checkpoints/{ckpt_id}"
            kind = request.kind
            key = self._key(run)
            directory = run.directory / ckpt_id

            def work() -> int:
                directory.mkdir(parents=True, exist_ok=True)
                write_marker(directory, "lora-checkpoint")
                nbytes = self.engine.save_state(
                    key, directory, optimizer=kind == pb.CHECKPOINT_KIND_STATE
                )
                if kind == pb.CHECKPOINT_KIND_SAMPLER:
                    sampler = name_key(tenant, name)
                    self.engine.snapshot(key, sampler)
                    if self.fleet is not None:
                        try:
                            self.fleet.load(sampler, *self.engine.snapshot_adapter(sampler))
                        except grpc.RpcError as exc:
                            self._fleet_forget(sampler)  # a server that took it drops it
                            if exc.code() not in FLEET_CANNOT_SERVE:  # type: ignore[attr-defined]
                                self.engine.delete_snapshot(sampler)
                                raise
                            # An adapter the fleet's engine cannot hold (vLLM takes none on
                            # a tied output head): the sampler samples here, as without one.
                            self._off_fleet.add(sampler)
                            log.warning(
                                "sampler %s samples in this service: the fleet refused its "
                                "adapter: %s",
                                name,
                                exc.details(),  # type: ignore[attr-defined]
                            )
                        except BaseException:
                            # Not a sampler of the run's then: nothing of it stays anywhere.
                            self.engine.delete_snapshot(sampler)
                            self._fleet_forget(sampler)
                            raise
                return nbytes

            def finish(nbytes: int) -> None:
                ckpt = self._record(run, name, kind, nbytes, directory)
                if kind == pb.CHECKPOINT_KIND_SAMPLER:
                    run.samplers.append(name)
                    # Older samplers leave memory (their files stay).
                    while len(run.samplers) > self.cfg.samplers_per_run:
                        gone = name_key(tenant, run.samplers.popleft())
                        self.engine.delete_snapshot(gone)
                        self._fleet_forget(gone)
                self._touch(run)
                op.proto.checkpoint.CopyFrom(ckpt)

            proto = await self._sequenced(context, run, request.sequence_number, work, finish)
            op = self.ops[proto.name]
        return pb.SaveWeightsResponse(operation=proto)

    def _record(
        self, run: Run, name: str, kind: int, nbytes: int, directory: Path
    ) -> pb.Checkpoint:
        """Indexes a checkpoint of ``run`` just written (on disk too, so that it outlives the
        service) in place of one of the same name."""
        ckpt = pb.Checkpoint(
            name=name,
            kind=kind,  # type: ignore[arg-type]
            size_bytes=nbytes,
            create_time=_now(),
            step=run.proto.steps,
            lora=run.proto.lora,
            base_model=run.proto.base_model,
        )
        self.saved[(run.tenant, name)] = Saved(run.tenant, ckpt, directory)
        save_index(self.root, self.saved.values())
        kept = [c for c in run.proto.checkpoints if c.name != name]
        del run.proto.checkpoints[:]
        run.proto.checkpoints.extend([*kept, ckpt])
        return ckpt

    def _autosave(self, key: str, run: Run) -> tuple[int, Path] | None:
        """Writes the run's state (adapter and optimizer) as its ``TINKER_AUTOSAVE_ID`` checkpoint,
        replacing the last one whole; (bytes, directory), or None when it could not (the step
        it follows stands either way)."""
        final = run.directory / TINKER_AUTOSAVE_ID
        written: list[int] = []
        try:
            write_dir(
                final,
                lambda fresh: written.append(self.engine.save_state(key, fresh, optimizer=True)),
                "lora-checkpoint",
            )
        except Exception as exc:
            log.warning("autosave of %s failed: %s", run.name, exc)
            return None
        return written[0], final

    async def GetCheckpoint(
        self, request: pb.GetCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCheckpointResponse:
        """One of the tenant's saved checkpoints (its run may be gone)."""
        tenant = await self._tenant(context)
        found = self.saved.get((tenant, request.name))
        if found is None:
            await abort_with(
                context, status(grpc.StatusCode.NOT_FOUND, f"no checkpoint {request.name!r}")
            )
        return pb.GetCheckpointResponse(checkpoint=found.proto)

    async def LoadWeights(
        self, request: pb.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadWeightsResponse:
        """Queues loading one of the tenant's state checkpoints into the run."""
        tenant = await self._tenant(context)
        run = await self._run(context, tenant, request.training_run)
        async with self._numbered(context, run, request.sequence_number):
            found = self.saved.get((tenant, request.checkpoint))
            if found is None:
                await abort_with(
                    context,
                    status(grpc.StatusCode.NOT_FOUND, f"no checkpoint {request.checkpoint!r}"),
                )
            ckpt, directory = found.proto, found.directory
            if ckpt.kind != pb.CHECKPOINT_KIND_STATE and request.with_optimizer:
                await self._bad(context, "with_optimizer", "a sampler checkpoint has no optimizer")
            if ckpt.lora.rank != run.proto.lora.rank:
                await self._bad(
                    context,
                    "checkpoint",
                    f"rank {ckpt.lora.rank} does not match the run's {run.proto.lora.rank}",
                )
            key = self._key(run)
            with_optimizer = request.with_optimizer

            def finish(_: object) -> None:
                if with_optimizer:
                    run.proto.steps = ckpt.step
                self._touch(run)
                op.proto.training_run.CopyFrom(run.proto)

            proto = await self._sequenced(
                context,
                run,
                request.sequence_number,
                lambda: self.engine.load_state(key, directory, optimizer=with_optimizer),
                finish,
            )
            op = self.ops[proto.name]
        return pb.LoadWeightsResponse(operation=proto)

    # -- sampling ----------------------------------------------------------------------------

    async def Sample(
        self, request: pb.SampleRequest, context: grpc.aio.ServicerContext
    ) -> pb.SampleResponse:
        """Checks the request, then queues the sampling."""
        tenant = await self._tenant(context)
        sampler: str | None = None
        step = 0
        if request.WhichOneof("model") == "checkpoint":
            found = self.saved.get((tenant, request.checkpoint))
            run_id = request.checkpoint.partition("/checkpoints/")[0].removeprefix("training_runs/")
            owner = self.runs.get((tenant, run_id))
            if found is None or owner is None or request.checkpoint not in owner.samplers:
                # Another tenant's, unknown, or no longer in memory.
                await abort_with(
                    context,
                    status(
                        grpc.StatusCode.NOT_FOUND,
                        f"no sampler {request.checkpoint!r} (a sampler checkpoint of yours; "
                        f"each run keeps its newest {self.cfg.samplers_per_run} in memory)",
                    ),
                )
            sampler = name_key(tenant, request.checkpoint)
            step = found.proto.step
        elif request.WhichOneof("model") == "base_model":
            if not self._base_model(request.base_model):
                await self._bad(
                    context,
                    "base_model",
                    f"{request.base_model!r} is not served; served: {self.base_model_names}",
                )
        else:
            await self._bad(context, "model", "name a checkpoint or a base_model")
        s = request.sampling
        prompt = list(request.prompt_tokens)
        vocab = self.engine.vocab_size
        problems = {
            "prompt_tokens": "must not be empty" if not prompt else None,
            "sampling.max_new_tokens": None
            if s.max_new_tokens >= 1
            else f"must be >= 1, got {s.max_new_tokens}",
            "sampling.n_samples": None
            if 0 <= s.n_samples <= MAX_SAMPLES
            else f"must be in 1-{MAX_SAMPLES}, got {s.n_samples}",
            "sampling.top_p": None
            if not s.HasField("top_p") or 0 < s.top_p <= 1
            else f"must be in (0, 1], got {s.top_p}",
            "sampling.temperature": None
            if not s.HasField("temperature")
            or s.temperature == 0
            or MIN_TEMPERATURE <= s.temperature < math.inf
            # Below MIN_TEMPERATURE logits / T overflows and sampling fails in the engine.
            else f"must be 0 (greedy) or >= {MIN_TEMPERATURE} and finite, got {s.temperature}",
        }
        if any(not text for text in request.stop):
            problems["stop"] = "an empty string would end every completion at once"
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            problems["prompt_tokens"] = f"token {bad} is not in 0-{vocab - 1}"
        if len(prompt) + s.max_new_tokens > self.engine.max_context_length:
            problems["sampling.max_new_tokens"] = (
                f"prompt ({len(prompt)}) + max_new_tokens ({s.max_new_tokens}) exceed the "
                f"model's {self.engine.max_context_length} tokens"
            )
        for key, why in problems.items():
            if why is not None:
                await self._bad(context, key, why)
        await self._admit(context, tenant)
        eos_id = self.engine.eos_token_id
        eos = [] if s.ignore_eos or eos_id is None else [eos_id]
        kwargs: dict[str, Any] = {
            "num_samples": s.n_samples or 1,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature if s.HasField("temperature") else 1.0,
            "top_p": s.top_p if s.HasField("top_p") else 1.0,
            "top_k": s.top_k if s.top_k > 0 else -1,
            "seed": s.seed if s.HasField("seed") else None,
            "stop_token_ids": [*eos, *s.stop_token_ids],
            "stop": list(request.stop),
            "prompt_logprobs": request.prompt_logprobs,
        }

        def finish(result: Any) -> None:
            sequences, prompt_lps = result
            op.proto.sample.CopyFrom(
                pb.SampleResult(
                    completions=[
                        rollout_pb2.Completion(
                            output_ids=seq.tokens,
                            output_logprobs=seq.logprobs,
                            output_versions=[step] * len(seq.tokens),
                            finish_reason=common_pb2.FINISH_REASON_STOP
                            if seq.stop_reason == "stop"
                            else common_pb2.FINISH_REASON_LENGTH,
                        )
                        for seq in sequences
                    ],
                    prompt_logprobs=prompt_lps or [],
                )
            )

        fleet = self.fleet
        on_fleet_ok = sampler is None or sampler not in self._off_fleet
        if fleet is not None and on_fleet_ok and not request.stop and not request.prompt_logprobs:
            # On the rollout fleet, with the sampler's adapter (stop strings and prompt
            # log-probs, which Generate does not offer, stay with the engine).
            on_fleet = {k: v for k, v in kwargs.items() if k not in ("stop", "prompt_logprobs")}
            op = self._operation(tenant, lambda: fleet.sample(sampler, prompt, **on_fleet), finish)
            self._fleet_calls[tenant] += 1
            task = asyncio.create_task(self._on_fleet(op, tenant))
            self._fleet_tasks.add(task)
            task.add_done_callback(self._fleet_tasks.discard)
            return pb.SampleResponse(operation=op.proto)

        def work() -> Any:
            return self.engine.sample(sampler, prompt, **kwargs)

        op = self._operation(tenant, work, finish)
        job = SampleJob(sampler, prompt, **kwargs)
        op.batch = Batchable("sample", job, job.num_samples, len(prompt) + s.max_new_tokens)
        self.queue.put(op)
        return pb.SampleResponse(operation=op.proto)

    async def _on_fleet(self, op: Operation, tenant: str) -> None:
        """Runs a sample call on the fleet (its blocking call on a thread of its own)."""
        assert op.work is not None
        try:
            outcome: Any = await asyncio.to_thread(op.work)
        except Exception as exc:
            outcome = exc
        finally:
            self._fleet_calls[tenant] -= 1
        self._complete(op, outcome)

    def _fleet_forget(self, sampler: str) -> None:
        """Removes a sampler's adapter from the fleet, off the caller's thread."""
        self._off_fleet.discard(sampler)
        fleet = self.fleet
        if fleet is None:
            return
        threading.Thread(
            target=fleet.remove, args=(sampler,), name="fleet-remove", daemon=True
        ).start()

    # -- operations ----------------------------------------------------------------------------

    async def _op(self, context: grpc.aio.ServicerContext, tenant: str, name: str) -> Operation:
        op = self.ops.get(name)
        if op is None or op.tenant != tenant:
            await abort_with(context, status(grpc.StatusCode.NOT_FOUND, f"no operation {name!r}"))
        return op

    def _view(self, op: Operation) -> pb.Operation:
        if not op.proto.done:
            op.proto.queue_position = self.queue.position(op)
        return op.proto

    async def GetOperation(
        self, request: pb.GetOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetOperationResponse:
        """An operation of the tenant's, as it is now."""
        tenant = await self._tenant(context)
        op = await self._op(context, tenant, request.name)
        return pb.GetOperationResponse(operation=self._view(op))

    async def WaitOperation(
        self, request: pb.WaitOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.WaitOperationResponse:
        """An operation of the tenant's, once done or when the timeout passed."""
        tenant = await self._tenant(context)
        op = await self._op(context, tenant, request.name)
        timeout = seconds(request.timeout) if request.HasField("timeout") else 0.0
        if not 0 <= timeout <= WAIT_MAX_S:
            await self._bad(context, "timeout", f"must be in 0-{WAIT_MAX_S:.0f} s, got {timeout}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(op.done.wait(), timeout or WAIT_DEFAULT_S)
        return pb.WaitOperationResponse(operation=self._view(op))


def name_key(tenant: str, checkpoint: str) -> str:
    """The engine's name of a sampler: unique across tenants."""
    return f"{tenant}/{checkpoint}"
