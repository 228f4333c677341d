"""The training service's trainer group: data-parallel replicas of the LoRA engine.

The service's engine is rank 0 of a torch.distributed group (gloo); ranks 1..N-1 are worker
processes (``python -m areal_servers.lora_training.rank``) that hold the same base model and a
replica of every run's adapter, pending gradients and optimizer state. The service calls rank
0 alone. Each call that changes a run's training state goes to the workers as a command, which
rank 0 broadcasts. So every rank applies the same calls in the same order:

* ``forward_backward``: the datums are split across the ranks by token count (LPT). Each rank
  differentiates its share. The gradients are summed over the group (all_reduce), so every
  rank holds the whole call's gradient. A Tinker loss is a sum over tokens, never a mean, so
  this is what one process computes, up to float rounding.
* ``optim_step``: every rank steps its replica with the same gradients, so the replicas stay
  identical without any copying.
* ``create`` and ``load_state``: rank 0 builds or loads the run, then broadcasts its adapter,
  gradients and optimizer state. ``delete`` drops it everywhere.

Calls that change nothing (sample, forward-only, snapshot, save) run on rank 0 alone.

The base model is replicated, not sharded with FSDP2, for two reasons. Its weights are frozen,
so only the small adapters need gradient sums. And a forward-only call then needs one rank,
not the whole group in step.

Commands travel as JSON in a uint8 tensor, never pickled. A rank that dies fails rank 0's
next collective. A rank that stalls does so once ``tinker.trainer_timeout_s`` passes. Rank 0
keeps every run's full state, so it then restarts the workers, copies every run to them, and
runs the failed call once more. A call that fails twice raises :class:`TrainerGroupError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from areal_servers.lora_training.engine import AdamParams, AdapterSpec, Datum, LoraEngine
from areal_servers.trainer.engine import DistConfig, init_distributed

from areal_grpc.errors import FieldError, UnavailableError
from areal_grpc.ffd import lpt_partition
from areal_grpc.launch import (
    Child,
    child_env,
    dies_with_this_process,
    python_module_argv,
    start_child,
    stop_children,
)
from areal_grpc.ports import free_port

__all__ = ["GroupEngine", "TrainerGroupError", "follow", "join_group"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A datum's JSON form: its Datum fields (None ones left out).
_DATUM_FIELDS = ("input_tokens", "target_tokens", "weights", "logprobs", "advantages")
WORKER_MODULE = "areal_servers.lora_training.rank"


class TrainerGroupError(UnavailableError):
    """The trainer group failed a call even after restarting its workers."""


def join_group(rank: int, world: int, master: str, timeout_s: float) -> None:
    """Joins the group's gloo process group as ``rank`` of ``world`` (rank 0 hosts it)."""
    host, _, port = master.rpartition(":")
    init_distributed(DistConfig("gloo", host, int(port), rank, world, timeout_s))


def _send(message: Mapping[str, Any]) -> None:
    data = json.dumps(message).encode()
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0)


def _receive() -> dict[str, Any]:
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, 0)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, 0)
    message: dict[str, Any] = json.loads(bytes(data.numpy()))
    return message


def _datum_json(datum: Datum) -> dict[str, Any]:
    return {
        name: getattr(datum, name) for name in _DATUM_FIELDS if getattr(datum, name) is not None
    }


