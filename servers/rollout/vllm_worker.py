"""Runs inside vLLM's model worker process: how a weight update reaches the served model.

vLLM imports this module in its worker (named by ``worker_extension_cls``) and mixes
:class:`WorkerExtension` into its worker class; the ``vllm`` engine calls these methods
through ``collective_rpc``. Nothing of ours but this module is imported there.

Why the layerwise reload and not our own copy into the parameters: vLLM's CPU backend repacks
each linear layer's weight when the model loads (oneDNN handles, packed GEMM weights) and
serves from the packed form, so writing into ``parameter.data`` changes nothing that is
served. ``reload_weights(..., is_checkpoint_format=True)`` re-runs the model's own loader and
the per-layer processing, on every backend (and on a GPU too).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

__all__ = ["WorkerExtension"]

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


class WorkerExtension:
    """Methods of ours on vLLM's worker (``self`` is the worker: ``self.model_runner``)."""

    model_runner: Any

    def areal_load_weights(self, path: str) -> int:
        """Loads the checkpoint-format safetensors file at ``path`` into the served model;
        the number of tensors read."""
        return self.areal_load_files([path], [])

    def areal_load_files(self, paths: list[str], skip: list[str]) -> int:
        """Loads the checkpoint-format safetensors files at ``paths`` (but the tensors named
        in ``skip``) into the served model; the number of tensors read."""
        _quiet_weightless_layers()
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

        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        self._retie_output_head()
        return count

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
