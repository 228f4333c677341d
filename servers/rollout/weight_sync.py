"""``WeightSyncService``: a rollout server receives new policy weights.

Three data planes, agreed per sender with ``Negotiate``:

* STREAM (``PushWeights``): a header, then ≤ 1 MiB CRC-32C-checked chunks, reassembled into a
  staged state dict; only a complete, valid stream is swapped in (``engine.load_weights`` is
  atomic), so a broken or corrupt stream leaves the old weights serving.
* DISK (``UpdateFromDisk``): a versioned safetensors directory that must lie inside this
  server's own configured root (``..``, absolute paths elsewhere and symlinks leading out are
  INVALID_ARGUMENT naming ``path``). The ``sglang`` engine gets ``/update_weights_from_disk``.
* DISTRIBUTED (``UpdateFromDistributed``): the sender announces names, dtypes, shapes and the
  version, then broadcasts each tensor in order over a private process group (rank 0 = sender;
  gloo on CPU, nccl on GPU). The group is joined on the first update of a plan and kept for
  later ones. The ``sglang`` engine gets ``/init_weights_update_group`` and one
  ``/update_weights_from_distributed`` per bucket instead (SGLang joins the group itself).

Every update names the new policy version; one that is not newer than the served version is
FAILED_PRECONDITION and changes nothing. Updates run one at a time.

Received tensors are handed to the engine without a copy, and the weights they replace become
the next update's receive buffers (``reuse_buffers``): STREAM chunks and DISTRIBUTED
broadcasts land in memory already faulted in rather than in fresh pages. DISK shards need no
buffer at all: safetensors maps each file privately (copy-on-write), and the mapped tensors
are handed over as they are, so the served weights share the page cache the trainer wrote
(pruning the directory later does not disturb a mapping). A sender
that cancels a DISTRIBUTED update (another member died) makes this server drop the group at
once; the blocked collective is left to its thread until the group timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import grpc
import torch
from areal_servers.rollout.engine import InferenceEngine
from arealgrpc.v1 import weight_sync_pb2, weight_sync_pb2_grpc

from areal_grpc import tensor_codec as tc
from areal_grpc.chunks import ChunkLike, StateDictAssembler
from areal_grpc.errors import (
    FieldError,
    PreconditionError,
    abort_for,
    abort_with,
    invalid_argument,
    status,
)
from areal_grpc.host_memory import tune_malloc
from areal_grpc.server import Service
from areal_grpc.weight_disk import load_version, resolve_confined
from areal_grpc.weight_transfer import (
    MAX_CHUNK_BYTES,
    SERVICE_NAME,
    GroupParams,
    PushMessage,
    WeightGroup,
    cuda_uuid,
    decode_push_request,
    plan_buckets,
    run_in_thread,
    spec_nbytes,
)

log = logging.getLogger(__name__)

pb = weight_sync_pb2
METHOD_NAMES = {
    "distributed": pb.TRANSFER_METHOD_DISTRIBUTED,
    "stream": pb.TRANSFER_METHOD_STREAM,
    "disk": pb.TRANSFER_METHOD_DISK,
}
BACKEND_NAMES = {pb.COLLECTIVE_BACKEND_GLOO: "gloo", pb.COLLECTIVE_BACKEND_NCCL: "nccl"}
# A rejected stream is read on (and dropped) for at most this many messages before the status
# goes out: a grpc.aio client still writing when it arrives would otherwise report INTERNAL
# instead of our status (grpc/grpc#36066).
_DRAIN_MESSAGES = 1 << 16


@dataclass
class WeightSyncConfig:
    """What a rollout server accepts for weight updates."""

    # Directory under which UpdateFromDisk paths must lie; None disables DISK.
    disk_root: str | None = None
    # Methods this server accepts ("distributed", "stream", "disk").
    methods: tuple[str, ...] = ("distributed", "stream", "disk")
    # Largest PushWeights chunk accepted (the contract caps it at 1 MiB).
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    # Largest state dict accepted by any method (bounds what a sender can make us allocate).
    max_total_bytes: int = tc.DEFAULT_MAX_BYTES
    # Collective backends for DISTRIBUTED; None: gloo, plus nccl when CUDA is available (the
    # sglang engine: nccl only, SGLang's weight groups are NCCL).
    backends: tuple[str, ...] | None = None
    # Seconds a group rendezvous or one broadcast may take before the update fails.
    group_timeout_s: float = 300.0
    # Plans remembered (oldest forgotten first; a sender renegotiates per update anyway).
    max_plans: int = 256
    # Keep the weights an update replaces as the next update's receive buffers (STREAM and
    # DISTRIBUTED): no fresh memory to allocate and fault in per update, at the price of a
    # second copy of the weights held between updates (engines that take received tensors
    # over only; a transient second copy exists during every update anyway).
    reuse_buffers: bool = True


@dataclass
class _Plan:
    plan_id: str
    option: pb.TransferOption
    sender_id: str = ""
    group: GroupParams | None = None


@dataclass
class _Counters:
    updates: int = 0
    refused: int = 0
    last_method: str = ""
    by_method: dict[str, int] = field(default_factory=dict)


def _is_sglang(engine: InferenceEngine) -> bool:
    return engine.kind == "sglang" and hasattr(engine, "update_weights_from_distributed")


class WeightSyncServicer(weight_sync_pb2_grpc.WeightSyncServiceServicer):
    """The handlers of ``arealgrpc.v1.WeightSyncService`` over one inference engine."""

    def __init__(self, engine: InferenceEngine, config: WeightSyncConfig | None = None) -> None:
        self.engine = engine
        self.config = config or WeightSyncConfig()
        unknown = set(self.config.methods) - set(METHOD_NAMES)
        if unknown:
            raise ValueError(f"unknown weight-sync methods {sorted(unknown)}")
        if self.config.max_chunk_bytes > MAX_CHUNK_BYTES or self.config.max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be in 1..{MAX_CHUNK_BYTES}")
        self._sglang = _is_sglang(engine)
        if self.config.backends is not None:
            self.backends = tuple(self.config.backends)
        elif self._sglang:
            self.backends = ("nccl",)
        else:
            self.backends = ("gloo", "nccl") if torch.cuda.is_available() else ("gloo",)
        self._plans: OrderedDict[str, _Plan] = OrderedDict()
        self._update_lock = asyncio.Lock()
        self._group: WeightGroup | None = None
        # For the sglang engine: the group SGLang was told to join.
        self._sglang_group: GroupParams | None = None
        self.counters = _Counters()
        # Receive buffers for the next update, by tensor name (see reuse_buffers).
        self._spare: dict[str, torch.Tensor] = {}
        if "stream" in self.config.methods:
            # Each PushWeights message is a ~1 MiB buffer allocated and freed in turn; keep
            # freed ones mapped instead of faulting fresh pages in for every message.
            tune_malloc()

    async def _load(
        self, state_dict: dict[str, torch.Tensor], version: int, keep_spare: bool = True
    ) -> None:
        """Swaps a freshly received state dict in, handed over to the engine.

        The tensors every data plane here builds (reassembled chunks, loaded safetensors,
        broadcast buffers) are fresh and private, so the engine may keep them uncopied.
        ``keep_spare``: keep the replaced weights as the next update's receive buffers.
        """
        spare = await self.engine.load_weights(state_dict, version, owned=True)
        self._spare = spare if keep_spare and self.config.reuse_buffers else {}

    # ------------------------------------------------------------------------ negotiation

    def supported(self) -> list[str]:
        """What this server accepts, in words (quoted in FAILED_PRECONDITION answers)."""
        out = []
        for name in self.config.methods:
            if name == "stream":
                out.append(f"TRANSFER_METHOD_STREAM (chunks <= {self.config.max_chunk_bytes} B)")
            elif name == "disk" and self.config.disk_root:
                out.append(f"TRANSFER_METHOD_DISK (root {self.config.disk_root})")
            elif name == "distributed" and self.backends:
                out.append(f"TRANSFER_METHOD_DISTRIBUTED (backends {', '.join(self.backends)})")
        return out

    def _accept(
        self, i: int, offer: pb.TransferOption, declined: list[str]
    ) -> pb.TransferOption | None:
        """The plan for one offer, None when this server does not take it; FieldError if bad.

        Offers this server could take but passes over are explained in ``declined``.
        """
        where = f"offers[{i}]"
        m = offer.method
        if m == pb.TRANSFER_METHOD_UNSPECIFIED or m not in pb.TransferMethod.values():
            raise FieldError(f"{where}.method", f"unknown or unspecified method {m}")
        if m == pb.TRANSFER_METHOD_STREAM:
            if "stream" not in self.config.methods:
                return None
            asked = offer.stream.max_chunk_bytes if offer.HasField("stream") else 0
            if asked < 0:
                raise FieldError(f"{where}.stream.max_chunk_bytes", f"is negative ({asked})")
            chunk = min(asked or self.config.max_chunk_bytes, self.config.max_chunk_bytes)
            return pb.TransferOption(method=m, stream=pb.StreamParams(max_chunk_bytes=chunk))
        if m == pb.TRANSFER_METHOD_DISK:
            if "disk" not in self.config.methods or not self.config.disk_root:
                return None
            root = str(Path(self.config.disk_root).resolve())
            return pb.TransferOption(method=m, disk=pb.DiskParams(root=root))
        # DISTRIBUTED
        if "distributed" not in self.config.methods:
            return None
        if not offer.HasField("distributed"):
            raise FieldError(f"{where}.distributed", "is required for TRANSFER_METHOD_DISTRIBUTED")
        d = offer.distributed
        backend = BACKEND_NAMES.get(d.backend)
        if backend is None:
            raise FieldError(f"{where}.distributed.backend", f"unknown backend {d.backend}")
        if backend not in self.backends:
            return None
        if backend == "nccl" and not self._sglang and d.device_uuid:
            mine = cuda_uuid(self._nccl_device())
            if d.device_uuid == mine:
                # NCCL refuses two ranks on one GPU: let a later offer (STREAM, DISK) win.
                declined.append(
                    f"{where}: NCCL from a sender on this server's own GPU ({mine}); NCCL "
                    "cannot put two ranks on one GPU"
                )
                log.info(
                    "declining NCCL from %s: it is on this server's GPU (%s)",
                    d.master_address,
                    mine,
                )
                return None
        w = f"{where}.distributed"
        if not d.master_address:
            raise FieldError(f"{w}.master_address", "must not be empty")
        if not 0 < d.master_port < 65536:
            raise FieldError(f"{w}.master_port", f"must be in 1..65535, got {d.master_port}")
        if d.world_size < 2:
            raise FieldError(f"{w}.world_size", f"must be >= 2, got {d.world_size}")
        if not 0 < d.rank_offset < d.world_size:
            raise FieldError(
                f"{w}.rank_offset", f"must be in 1..{d.world_size - 1}, got {d.rank_offset}"
            )
        if not d.group_name:
            raise FieldError(f"{w}.group_name", "must not be empty")
        if d.bucket_bytes < 0:
            raise FieldError(f"{w}.bucket_bytes", f"is negative ({d.bucket_bytes})")
        params = self._group_params(d)
        current = self._sglang_group if self._sglang else (self._group and self._group.params)
        plan = pb.DistributedParams()
        plan.CopyFrom(d)
        plan.joined = current == params
        return pb.TransferOption(method=m, distributed=plan)

    def _nccl_device(self) -> torch.device:
        """The GPU NCCL receives on: the engine's when it runs on one, else the current one."""
        device = getattr(self.engine, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            return device
        return torch.device("cuda", torch.cuda.current_device())

    def _group_params(self, d: pb.DistributedParams) -> GroupParams:
        backend = BACKEND_NAMES[d.backend]
        return GroupParams(
            master_address=d.master_address,
            master_port=d.master_port,
            world_size=d.world_size,
            rank=d.rank_offset,
            group_name=d.group_name,
            backend=backend,
            timeout_s=self.config.group_timeout_s,
            device=str(self._nccl_device()) if backend == "nccl" and not self._sglang else "",
        )

    async def Negotiate(
        self, request: pb.NegotiateRequest, context: grpc.aio.ServicerContext
    ) -> pb.NegotiateResponse:
        """The first offered method this server accepts, with its own parameters."""
        try:
            if not request.offers:
                raise FieldError("offers", "must offer at least one method")
            plan_option = None
            declined: list[str] = []
            for i, offer in enumerate(request.offers):
                plan_option = self._accept(i, offer, declined)
                if plan_option is not None:
                    break
        except FieldError as exc:
            await abort_with(context, invalid_argument(exc))
        if plan_option is None:
            offered = ", ".join(pb.TransferMethod.Name(o.method) for o in request.offers)
            await abort_with(
                context,
                status(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"none of the offered methods ({offered}) is acceptable; this server "
                    f"supports: {'; '.join(self.supported()) or 'nothing'}"
                    + "".join(f"; declined {d}" for d in declined),
                ),
            )
        assert plan_option is not None
        plan = _Plan(uuid.uuid4().hex, plan_option, request.sender_id)
        if plan_option.method == pb.TRANSFER_METHOD_DISTRIBUTED:
            plan.group = self._group_params(plan_option.distributed)
        self._plans[plan.plan_id] = plan
        while len(self._plans) > self.config.max_plans:
            self._plans.popitem(last=False)
        log.info(
            "plan %s for %s: %s",
            plan.plan_id,
            request.sender_id or "?",
            pb.TransferMethod.Name(plan_option.method),
        )
        return pb.NegotiateResponse(
            plan=plan_option, policy_version=self.engine.version, plan_id=plan.plan_id
        )

    def _plan(self, plan_id: str, method: int, required: bool) -> _Plan | None:
        """The plan ``plan_id`` names (None when empty and optional); PreconditionError else."""
        if not plan_id:
            if required:
                raise FieldError("plan_id", "must name a plan from Negotiate")
            return None
        plan = self._plans.get(plan_id)
        if plan is None:
            raise PreconditionError(f"plan_id {plan_id!r} is unknown here: negotiate again")
        if plan.option.method != method:
            raise FieldError(
                "plan_id",
                f"names a {pb.TransferMethod.Name(plan.option.method)} plan, "
                f"not {pb.TransferMethod.Name(method)}",
            )
        return plan

    def _check_version(self, version: int, where: str = "policy_version") -> None:
        if version <= 0:
            raise FieldError(where, f"must be > 0, got {version}")
        if version <= self.engine.version:
            raise PreconditionError(
                f"{where} {version} is not newer than the served version {self.engine.version}"
            )

    def _count(self, method: str, ok: bool) -> None:
        if ok:
            self.counters.updates += 1
            self.counters.last_method = method
            self.counters.by_method[method] = self.counters.by_method.get(method, 0) + 1
        else:
            self.counters.refused += 1

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
        self._count("", ok=False)
        await abort_for(context, exc)

    # ---------------------------------------------------------------------------- stream

    async def PushWeights(
        self, request_iterator: AsyncIterator[PushMessage], context: grpc.aio.ServicerContext
    ) -> pb.PushWeightsResponse:
        """Stages the streamed state dict, then swaps it in atomically."""
        try:
            header, state_dict, received = await self._read_stream(request_iterator)
        except (FieldError, PreconditionError) as exc:
            drained = 0
            async for _ in request_iterator:
                drained += 1
                if drained >= _DRAIN_MESSAGES:
                    break
            await self._fail(context, exc)
        try:
            async with self._update_lock:
                self._check_version(header.policy_version, "header.policy_version")
                await self._load(state_dict, header.policy_version)
        except Exception as exc:
            self._give_back(state_dict)  # not installed: still free to receive into
            await self._fail(context, exc)
        self._count("stream", ok=True)
        return pb.PushWeightsResponse(
            policy_version=self.engine.version,
            tensor_count=len(state_dict),
            received_bytes=received,
        )

    async def _read_stream(
        self, requests: AsyncIterator[PushMessage]
    ) -> tuple[pb.PushWeightsHeader, dict[str, torch.Tensor], int]:
        first = None
        async for msg in requests:
            first = msg
            break
        if not isinstance(first, pb.PushWeightsRequest) or not first.HasField("header"):
            raise FieldError("header", "the stream must start with a PushWeightsHeader")
        header = first.header
        plan = self._plan(header.plan_id, pb.TRANSFER_METHOD_STREAM, required=False)
        max_chunk = self.config.max_chunk_bytes
        if plan is not None:
            max_chunk = plan.option.stream.max_chunk_bytes or max_chunk
        # Refuse a stale version before reading (and allocating) anything.
        self._check_version(header.policy_version, "header.policy_version")
        if header.tensor_count == 0:
            raise FieldError("header.tensor_count", "must be >= 1")
        if header.total_bytes > self.config.max_total_bytes:
            raise FieldError(
                "header.total_bytes",
                f"{header.total_bytes} exceeds this server's limit {self.config.max_total_bytes}",
            )
        asm = StateDictAssembler(
            expected_tensors=header.tensor_count,
            max_total_bytes=header.total_bytes,
            buffers=self._spare,
        )
        try:
            await self._read_chunks(requests, asm, max_chunk)
            state_dict = asm.finish()
            if len(state_dict) != header.tensor_count:
                raise FieldError(
                    "header.tensor_count",
                    f"announced {header.tensor_count} tensors, {len(state_dict)} arrived",
                )
            if asm.total_bytes != header.total_bytes:
                raise FieldError(
                    "header.total_bytes",
                    f"announced {header.total_bytes} bytes, the tensors hold {asm.total_bytes}",
                )
        except BaseException:
            self._give_back(asm.taken)  # a broken stream: the buffers hold nothing served
            raise
        # Every chunk's data landed in a tensor: the bytes received are the tensors' bytes.
        return header, state_dict, asm.total_bytes

    async def _read_chunks(
        self, requests: AsyncIterator[PushMessage], asm: StateDictAssembler, max_chunk: int
    ) -> None:
        async for msg in requests:
            if isinstance(msg, pb.PushWeightsRequest):
                if msg.HasField("header"):
                    raise FieldError("header", "sent twice")
                if not msg.HasField("chunk"):
                    raise FieldError("kind", "empty message: set header or chunk")
                chunk: ChunkLike = msg.chunk
            else:
                chunk = msg
            n = len(chunk.data)
            if n > max_chunk:
                raise FieldError(
                    f"{tc.tensor_label(chunk.name)}.chunk[{chunk.chunk_index}].data",
                    f"{n} bytes exceed the plan's max_chunk_bytes {max_chunk}",
                )
            asm.add(chunk)

    def _give_back(self, buffers: dict[str, torch.Tensor]) -> None:
        """Returns receive buffers no update installed to the spare ones."""
        if self.config.reuse_buffers:
            for name, t in buffers.items():
                self._spare.setdefault(name, t)

    # ------------------------------------------------------------------------------ disk

    async def UpdateFromDisk(
        self, request: pb.UpdateFromDiskRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateFromDiskResponse:
        """Loads a safetensors directory from under this server's root."""
        try:
            self._plan(request.plan_id, pb.TRANSFER_METHOD_DISK, required=False)
            root = self.config.disk_root
            if "disk" not in self.config.methods or not root:
                raise PreconditionError("this server takes no disk updates (no disk root)")
            self._check_version(request.policy_version)
            directory = resolve_confined(root, request.path, "path")
            async with self._update_lock:
                self._check_version(request.policy_version)
                if self._sglang:
                    await self.engine.update_weights_from_disk(  # type: ignore[attr-defined]
                        str(directory), request.policy_version
                    )
                    count = 0
                else:
                    # Mapped, not copied: nothing to receive into (see the module docstring).
                    state_dict = await asyncio.to_thread(load_version, root, str(directory))
                    # The weights a DISK update replaces may themselves be mapped files: as
                    # receive buffers they would only copy-on-write, so they are let go.
                    await self._load(state_dict, request.policy_version, keep_spare=False)
                    count = len(state_dict)
        except Exception as exc:
            await self._fail(context, exc)
        self._count("disk", ok=True)
        return pb.UpdateFromDiskResponse(policy_version=self.engine.version, tensor_count=count)

    # ----------------------------------------------------------------------- distributed

    def _check_specs(self, request: pb.UpdateFromDistributedRequest) -> list[int]:
        if not request.tensors:
            raise FieldError("tensors", "must list at least one tensor")
        if request.bucket_bytes < 0:
            raise FieldError("bucket_bytes", f"is negative ({request.bucket_bytes})")
        seen: set[str] = set()
        sizes = []
        total = 0
        for i, spec in enumerate(request.tensors):
            if not spec.name:
                raise FieldError(f"tensors[{i}].name", "must not be empty")
            if spec.name in seen:
                raise FieldError(f"tensors[{i}].name", f"duplicate tensor {spec.name!r}")
            seen.add(spec.name)
            for k, d in enumerate(spec.shape):
                if d < 0:
                    raise FieldError(f"tensors[{i}].shape[{k}]", f"is negative ({d})")
            try:
                n = spec_nbytes(spec)
            except FieldError:
                raise FieldError(f"tensors[{i}].dtype", f"unknown dtype {spec.dtype}") from None
            total += n
            if total > self.config.max_total_bytes:
                raise FieldError("tensors", f"exceed this server's {self.config.max_total_bytes} B")
            sizes.append(n)
        return sizes

    def _ensure_group(self, params: GroupParams, abandoned: threading.Event) -> WeightGroup:
        """The group of ``params``: the current one, or a freshly joined one (blocking)."""
        if self._group is not None and self._group.params == params:
            return self._group
        if self._group is not None:
            self._group.close()
            self._group = None
        log.info(
            "joining weight group %s at %s:%d as rank %d/%d (%s)",
            params.group_name,
            params.master_address,
            params.master_port,
            params.rank,
            params.world_size,
            params.backend,
        )
        group = WeightGroup(params)
        if abandoned.is_set():
            # The update was given up while this thread waited in the rendezvous.
            group.close()
            raise RuntimeError(f"weight group {params.group_name} was abandoned")
        self._group = group
        log.info("joined weight group %s as rank %d", params.group_name, params.rank)
        return group

    def _receive(
        self,
        params: GroupParams,
        specs: Sequence[tuple[str, torch.dtype, list[int]]],
        abandoned: threading.Event,
    ) -> dict[str, torch.Tensor]:
        group = self._ensure_group(params, abandoned)
        out: dict[str, torch.Tensor] = {}
        try:
            for name, dtype, shape in specs:
                t = self._spare.pop(name, None)
                if t is None or not tc.fits_buffer(t, dtype, shape, group.device):
                    t = torch.empty(shape, dtype=dtype, device=group.device)
                group.broadcast(t, src=0)
                out[name] = t
        except Exception:
            # A failed collective leaves the group unusable; the next plan forms a new one.
            group.close()
            if self._group is group:
                self._group = None
            raise
        return out

    async def UpdateFromDistributed(
        self, request: pb.UpdateFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateFromDistributedResponse:
        """Takes part in the sender's broadcasts, then swaps the received weights in."""
        try:
            plan = self._plan(request.plan_id, pb.TRANSFER_METHOD_DISTRIBUTED, required=True)
            assert plan is not None and plan.group is not None
            sizes = self._check_specs(request)
            if request.policy_version <= 0:
                raise FieldError("policy_version", f"must be > 0, got {request.policy_version}")
            async with self._update_lock:
                if self._sglang:
                    count = await self._sglang_distributed(plan, request, sizes)
                else:
                    specs = [
                        (s.name, tc.dtype_from_proto(s.dtype), [int(d) for d in s.shape])
                        for s in request.tensors
                    ]
                    # Stale or not, this rank takes part in every broadcast the sender makes,
                    # so the collective never hangs on a refusal; a stale update is dropped.
                    state_dict = await self._receive_or_abandon(plan.group, specs)
                    self._check_version(request.policy_version)
                    await self._load(state_dict, request.policy_version)
                    count = len(state_dict)
        except Exception as exc:
            await self._fail(context, exc)
        self._count("distributed", ok=True)
        return pb.UpdateFromDistributedResponse(
            policy_version=self.engine.version, tensor_count=count
        )

    async def _receive_or_abandon(
        self, params: GroupParams, specs: Sequence[tuple[str, torch.dtype, list[int]]]
    ) -> dict[str, torch.Tensor]:
        """The broadcast tensors; if the sender cancels the call, the group is dropped at once.

        The sender cancels when another member of the group died: a gloo rendezvous or
        broadcast waiting on a dead peer only ends at the group timeout, so the thread is left
        to end by itself (it closes its group then) while this server goes on with the next
        update, which forms a new group.
        """
        abandoned = threading.Event()
        work = run_in_thread(lambda: self._receive(params, specs, abandoned), "weight-receive")
        try:
            return await work
        except asyncio.CancelledError:
            abandoned.set()
            if self._group is not None and self._group.params == params:
                # Not closed here: its collective may still block in that thread.
                self._group = None
            log.warning("weight group %s abandoned: the sender cancelled", params.group_name)
            raise

    async def _sglang_distributed(
        self, plan: _Plan, request: pb.UpdateFromDistributedRequest, sizes: list[int]
    ) -> int:
        """Translates the update into SGLang's HTTP calls (SGLang joins the group itself)."""
        engine = self.engine
        params = plan.group
        assert params is not None
        # Refused before SGLang is told anything: SGLang cannot receive and drop. The sender
        # checks the version from Negotiate first, so this is a race between two senders.
        self._check_version(request.policy_version)
        if self._sglang_group != params:
            await engine.init_weights_update_group(  # type: ignore[attr-defined]
                master_address=params.master_address,
                master_port=params.master_port,
                rank_offset=params.rank,
                world_size=params.world_size,
                group_name=params.group_name,
                backend=params.backend,
            )
            self._sglang_group = params
        buckets = plan_buckets(sizes, request.bucket_bytes)
        for b, bucket in enumerate(buckets):
            specs = [request.tensors[i] for i in bucket]
            await engine.update_weights_from_distributed(  # type: ignore[attr-defined]
                names=[s.name for s in specs],
                dtypes=[str(tc.dtype_from_proto(s.dtype)).removeprefix("torch.") for s in specs],
                shapes=[[int(d) for d in s.shape] for s in specs],
                group_name=params.group_name,
                version=request.policy_version if b == len(buckets) - 1 else None,
            )
        return len(request.tensors)

    async def close(self) -> None:
        """Leaves the weight group, if any."""
        if self._group is not None:
            self._group.close()
            self._group = None


def build_weight_sync_service(
    engine: InferenceEngine, cfg: WeightSyncConfig | None = None
) -> Service:
    """The WeightSyncService of a rollout server, ready for ``start_server``.

    ``PushWeights`` is registered with the codec's fast chunk decoder (chunk data sliced out of
    the received bytes without a copy); the other methods use the generated messages.
    """
    servicer = WeightSyncServicer(engine, cfg)
    handlers = {
        "Negotiate": grpc.unary_unary_rpc_method_handler(
            servicer.Negotiate,
            request_deserializer=pb.NegotiateRequest.FromString,
            response_serializer=pb.NegotiateResponse.SerializeToString,
        ),
        "PushWeights": grpc.stream_unary_rpc_method_handler(
            servicer.PushWeights,
            request_deserializer=decode_push_request,
            response_serializer=pb.PushWeightsResponse.SerializeToString,
        ),
        "UpdateFromDisk": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateFromDisk,
            request_deserializer=pb.UpdateFromDiskRequest.FromString,
            response_serializer=pb.UpdateFromDiskResponse.SerializeToString,
        ),
        "UpdateFromDistributed": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateFromDistributed,
            request_deserializer=pb.UpdateFromDistributedRequest.FromString,
            response_serializer=pb.UpdateFromDistributedResponse.SerializeToString,
        ),
    }

    def add(svc: WeightSyncServicer, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )

    return Service(name=SERVICE_NAME, servicer=servicer, add=add)


__all__ = [
    "METHOD_NAMES",
    "WeightSyncConfig",
    "WeightSyncServicer",
    "build_weight_sync_service",
]