class GroupEngine(LoraEngine):
    """A :class:`LoraEngine` that is one rank of the trainer group (see the module docstring).

    Rank 0 (``world`` > 1) starts the workers itself; a worker is built with ``worker=True``
    after :func:`join_group`, and then serves :func:`follow`.
    """

    def __init__(
        self,
        model_source: str,
        *,
        world: int = 1,
        timeout_s: float = 300.0,
        log_dir: Path | None = None,
        worker: bool = False,
        **kwargs: Any,
    ) -> None:
        if world < 1:
            raise ValueError(f"world: must be >= 1, got {world}")
        super().__init__(model_source, **kwargs)
        self.world = world
        self.rank = dist.get_rank() if worker else 0
        self.timeout_s = timeout_s
        self.log_dir = log_dir
        self.workers: list[Child] = []
        # Set when the group failed: the next call restarts the workers first.
        self._broken = False
        if worker:
            self._check_same_base()
        elif world > 1:
            self._start_workers()

    @property
    def leads(self) -> bool:
        """Whether this is rank 0 of a group with workers (it sends every command)."""
        return self.world > 1 and self.rank == 0

    # ------------------------------------------------------------------ group lifetime

    def _worker_argv(self, rank: int, master: str) -> list[str]:
        return dies_with_this_process(
            python_module_argv(
                WORKER_MODULE,
                f"--model={self.base_model}",
                f"--seed={self.seed}",
                f"--dtype={str(self.dtype).removeprefix('torch.')}",
                f"--max-batch-tokens={self.max_batch_tokens}",
                f"--rank={rank}",
                f"--world={self.world}",
                f"--master={master}",
                f"--timeout-s={self.timeout_s}",
            )
        )

    def _start_workers(self) -> None:
        """Starts ranks 1..N-1 and joins them (each prints LISTENING before it loads the
        model, so they load at once); then checks they loaded the same base."""
        master = f"127.0.0.1:{free_port()}"
        env = child_env()
        try:
            for rank in range(1, self.world):
                self.workers.append(
                    start_child(
                        f"trainer-rank-{rank}",
                        self._worker_argv(rank, master),
                        log_dir=self.log_dir,
                        env=env,
                    )
                )
            join_group(0, self.world, master, self.timeout_s)
            self._check_same_base()
        except BaseException:
            stop_children(self.workers, grace_s=2.0)
            self.workers = []
            raise
        log.info(
            "trainer group of %d ranks: workers %s",
            self.world,
            ", ".join(f"pid {c.process.pid}" for c in self.workers),
        )

    def _check_same_base(self) -> None:
        # A sum over the frozen base's weights: equal on ranks that loaded the same model.
        with torch.no_grad():
            total = sum(
                p.double().sum() for name, p in self._base.named_parameters() if "lora_" not in name
            )
        mine = torch.tensor([float(total)], dtype=torch.float64)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if float(low) != float(high):
            raise RuntimeError(
                f"trainer ranks loaded different base models from {self.base_model!r} "
                f"(weight sums {float(low)} and {float(high)})"
            )

    def _stop_workers(self) -> None:
        stop_children(self.workers, grace_s=2.0)
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def _restart(self) -> None:
        """Replaces every worker and copies every run to the new ones."""
        self._stop_workers()
        self._start_workers()
        for run_id in self.run_ids:
            self._replicate(run_id)
        self._broken = False

    def close(self) -> None:
        """Stops the workers (they exit on the stop command, or are killed)."""
        if not self.leads:
            return
        if self.workers and not self._broken:
            try:
                _send({"op": "stop"})
            except Exception as exc:  # stopping anyway
                log.info("the workers missed the stop command: %r", exc)
        self._stop_workers()

    def dead_workers(self) -> list[str]:
        """The workers that exited, as "trainer-rank-<r> (pid <pid>, exit <code>)"."""
        return [
            f"{c.name} (pid {c.process.pid}, exit {c.process.returncode})"
            for c in self.workers
            if not c.alive()
        ]

    def _guarded(self, what: str, call: Callable[[], T]) -> T:
        """``call`` on the group (rank 0); after a failure, a restart and one more try.

        ``call`` must leave this rank's runs as they were when it fails."""
        for attempt in (1, 2):
            if self._broken or self.dead_workers():
                dead = ", ".join(self.dead_workers()) or "a stalled or failed rank"
                log.warning("restarting the trainer group's workers: %s", dead)
                try:
                    self._restart()
                except Exception as exc:
                    self._broken = True
                    raise TrainerGroupError(
                        f"{what}: the trainer group could not restart its workers ({exc})"
                    ) from exc
            try:
                return call()
            except Exception as exc:
                # Whatever failed, the workers may be inside a collective this rank left:
                # the group must be rebuilt before its next command.
                self._broken = True
                if not isinstance(exc, RuntimeError):  # the call's own error: no retry
                    raise
                dead = ", ".join(self.dead_workers()) or f"{exc}"
                log.warning(
                    "%s failed on the trainer group (attempt %d): %s (%s)",
                    what,
                    attempt,
                    dead,
                    type(exc).__name__,
                )
                if attempt == 2:
                    raise TrainerGroupError(
                        f"{what}: the trainer group failed twice ({dead}); nothing of the "
                        "call was applied"
                    ) from exc
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ run state copies

    def _layout(self, run_id: str) -> dict[str, Any]:
        """How rank 0 lays out run ``run_id``'s state for :meth:`_share_run`."""
        run = self._run(run_id)
        assert run.optimizer is not None
        entries: list[list[Any]] = []
        scalars: dict[str, dict[str, float]] = {}
        for key, param in run.params.items():
            entries.append(["param", key, "", list(param.shape), str(param.dtype)])
            if param.grad is not None:
                entries.append(["grad", key, "", list(param.shape), str(param.dtype)])
            for name, value in run.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    entries.append(["state", key, name, list(value.shape), str(value.dtype)])
                else:
                    scalars.setdefault(key, {})[name] = float(value)
        return {
            "spec": asdict(run.spec),
            "steps": run.steps,
            "entries": entries,
            "scalars": scalars,
        }

    def _tensors(self, run_id: str, entries: Sequence[Sequence[Any]]) -> Iterator[torch.Tensor]:
        run = self._run(run_id)
        assert run.optimizer is not None
        for kind, key, name, _, _ in entries:
            param = run.params[key]
            if kind == "param":
                yield param.data
            elif kind == "grad":
                assert param.grad is not None
                yield param.grad
            else:
                yield run.optimizer.state[param][name]

    def _share_run(self, run_id: str, layout: Mapping[str, Any]) -> None:
        """Broadcasts run ``run_id``'s state, laid out as :meth:`_layout` says, from rank 0
        into the workers' replica."""
        entries = layout["entries"]
        if self.rank == 0:
            flat = torch.cat(
                [t.detach().reshape(-1).double() for t in self._tensors(run_id, entries)]
            )
            dist.broadcast(flat, 0)
            return
        run = self._run(run_id)
        assert run.optimizer is not None
        total = sum(math.prod(shape) for _, _, _, shape, _ in entries)
        flat = torch.empty(total, dtype=torch.float64)
        dist.broadcast(flat, 0)
        optimizer = torch.optim.AdamW(list(run.params.values()), lr=AdamParams().learning_rate)
        offset = 0
        with torch.no_grad():
            for param in run.params.values():
                param.grad = None
            for kind, key, name, shape, dtype in entries:
                param = run.params[key]
                size = math.prod(shape)
                value = (
                    flat[offset : offset + size]
                    .reshape(shape)
                    .to(getattr(torch, dtype.split(".")[-1]))
                )
                offset += size
                if kind == "param":
                    param.copy_(value)
                elif kind == "grad":
                    param.grad = value.clone()
                else:
                    optimizer.state[param][name] = value.clone()
            for key, values in layout["scalars"].items():
                optimizer.state[run.params[key]].update(values)
        run.optimizer = optimizer
        run.steps = int(layout["steps"])

    # ------------------------------------------------------------------ the replicated calls

    def create(self, run_id: str, spec: AdapterSpec) -> int:
        count = super().create(run_id, spec)
        if self.leads:
            try:
                self._guarded("create", lambda: self._replicate(run_id))
            except TrainerGroupError:
                super().delete(run_id)  # a run the group does not hold is no run
                raise
        return count

    def _replicate(self, run_id: str) -> None:
        layout = self._layout(run_id)
        _send({"op": "adopt", "run_id": run_id, **layout})
        self._share_run(run_id, layout)

    def delete(self, run_id: str) -> None:
        super().delete(run_id)
        if self.leads:
            self._guarded("delete", lambda: _send({"op": "delete", "run_id": run_id}))

    def load_state(self, run_id: str, directory: Path, *, optimizer: bool) -> None:
        super().load_state(run_id, directory, optimizer=optimizer)
        if self.leads:
            self._guarded("load_state", lambda: self._replicate(run_id))

    def optim_step(self, run_id: str, adam: AdamParams) -> dict[str, float]:
        if not self.leads:
            return super().optim_step(run_id, adam)
        self._run(run_id)
        self._check_adam(adam)

        def step() -> None:
            _send({"op": "optim_step", "run_id": run_id, "adam": asdict(adam)})

        self._guarded("optim_step", step)
        try:
            return super().optim_step(run_id, adam)
        except BaseException:
            self._broken = True  # the workers stepped: rebuild them from this rank's state
            raise

    def forward_backward(
        self,
        run_id: str,
        data: Sequence[Datum],
        loss_fn: str,
        config: Mapping[str, float],
        *,
        forward_only: bool = False,
    ) -> tuple[list[list[float]], dict[str, float]]:
        if forward_only or not self.leads:
            return super().forward_backward(
                run_id, data, loss_fn, config, forward_only=forward_only
            )
        self._run(run_id)
        cfg = self.check_data(data, loss_fn, config)
        message = {
            "op": "forward_backward",
            "run_id": run_id,
            "loss_fn": loss_fn,
            "config": cfg,
            "data": [_datum_json(d) for d in data],
        }

        def call() -> tuple[list[list[float]], dict[str, float]]:
            _send(message)
            # It puts the run's pending gradients back should it fail.
            return self._forward_backward_share(run_id, data, loss_fn, cfg)

        return self._guarded("forward_backward", call)

    def _forward_backward_share(
        self, run_id: str, data: Sequence[Datum], loss_fn: str, cfg: Mapping[str, float]
    ) -> tuple[list[list[float]], dict[str, float]]:
        """This rank's share of a forward_backward, then the group's sums (every rank)."""
        run = self._run(run_id)
        lengths = [len(d.input_tokens) for d in data]
        mine = sorted(lpt_partition(lengths, self.world)[self.rank])
        pending = {key: p.grad for key, p in run.params.items()}
        for param in run.params.values():
            param.grad = None
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        # Every datum's log-probs, then the loss and token sums: zeros where another rank's.
        out = torch.zeros(starts[-1] + 2, dtype=torch.float64)
        try:
            if mine:
                logprobs, metrics = super().forward_backward(
                    run_id, [data[i] for i in mine], loss_fn, cfg
                )
                for index, values in zip(mine, logprobs, strict=True):
                    out[starts[index] : starts[index + 1]] = torch.tensor(
                        values, dtype=torch.float64
                    )
                out[-2] = metrics["loss:sum"]
                out[-1] = metrics["tokens:sum"]
            grads = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in run.params.values()
                ]
            )
            dist.all_reduce(grads)
            dist.all_reduce(out)
        except BaseException:
            for key, param in run.params.items():
                param.grad = pending[key]
            raise
        offset = 0
        for key, param in run.params.items():
            size = param.numel()
            summed = grads[offset : offset + size].view_as(param)
            offset += size
            before = pending[key]
            param.grad = summed.clone() if before is None else before + summed
        values = out.tolist()
        logprobs = [values[starts[i] : starts[i + 1]] for i in range(len(data))]
        return logprobs, {"loss:sum": values[-2], "tokens:sum": values[-1]}


def follow(engine: GroupEngine) -> None:
    """A worker's loop: applies rank 0's commands until it says stop (or the group fails)."""
    while True:
        message = _receive()
        op = message["op"]
        if op == "stop":
            return
        run_id = message["run_id"]
        if op == "adopt":
            if run_id not in engine.run_ids:
                engine.create(run_id, AdapterSpec(**message["spec"]))
            engine._share_run(run_id, message)
        elif op == "delete":
            # A delete retried after a restart finds the run already gone.
            if run_id in engine.run_ids:
                engine.delete(run_id)
        elif op == "optim_step":
            # A step refused for non-finite weights is undone here as on rank 0, which
            # refuses the same step and rebuilds the group after it anyway.
            with contextlib.suppress(FieldError):
                engine.optim_step(run_id, AdamParams(**message["adam"]))
        elif op == "forward_backward":
            data = [Datum(**d) for d in message["data"]]
            engine._forward_backward_share(run_id, data, message["loss_fn"], message["config"])
        else:
            raise RuntimeError(f"unknown command {op!r} from rank 0")
