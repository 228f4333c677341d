"""What every receiving method shares: the server's config, state, plans and the interface."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from areal_servers.rollout.engine import InferenceEngine
from arealgrpc.v1 import tensor_pb2, weight_sync_pb2

from areal_grpc import tensor_codec as tc
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.security import ServerTls
from areal_grpc.weight_disk import prune_versions, write_version
from areal_grpc.weight_transfer import MAX_CHUNK_BYTES, GroupParams, spec_nbytes

__all__ = [
    "Plan",
    "Receiver",
    "ReceiverConfig",
    "ReceiverState",
    "check_dtype",
    "check_specs",
]

pb = weight_sync_pb2


@dataclass
class ReceiverConfig:
    """What a rollout server accepts for weight updates: the run's weight_sync methods and
    disk root, this server's socket interface and TLS, and the receiving side's own limits."""

    # Directory under which UpdateFromDisk paths must lie; None disables DISK.
    disk_root: str | None = None
    # Methods this server accepts ("distributed", "stream", "disk", "socket", "shared_memory").
    methods: tuple[str, ...] = ("distributed", "stream", "disk", "socket", "shared_memory")
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
    # SOCKET: the interface its per-plan listeners bind (None: SOCKET is not offered). A
    # wildcard address is announced as "" (the sender connects to the host it reached this
    # server at).
    socket_host: str | None = None
    # SOCKET: the server's own TLS (certificate, client CA). Set, the side channel speaks TLS
    # with it and plaintext offers are declined; a server serving gRPC over TLS sets it.
    socket_tls: ServerTls | None = None
    # SOCKET: the largest frame accepted.
    max_frame_bytes: int = 64 << 20
    # SOCKET: listeners of plans not yet used, at most (the oldest is closed first).
    max_socket_listeners: int = 8
    # SHARED_MEMORY: the directory senders on this host write into (None: not offered).
    shm_base: str | None = "/dev/shm"
    # Keep the weights an update replaces as the next update's receive buffers (STREAM and
    # DISTRIBUTED): no fresh memory to allocate and fault in per update, at the price of a
    # second copy of the weights held between updates (engines that take received tensors
    # over only; a transient second copy exists during every update anyway).
    reuse_buffers: bool = True


@dataclass
class Plan:
    """A transfer agreed with a sender by ``Negotiate``."""

    plan_id: str
    option: weight_sync_pb2.TransferOption
    sender_id: str = ""
    group: GroupParams | None = None
    # Relay: the update is also written as a version directory here (this server's own
    # shared-memory directory) for the other servers of its host.
    relay_root: str | None = None


def check_dtype(where: str, dtype: torch.dtype, expected: torch.dtype | None) -> None:
    """FieldError at ``where`` for a floating-point dtype an ``expected``-dtype server refuses.

    float32 is taken too (converted on arrival, exact for any narrower expected dtype);
    another dtype would convert with a loss the sender did not choose (float16 into a bfloat16
    engine, or bfloat16 weights into a float32 one whose sender held more bits).
    """
    if expected is None or not dtype.is_floating_point or dtype in (expected, torch.float32):
        return
    name = str(dtype).removeprefix("torch.")
    want = str(expected).removeprefix("torch.")
    raise FieldError(
        where,
        f"is {name}: this server serves {want} weights and takes floating-point tensors in "
        f"{want} (its Negotiate reply's weights_dtype) or float32",
    )


def check_specs(
    tensors: Sequence[tensor_pb2.TensorSpec],
    max_total_bytes: int,
    expected: torch.dtype | None = None,
) -> list[int]:
    """The byte size of each announced tensor; FieldError naming the first bad one
    (``expected``: the server's weights dtype, see :func:`check_dtype`)."""
    if not tensors:
        raise FieldError("tensors", "must list at least one tensor")
    seen: set[str] = set()
    sizes = []
    total = 0
    for i, spec in enumerate(tensors):
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
        check_dtype(f"tensors[{i}].dtype", tc.dtype_from_proto(spec.dtype), expected)
        total += n
        if total > max_total_bytes:
            raise FieldError("tensors", f"exceed this server's {max_total_bytes} B")
        sizes.append(n)
    return sizes


def write_relay(root: str, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
    """``state_dict`` as version ``version`` under ``root``, the only version kept there (a
    server that maps the one before keeps its mapping)."""
    write_version(root, version, [state_dict], 1)
    prune_versions(root, 1)


def is_sglang(engine: InferenceEngine) -> bool:
    """Whether the engine is an SGLang server (it joins weight groups itself)."""
    return engine.kind == "sglang" and hasattr(engine, "receive_distributed")


def receives_in_worker(engine: InferenceEngine) -> bool:
    """Whether the engine's own worker joins weight groups and takes full DISTRIBUTED
    updates there (the vllm engine; adapter-only updates are received here)."""
    return hasattr(engine, "receive_group") and not engine.adapters_only


class ReceiverState:
    """The server's side of every update: engine, one-at-a-time lock, plans, spare buffers."""

    def __init__(self, engine: InferenceEngine, config: ReceiverConfig) -> None:
        self.engine = engine
        self.config = config
        self.sglang = is_sglang(engine)
        self.in_worker = receives_in_worker(engine)
        self.plans: OrderedDict[str, Plan] = OrderedDict()
        # Updates run one at a time.
        self.update_lock = asyncio.Lock()
        # Receive buffers for the next update, by tensor name (see reuse_buffers).
        self.spare: dict[str, torch.Tensor] = {}

    @property
    def expected_dtype(self) -> torch.dtype | None:
        """The floating-point dtype updates should bring (the engine's; None: any)."""
        return self.engine.weights_dtype

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """FieldError naming the first received tensor whose dtype this server refuses."""
        expected = self.expected_dtype
        for name, t in tensors.items():
            check_dtype(f"{tc.tensor_label(name)}.dtype", t.dtype, expected)

    def remember(self, plan: Plan) -> None:
        """Keeps ``plan`` (the oldest ones are forgotten past ``max_plans``)."""
        self.plans[plan.plan_id] = plan
        while len(self.plans) > self.config.max_plans:
            self.plans.popitem(last=False)

    def plan(self, plan_id: str, method: int, required: bool) -> Plan | None:
        """The plan ``plan_id`` names (None when empty and optional); PreconditionError else."""
        if not plan_id:
            if required:
                raise FieldError("plan_id", "must name a plan from Negotiate")
            return None
        plan = self.plans.get(plan_id)
        if plan is None:
            raise PreconditionError(f"plan_id {plan_id!r} is unknown here: negotiate again")
        if plan.option.method != method:
            raise FieldError(
                "plan_id",
                f"names a {pb.TransferMethod.Name(plan.option.method)} plan, "
                f"not {pb.TransferMethod.Name(method)}",
            )
        return plan

    def check_version(self, version: int, where: str = "policy_version") -> None:
        """FieldError unless ``version`` > 0; PreconditionError unless newer than the served."""
        if version <= 0:
            raise FieldError(where, f"must be > 0, got {version}")
        if version <= self.engine.version:
            raise PreconditionError(
                f"{where} {version} is not newer than the served version {self.engine.version}"
            )

    async def load(
        self,
        state_dict: dict[str, torch.Tensor],
        version: int,
        keep_spare: bool = True,
        relay_root: str | None = None,
    ) -> None:
        """Swaps a freshly received state dict in, handed over to the engine.

        The tensors every method here builds (reassembled chunks, loaded safetensors,
        broadcast buffers) are fresh and private, so the engine may keep them uncopied.
        ``keep_spare``: keep the replaced weights as the next update's receive buffers.
        ``relay_root``: first write the update there as a version directory (the only one
        kept) for the other servers of this host; a failed write fails the update before
        anything is swapped in.
        """
        if relay_root is not None:
            await asyncio.to_thread(write_relay, relay_root, version, state_dict)
        spare = await self.engine.load_weights(state_dict, version, owned=True)
        self.spare = spare if keep_spare and self.config.reuse_buffers else {}

    def take_buffer(
        self,
        name: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """A receive buffer for ``name``: its spare one when that fits, else a fresh one."""
        return tc.take_buffer(self.spare, name, dtype, shape, device)

    def give_back(self, buffers: dict[str, torch.Tensor]) -> None:
        """Returns receive buffers no update installed to the spare ones."""
        if self.config.reuse_buffers:
            for name, t in buffers.items():
                self.spare.setdefault(name, t)


class Receiver(ABC):
    """One transfer method on the receiving side."""

    # The method's name in ReceiverConfig.methods, and its enum value.
    name: ClassVar[str]
    method: ClassVar[int]

    def __init__(self, state: ReceiverState) -> None:
        self.state = state

    @property
    def enabled(self) -> bool:
        """Whether this server takes updates by this method at all."""
        return self.name in self.state.config.methods

    @abstractmethod
    def accept(
        self, where: str, offer: weight_sync_pb2.TransferOption, declined: list[str]
    ) -> weight_sync_pb2.TransferOption | None:
        """The plan for ``offer`` (at ``where``), None when not taken; FieldError if malformed.

        Offers this server could take but passes over are explained in ``declined``.
        """

    @abstractmethod
    def supported(self) -> str | None:
        """What this method accepts here, in words (None: not offered by this server)."""

    @abstractmethod
    async def close(self) -> None:
        """Releases what the method holds between updates."""
