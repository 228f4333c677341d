"""DISTRIBUTED (``UpdateFromDistributed``): the sender announces names, dtypes, shapes and the
version, then broadcasts each tensor in order over a private process group (rank 0 = sender;
gloo on CPU, nccl on GPU). The group is joined on the first update of a plan and kept for
later ones. The ``sglang`` engine gets ``/init_weights_update_group`` and one
``/update_weights_from_distributed`` per bucket instead (SGLang joins the group itself); the
``vllm`` engine's worker joins it too and takes the broadcast on its own device
(``VLLMEngine.receive_group``), so this process never holds the tensors.

A sender that cancels an update (another member died) makes this server drop the group at
once; the blocked collective is left to its thread until the group timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

import torch
from areal_servers.rollout.receive.base import Plan, Receiver, ReceiverState, check_specs
from arealgrpc.v1 import weight_sync_pb2

from areal_grpc import tensor_codec as tc
from areal_grpc.errors import FieldError
from areal_grpc.weight_transfer import (
    GroupMember,
    GroupParams,
    WeightGroup,
    cuda_uuid,
    run_in_thread,
)

__all__ = ["BACKEND_NAMES", "DistributedReceiver"]

log = logging.getLogger(__name__)
pb = weight_sync_pb2
BACKEND_NAMES = {pb.COLLECTIVE_BACKEND_GLOO: "gloo", pb.COLLECTIVE_BACKEND_NCCL: "nccl"}

TensorSpecs = Sequence[tuple[str, torch.dtype, list[int]]]


class DistributedReceiver(Receiver):
    """Broadcasts over a torch.distributed group with the sender (or SGLang's own group)."""

    name = "distributed"
    method = pb.TRANSFER_METHOD_DISTRIBUTED

    def __init__(self, state: ReceiverState) -> None:
        super().__init__(state)
        if state.config.backends is not None:
            self.backends = tuple(state.config.backends)
        elif state.sglang:
            # SGLang forms the group itself: NCCL on a GPU, gloo on a CPU (or beside NCCL).
            self.backends = ("nccl", "gloo") if torch.cuda.is_available() else ("gloo",)
        else:
            self.backends = ("gloo", "nccl") if torch.cuda.is_available() else ("gloo",)
        # The group joined (kept between updates of the same plan parameters).
        self.member = GroupMember()

    def supported(self) -> str | None:
        if not self.enabled or not self.backends:
            return None
        return f"TRANSFER_METHOD_DISTRIBUTED (backends {', '.join(self.backends)})"

    def accept(
        self, where: str, offer: pb.TransferOption, declined: list[str]
    ) -> pb.TransferOption | None:
        if not self.enabled:
            return None
        if not offer.HasField("distributed"):
            raise FieldError(f"{where}.distributed", "is required for TRANSFER_METHOD_DISTRIBUTED")
        d = offer.distributed
        backend = BACKEND_NAMES.get(d.backend)
        if backend is None:
            raise FieldError(f"{where}.distributed.backend", f"unknown backend {d.backend}")
        if backend not in self.backends:
            return None
        if self.state.sglang and self.state.engine.adapters_only:
            declined.append(f"{where}: SGLang's distributed weight updates carry no LoRA adapters")
            return None
        if backend == "nccl" and not self.state.sglang and d.device_uuid:
            mine = self._device_uuid()
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
        params = self.group_params(d)
        if self.state.sglang:
            current = self.state.engine.group  # type: ignore[attr-defined]
        elif self.state.in_worker:
            current = self.state.engine.worker_group  # type: ignore[attr-defined]
        else:
            current = self.group and self.group.params
        plan = pb.DistributedParams()
        plan.CopyFrom(d)
        plan.joined = current == params
        return pb.TransferOption(method=self.method, distributed=plan)

    def _device_uuid(self) -> str:
        """The GPU an NCCL broadcast would land on here (its UUID)."""
        if self.state.in_worker:
            return str(self.state.engine.device_uuid)  # type: ignore[attr-defined]
        return cuda_uuid(self._nccl_device())

    def _nccl_device(self) -> torch.device:
        """The GPU NCCL receives on: the engine's when it runs on one, else the current one."""
        device = getattr(self.state.engine, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            return device
        return torch.device("cuda", torch.cuda.current_device())

    def group_params(self, d: pb.DistributedParams) -> GroupParams:
        """This server's side of the group ``d`` describes."""
        backend = BACKEND_NAMES[d.backend]
        return GroupParams(
            master_address=d.master_address,
            master_port=d.master_port,
            world_size=d.world_size,
            rank=d.rank_offset,
            group_name=d.group_name,
            backend=backend,
            timeout_s=self.state.config.group_timeout_s,
            device=(
                str(self._nccl_device())
                if backend == "nccl" and not (self.state.sglang or self.state.in_worker)
                else ""
            ),
        )

    def _check_specs(self, request: pb.UpdateFromDistributedRequest) -> list[int]:
        if request.bucket_bytes < 0:
            raise FieldError("bucket_bytes", f"is negative ({request.bucket_bytes})")
        return check_specs(
            request.tensors, self.state.config.max_total_bytes, self.state.expected_dtype
        )

    async def update(
        self, request: pb.UpdateFromDistributedRequest
    ) -> pb.UpdateFromDistributedResponse:
        """Takes part in the sender's broadcasts, then swaps the received weights in."""
        state = self.state
        plan = state.plan(request.plan_id, self.method, required=True)
        assert plan is not None and plan.group is not None
        self._check_specs(request)
        if request.policy_version <= 0:
            raise FieldError("policy_version", f"must be > 0, got {request.policy_version}")
        async with state.update_lock:
            if state.sglang:
                count = await self._sglang_update(plan, request)
            else:
                specs = [
                    (s.name, tc.dtype_from_proto(s.dtype), [int(d) for d in s.shape])
                    for s in request.tensors
                ]
                # Stale or not, this rank (or vLLM's worker) takes part in every broadcast
                # the sender makes, so the collective never hangs on a refusal; a stale
                # update is dropped.
                if state.in_worker:
                    engine = state.engine
                    await engine.receive_group(plan.group, specs)  # type: ignore[attr-defined]
                    state.check_version(request.policy_version)
                    count = await engine.load_received(  # type: ignore[attr-defined]
                        request.policy_version, keep=state.config.reuse_buffers
                    )
                else:
                    state_dict = await self._receive_or_abandon(plan.group, specs)
                    state.check_version(request.policy_version)
                    await state.load(state_dict, request.policy_version, relay_root=plan.relay_root)
                    count = len(state_dict)
        return pb.UpdateFromDistributedResponse(
            policy_version=state.engine.version, tensor_count=count
        )

    async def _receive_or_abandon(
        self, params: GroupParams, specs: TensorSpecs
    ) -> dict[str, torch.Tensor]:
        """The broadcast tensors; if the sender cancels the call, the group is dropped at once.

        The sender cancels when another member of the group died: a gloo rendezvous or
        broadcast waiting on a dead peer only ends at the group timeout, so the thread is left
        to end by itself (it closes its group then) while this server goes on with the next
        update, which forms a new group.
        """
        abandoned = threading.Event()
        work = run_in_thread(
            lambda: self.member.receive(params, specs, self.state.take_buffer, abandoned),
            "weight-receive",
        )
        try:
            return await work
        except asyncio.CancelledError:
            abandoned.set()
            self.member.abandon()
            log.warning("weight group %s abandoned: the sender cancelled", params.group_name)
            raise

    async def _sglang_update(self, plan: Plan, request: pb.UpdateFromDistributedRequest) -> int:
        """SGLang joins the group and takes the broadcasts itself (one call for every tensor:
        it loads them only once all have arrived)."""
        params = plan.group
        assert params is not None
        # Refused before SGLang is told anything: SGLang cannot receive and drop. The sender
        # checks the version from Negotiate first, so this is a race between two senders.
        self.state.check_version(request.policy_version)
        specs = [
            (s.name, tc.dtype_from_proto(s.dtype), [int(d) for d in s.shape])
            for s in request.tensors
        ]
        return int(
            await self.state.engine.receive_distributed(  # type: ignore[attr-defined]
                params, specs, request.policy_version
            )
        )

    @property
    def group(self) -> WeightGroup | None:
        """The weight group this server is in, if any."""
        return self.member.group

    async def close(self) -> None:
        self.member.close()
