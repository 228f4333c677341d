"""Runs inside vLLM's model worker process: how a weight update reaches the served model.

vLLM imports this module in its worker (named by ``worker_extension_cls``) and mixes
:class:`WorkerExtension` into its worker class; the ``vllm`` engine calls these methods
through ``collective_rpc``. Nothing of ours but this module is imported there.

Why the layerwise reload and not our own copy into the parameters: vLLM's CPU backend repacks
each linear layer's weight when the model loads (oneDNN handles, packed GEMM weights) and
serves from the packed form, so writing into ``parameter.data`` changes nothing that is
served. ``reload_weights(..., is_checkpoint_format=True)`` re-runs the model's own loader and
the per-layer processing, on every backend (and on a GPU too).

A DISTRIBUTED update is received here, in the worker, not in the rollout server: the worker
joins the sender's weight group itself (:class:`WorkerGroup`, as SGLang does) and the
broadcast lands in the worker's own buffers, on its own device. On a GPU that is NCCL from
the trainer's GPU straight into vLLM's, with no trip through host memory. vLLM's own NCCL
weight-transfer engine is not used: its group forms through vLLM's ``StatelessProcessGroup``
or a raw NCCL unique id with vLLM's own handshake, and the contract's DISTRIBUTED plan is a
torch.distributed group (``WeightGroup``) that every sender already speaks. The receive
runs on a thread of the worker, so vLLM goes on generating meanwhile; the reload happens only
once every tensor has arrived, so a broken transfer leaves the old weights serving.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from areal_grpc import tensor_codec as tc
from areal_grpc.weight_transfer import BufferSource, GroupMember, GroupParams, cuda_uuid

__all__ = ["WorkerExtension", "WorkerGroup"]


# Layers that hold no tensor of the checkpoint (a rotary cache; the output head of a model with
# tied embeddings): vLLM's reload warns "Failed to load weights" for them on every update.
WEIGHTLESS_LAYERS = frozenset({"RotaryEmbedding", "ParallelLMHead"})


class _WeightlessLayerFilter(logging.Filter):
    """Drops the reload's warning for :data:`WEIGHTLESS_LAYERS` (an update is checked to
    bring every checkpoint tensor before it reaches the worker, so the warning says nothing
    there); the warning for any other layer still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        return record.args[0] not in WEIGHTLESS_LAYERS  # type: ignore[index]


def _quiet_weightless_layers() -> None:
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _WeightlessLayerFilter) for f in log.filters):
        log.addFilter(_WeightlessLayerFilter())


class WorkerGroup:
    """The worker's side of DISTRIBUTED updates: its membership of the sender's weight group
    (:class:`GroupMember`), the receive on a thread, and the buffers the broadcast lands in
    (kept for the next update when asked, so no update allocates and faults in fresh
    memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.member = GroupMember("vLLM worker ")
        self.buffers: dict[str, torch.Tensor] = {}
        self.received: dict[str, torch.Tensor] | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._abandoned = threading.Event()

    def start(self, params: GroupParams, specs: list[tuple[str, torch.dtype, list[int]]]) -> None:
        """Starts taking the sender's broadcast of ``specs`` on a thread; returns at once."""
        if self._thread is not None and self._thread.is_alive() and not self._abandoned.is_set():
            raise RuntimeError("a weight-group receive is already under way in vLLM's worker")
        self._abandoned = threading.Event()
        self.received = None
        self.error = None
        # The thread owns these buffers until it hands them over (or is abandoned with them).
        kept, self.buffers = self.buffers, {}
        self._thread = threading.Thread(
            target=self._receive,
            args=(params, specs, functools.partial(tc.take_buffer, kept), self._abandoned),
            name="areal-weight-receive",
            daemon=True,
        )
        self._thread.start()

    def _receive(
        self,
        params: GroupParams,
        specs: list[tuple[str, torch.dtype, list[int]]],
        buffer: BufferSource,
        abandoned: threading.Event,
    ) -> None:
        try:
            out = self.member.receive(params, specs, buffer, abandoned)
        except Exception as exc:
            if not abandoned.is_set():
                self.error = f"{type(exc).__name__}: {exc}"
            return
        if not abandoned.is_set():
            self.received = out

    def poll(self) -> tuple[str, str]:
        """("running", ""), ("done", ""), or ("failed", why)."""
        if self._thread is not None and self._thread.is_alive():
            return "running", ""
        if self.error is not None:
            return "failed", self.error
        if self.received is None:
            return "failed", "no weight-group receive was started or it was given up"
        return "done", ""

    def abandon(self) -> None:
        """Gives the receive under way up: its collective ends by itself at the group
        timeout, and the next update joins a new group with fresh buffers."""
        self._abandoned.set()
        self.member.abandon()
        self.received = None

    def take(self, keep: bool) -> Iterable[tuple[str, torch.Tensor]]:
        """The received tensors (once); ``keep``: receive the next update into them."""
        received, self.received = self.received, None
        if received is None:
            raise RuntimeError("no received weights to load")
        self.buffers = received if keep else {}
        return received.items()


class WorkerExtension:
    """Methods of ours on vLLM's worker (``self`` is the worker: ``self.model_runner``)."""

    model_runner: Any
    _areal_group: WorkerGroup | None = None

    def areal_load_weights(self, path: str) -> int:
        """Loads the checkpoint-format safetensors file at ``path`` into the served model;
        the number of tensors read."""
        return self.areal_load_files([path], [])

    def areal_load_files(self, paths: list[str], skip: list[str]) -> int:
        """Loads the checkpoint-format safetensors files at ``paths`` (but the tensors named
        in ``skip``) into the served model; the number of tensors read."""
        count = 0
        skipped = set(skip)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for path in paths:
                with safe_open(path, "pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        if name in skipped:
                            continue
                        count += 1
                        yield name, f.get_tensor(name)

        self._reload(tensors())
        return count

    def _reload(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        _quiet_weightless_layers()
        self.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        self._retie_output_head()

    def _weight_group(self) -> WorkerGroup:
        if self._areal_group is None:
            self._areal_group = WorkerGroup(torch.device(self.model_runner.device))
        return self._areal_group

    def areal_device_uuid(self) -> str:
        """This worker's GPU's UUID ("" on a CPU)."""
        return cuda_uuid(self.model_runner.device)

    def areal_group_receive(self, group: dict[str, Any], specs: list[list[Any]]) -> None:
        """Starts receiving a DISTRIBUTED update: joins the weight group ``group``
        (:class:`GroupParams` fields; the device is this worker's) unless already in it, and
        takes the broadcast of ``specs`` ([name, dtype name, shape] in order) on a thread.
        Returns at once: :meth:`areal_group_poll` says when it is done."""
        rx = self._weight_group()
        device = str(rx.device) if group["backend"] == "nccl" else ""
        params = GroupParams(**{**group, "device": device})
        rx.start(params, [(n, getattr(torch, d), [int(x) for x in shape]) for n, d, shape in specs])

    def areal_group_poll(self) -> list[str]:
        """[state, why]: "running", "done", or "failed" with the reason."""
        return list(self._weight_group().poll())

    def areal_group_abandon(self) -> None:
        """Gives the receive under way up (the sender cancelled the update)."""
        self._weight_group().abandon()

    def areal_group_load(self, skip: list[str], keep: bool) -> int:
        """Loads the received tensors (but those named in ``skip``) into the served model
        through the layerwise reload; the number loaded. ``keep``: the next update is
        received into the same buffers."""
        skipped = set(skip)
        tensors = [(n, t) for n, t in self._weight_group().take(keep) if n not in skipped]
        self._reload(tensors)
        return len(tensors)

    def _retie_output_head(self) -> None:
        """Re-processes a tied output head after a reload.

        With tied embeddings the head shares the embedding's weight, which the reload updates
        in place; but the head loads no weight of its own, so the reload puts its previous
        kernel state back, and on the CPU that is a GEMM handle packed from the old weight.
        Measured on SmolLM2: without this, halving the embedding left the head's logits as
        they were (log-prob -1.28 where transformers gives -4.93).
        """
        model = self.model_runner.get_model()
        config = self.model_runner.model_config.hf_config
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if head is not None and method is not None and getattr(config, "tie_word_embeddings", 0):
            method.process_weights_after_loading(head)

    def areal_idle_spin(self, seconds: float) -> int:
        """Makes this worker sleep on its message queue after ``seconds`` without a message;
        the number of queues changed (0: this vLLM has none of the kind, nothing changed).

        vLLM's shared-memory queue keeps a reader spinning (``sched_yield`` in a loop) for
        ``SpinCondition.busy_loop_s`` = 1 s after each message, and no setting reaches it.
        Every health ping and every end of generation so cost the worker a second of a core,
        which a trainer on the same cores loses.
        """
        import gc

        try:
            from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        except ImportError:
            return 0
        changed = 0
        for obj in gc.get_objects():
            # type(), not isinstance(): the latter reads __class__, which some deprecated
            # torch objects warn about.
            if type(obj) is SpinCondition and obj.is_reader:
                obj.busy_loop_s = seconds
                changed += 1
        return changed

    def areal_ping(self) -> bool:
        """Answers: the worker is alive and between steps."""
        return True
