"""The ``hf`` engine: an in-process transformers causal LM with continuous batching.

One background thread owns the model and decodes every running request together, one token
per step, over a shared left-padded KV cache. A request that arrives while others decode is
prefilled and joins the batch at the next step; a finished, cancelled or interrupted request
leaves it at the next step. The asyncio side only enqueues requests and receives tokens
(through ``loop.call_soon_threadsafe``), so the event loop never blocks on torch.

The queue, the running batch with its KV cache and the prefill / decode steps are
:mod:`.scheduler`'s (which waiting requests join the batch is :mod:`.admission`'s rule, and
how each step's tokens are drawn is :mod:`.sampler`'s); this module holds the public API, the
pause state, the weight swap and the decode thread that drives the scheduler.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import AsyncGenerator, Mapping, Sequence

import torch
from areal_servers.rollout.adapters import NamedAdapters
from areal_servers.rollout.engine import (
    AdapterLoad,
    EngineStatus,
    FinishReason,
    InferenceEngine,
    SamplingConfig,
    TokenEvent,
)
from areal_servers.rollout.scheduler import Request, Scheduler
from transformers import PreTrainedModel

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.errors import PreconditionError
from areal_grpc.model import adapter_names, is_lora, load_model, load_tokenizer
from areal_grpc.named_adapters import (
    BASE_ROWS,
    CheckedAdapter,
    add_adapter,
    check_adapter,
    check_adapter_name,
    remove_adapter,
)
from areal_grpc.precision import choose_dtype
from areal_grpc.tensor_codec import MiB

log = logging.getLogger(__name__)


def _resolve(fut: concurrent.futures.Future, value: object) -> None:
    """Sets a waiter's result unless it is already done (its awaiting task was cancelled)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if not fut.done():
            fut.set_result(value)


class HFEngine(InferenceEngine):
    """Continuous-batching generation with a transformers causal LM (CPU or GPU)."""

    kind = "hf"

    def __init__(
        self,
        policy: ModelConfig | None = None,
        rollout: RolloutConfig | None = None,
        *,
        model: PreTrainedModel | None = None,
    ) -> None:
        """Serves the run's ``policy`` (its ``model`` section) under its ``rollout`` section
        (device, dtype, max_running_requests, max_batch_tokens); ``model``: an already loaded one,
        served in its own dtype."""
        self.policy = policy or ModelConfig()
        self.rollout = rollout or RolloutConfig()
        device = self.rollout.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model_name = self.policy.source
        if model is None:
            name, why = choose_dtype(self.rollout.dtype, self.device.type)
            dtype = getattr(torch, name)
            model = load_model(
                self.policy.source, seed=self.policy.seed, dtype=dtype, lora=self.policy.lora
            )
        else:
            dtype, why = next(model.parameters()).dtype, "the model given"
        self._model = model.to(self.device)
        self._model.eval()
        # What a weight update must bring: every tensor, or with LoRA the adapters only (the
        # base weights are frozen, the same as the trainer's).
        self.adapters_only = is_lora(self._model)
        # The state dict's tensors (parameters as their Parameter objects): an update replaces
        # a parameter's data, never the object, so this is read once instead of through
        # state_dict() (three times per update, ~0.5 ms each for 100 tensors).
        self._state = self._model.state_dict(keep_vars=True)
        self._params = dict(self._model.named_parameters(remove_duplicate=False))
        self._required = adapter_names(self._model) if self.adapters_only else set(self._state)
        # What updates should bring: the one floating dtype of the tensors they replace (a
        # LoRA model's adapters may be kept wider than its base weights).
        held = {
            t.dtype for n, t in self._state.items() if n in self._required and t.is_floating_point()
        }
        self.weights_dtype = held.pop() if len(held) == 1 else None
        self._model.requires_grad_(False)
        log.info("hf engine: %s on %s in %s (%s)", self.model_name, self.device, dtype, why)
        tokenizer = load_tokenizer(self.policy.source) if model is None else None
        mcfg = self._model.config
        self.vocab_size = int(mcfg.vocab_size)
        self.max_context = int(getattr(mcfg, "max_position_embeddings", 0) or 0)
        self.max_request_tokens = self.rollout.max_batch_tokens or 0
        self.eos_token_id = (
            tokenizer.eos_token_id if tokenizer is not None else getattr(mcfg, "eos_token_id", None)
        )
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer is not None else getattr(mcfg, "pad_token_id", 0)
        )
        # Generation ends at any end-of-turn token: chat models list theirs in the
        # generation config (e.g. <|im_end|> beside <|endoftext|>).
        ends = getattr(getattr(self._model, "generation_config", None), "eos_token_id", None)
        ends = [ends] if isinstance(ends, int) else list(ends or [])
        if self.eos_token_id is not None:
            ends.append(int(self.eos_token_id))
        self.end_token_ids = frozenset(int(t) for t in ends)

        # Guards the pause state below and the scheduler's queue, batch and request flags: one
        # lock, so the decode loop's wait sees both.
        self._cond = threading.Condition()
        # Held for every forward step and for a weight swap, so a swap lands between steps.
        self._model_lock = threading.Lock()
        self._scheduler = Scheduler(
            self._model,
            self.device,
            self._cond,
            max_running=self.rollout.max_running_requests,
            max_batch_tokens=self.rollout.max_batch_tokens,
            max_context=self.max_context,
            seed=self.policy.seed,
        )
        # Named adapters (LoadAdapter): which load each name serves, within the caps; the
        # ones installed in the model; retired ones whose last request ended, which the decode
        # loop drops between two steps.
        self._named = NamedAdapters(
            self.rollout.max_adapters, int(self.rollout.max_adapter_mib * MiB)
        )
        self.max_adapter_bytes = self._named.max_bytes if self._named.max_adapters else 0
        self._installed: set[str] = set()
        self._to_drop: list[str] = []
        if self.adapters_only:
            # The run's own rows compute the run's adapter in a mixed batch.
            self._scheduler.own_adapter = str(self._model.active_adapter)  # type: ignore[union-attr]
        else:
            self._scheduler.own_adapter = BASE_ROWS
        self._paused = False
        self._closed = False
        self._version = 0
        self._pause_waiters: list[concurrent.futures.Future[int]] = []
        self._resume_waiters: list[concurrent.futures.Future[None]] = []
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="hf-engine-decode", daemon=True)
        self._thread.start()
        # A daemon thread still inside a torch op when the interpreter finalizes is killed by
        # a forced unwind through C++ frames, which aborts the process ("terminate called
        # without an active exception", SIGABRT). Stop the loop before that point even when
        # nobody calls close() (e.g. a server stopped by SIGTERM).
        atexit.register(_stop_at_exit, weakref.ref(self))

    # ----------------------------------------------------------------------------- public

    @property
    def model(self) -> PreTrainedModel:
        """The served model (read-only use; weights change only through load_weights)."""
        return self._model

    @property
    def version(self) -> int:
        """Policy version being served."""
        return self._version

    def status(self) -> EngineStatus:
        """Running and queued request counts, version, pause state, tokens generated."""
        with self._cond:
            return EngineStatus(
                version=self._version,
                running=self._scheduler.running_locked(),
                queued=len(self._scheduler.pending),
                paused=self._paused,
                generated_tokens=self._scheduler.generated_tokens,
            )

    async def stream(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> AsyncGenerator[TokenEvent, None]:
        """Generates one sample; see :meth:`InferenceEngine.stream`."""
        params.validate()
        self.check_prompt(input_ids, params)
        # The named adapter's load is pinned until the request ends (a removal or a reload
        # meanwhile lets it finish on the load it started on).
        internal = self._named.acquire(adapter) if adapter else ""
        # Closed explicitly: closing this generator (a cancelled call) must cancel the
        # request at once, not when the inner generator is collected.
        inner = self._stream(input_ids, params, internal)
        try:
            async for event in inner:
                yield event
        finally:
            await inner.aclose()
            if internal:
                idle = self._named.release(internal)
                if idle:
                    with self._cond:
                        self._to_drop += idle
                        self._cond.notify_all()

    async def _stream(
        self, input_ids: Sequence[int], params: SamplingConfig, internal: str
    ) -> AsyncGenerator[TokenEvent, None]:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.end_token_ids
        req = Request(
            rid=next(self._ids),
            prompt=[int(t) for t in input_ids],
            params=params,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            stop_ids=frozenset(stops),
            adapter=internal,
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
        with self._cond:
            self.check_alive()
            if self._closed:
                raise RuntimeError("engine is closed")
            self._scheduler.submit_locked(req)
            self._cond.notify_all()
        try:
            while True:
                event = await req.queue.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish is not None:
                    return
        finally:
            if not req.done:
                self._scheduler.cancel(req)

    async def pause(self, wait: bool = True) -> int:
        """Interrupts running requests at the next token boundary; returns how many.

        ``wait`` False: returns at once, with the requests running now; the decode loop (or
        a weight swap, whichever comes first) interrupts them when the step in progress ends.
        """
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._cond:
            self._paused = True
            if self._closed:
                # No decode loop left to interrupt anything (closed, or it failed).
                fut.set_result(0)
            else:
                self._pause_waiters.append(fut)
                self._cond.notify_all()
            running = self._scheduler.in_flight_locked()
        if not wait:
            return fut.result() if fut.done() else running
        return await asyncio.wrap_future(fut)

    async def resume(self) -> None:
        """Lets queued and resubmitted requests decode again."""
        with self._cond:
            self._paused = False
            waiters, self._resume_waiters = self._resume_waiters, []
            self._cond.notify_all()
        for w in waiters:
            _resolve(w, None)

    async def wait_until_resumed(self) -> None:
        """Returns when generation is not paused."""
        with self._cond:
            if not self._paused:
                return
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._resume_waiters.append(fut)
        await asyncio.wrap_future(fut)

    async def load_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, owned: bool = False
    ) -> dict[str, torch.Tensor]:
        """Validates ``state_dict`` against the model, then swaps it in between two steps.

        ``owned``: the caller hands the tensors over (freshly received, referenced by nobody
        else, never changed afterwards). Those already of the model's dtype and device and
        contiguous then become the parameters as they are, with no copy at all, and the
        parameters they replace are handed back (by name; storage nothing in the model uses
        any more) for the caller to reuse, e.g. as the next update's receive buffers. By
        default the engine takes private copies, the caller's tensors stay the caller's and
        nothing is handed back.
        """
        self.check_alive()
        if version <= self._version:
            raise PreconditionError(
                f"weights version {version} is not newer than the served version {self._version}"
            )
        # Both the copy and the swap run off the event loop: for a large model they take long
        # enough to stall every stream the server is serving.
        if not owned:
            await asyncio.to_thread(self._load_blocking, state_dict, version)
            return {}

        def install() -> dict[str, torch.Tensor]:
            return self._swap_weights(
                self._prepare_state_dict(state_dict, owned=True), version, True
            )

        return await asyncio.to_thread(install)

    def _load_blocking(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._swap_weights(self._prepare_state_dict(state_dict), version)

    # --------------------------------------------------------------------- named adapters

    def adapters(self) -> list[str]:
        """Names of the named adapters held, sorted."""
        return self._named.names()

    async def load_adapter(
        self, name: str, tensors: Mapping[str, torch.Tensor], rank: int, alpha: float
    ) -> AdapterLoad:
        """Adds the adapter to the model (between two decoding steps) as ``name``; see
        :meth:`InferenceEngine.load_adapter`."""
        check_adapter_name(name, "header.name")
        # Checked and copied off the event loop: an adapter can be tens of MiB.
        checked = await asyncio.to_thread(check_adapter, self._model, tensors, rank, alpha)
        internal = self._named.reserve(name, checked.nbytes)
        try:
            await asyncio.to_thread(self._install_adapter, internal, checked)
        except BaseException:
            self._named.unreserve(name)
            raise
        replaced, idle = self._named.install(name, internal)
        if idle:
            await asyncio.to_thread(self._drop_adapters, idle)
        log.info("hf engine: adapter %r loaded (%d bytes)", name, checked.nbytes)
        return AdapterLoad(name, checked.nbytes, len(checked.modules), replaced)

    async def remove_adapter(self, name: str) -> int:
        """Stops serving ``name``; its tensors go once no running request uses them."""
        idle = self._named.remove(name)
        if idle:
            await asyncio.to_thread(self._drop_adapters, idle)
        log.info("hf engine: adapter %r removed", name)
        return self._named.held_bytes

    def _install_adapter(self, internal: str, checked: CheckedAdapter) -> None:
        with self._model_lock:
            add_adapter(self._model, internal, checked)
            self._installed.add(internal)
            # The adapter may have wrapped layers that had no LoRA before.
            self._scheduler.row_adapters.install(self._model)
            self._scheduler.mixed = True

    def _drop_adapters(self, internals: Sequence[str]) -> None:
        # Under the model lock: between two steps. A row of a cancelled request may still
        # name a dropped adapter until it leaves the batch; peft skips names it lacks.
        with self._model_lock:
            for internal in internals:
                if internal in self._installed:
                    remove_adapter(self._model, internal)
                    self._installed.discard(internal)
            self._scheduler.mixed = bool(self._installed)
            if not self._installed:
                self._scheduler.row_adapters.remove()

    async def close(self) -> None:
        """Stops the decode thread; outstanding requests end CANCELLED."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join)
        with self._cond:
            leftovers, waiters = self._take_everything()
        for req in leftovers:
            req.finish(FinishReason.CANCELLED)
        for fut, value in waiters:
            _resolve(fut, value)

    def _take_everything(
        self,
    ) -> tuple[list[Request], list[tuple[concurrent.futures.Future, object]]]:
        """Empties the queue and the batch; call under ``_cond``.

        Returns the requests in flight (for the caller to end) and the pause/resume waiters
        with the value each is released with (0 interrupted, None), for the caller to resolve.
        """
        leftovers = self._scheduler.take_all_locked()
        waiters = [(w, 0) for w in self._pause_waiters] + [(w, None) for w in self._resume_waiters]
        self._pause_waiters = []
        self._resume_waiters = []
        return leftovers, waiters

    # --------------------------------------------------------------------------- weights

    def _prepare_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], owned: bool = False
    ) -> dict[str, torch.Tensor]:
        current = self._state
        unexpected = sorted(set(state_dict) - set(current))
        if unexpected:
            raise ValueError(f"state dict has unknown tensors: {unexpected[:5]}")
        missing = self._required - set(state_dict)
        if getattr(self._model.config, "tie_word_embeddings", False):
            # Tied output weights share the embedding; checkpoints usually omit them.
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"state dict lacks tensors: {sorted(missing)[:5]}")
        prepared: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            target = current[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the model needs "
                    f"{tuple(target.shape)}"
                )
            t = tensor.detach()
            same = t.device == self.device and t.dtype == target.dtype
            if owned and same and t.is_contiguous():
                prepared[name] = t  # handed over: installed as it is
                continue
            # Private copies made before taking the lock: the swap itself is short and cannot
            # fail, and the caller may go on changing its tensors meanwhile.
            prepared[name] = t.to(device=self.device, dtype=target.dtype, copy=True)
        return prepared

    def _swap_weights(
        self, prepared: dict[str, torch.Tensor], version: int, install: bool = False
    ) -> dict[str, torch.Tensor]:
        # install: ``prepared`` is private to the engine; parameters take its tensors as their
        # data (no copy; a tied parameter is one object, so its ties hold). Buffers are copied.
        # Returns the replaced parameter data that nothing in the model still uses.
        params = self._params if install else {}
        replaced: dict[str, torch.Tensor] = {}
        with self._model_lock:
            if version <= self._version:
                raise PreconditionError(
                    f"weights version {version} is not newer than the served version "
                    f"{self._version}"
                )
            with self._cond:
                # A pause that did not wait may not have reached the decode loop yet: its
                # requests end here, on the old weights, before any step runs on the new ones.
                if self._pause_waiters:
                    self._interrupt_all_locked()
            current = self._state
            with torch.no_grad():
                for name, tensor in prepared.items():
                    param = params.get(name)
                    if param is not None:
                        replaced[name] = param.data
                        param.data = tensor
                    else:
                        current[name].copy_(tensor)
            with self._cond:
                self._version = version
        log.info("hf engine now serves policy version %d", version)
        # A tied or shared storage may still be in use (or be listed twice): handed back once,
        # and only when no parameter or buffer of the model points into it any more.
        live = {t.untyped_storage().data_ptr() for t in self._state.values()}
        spare: dict[str, torch.Tensor] = {}
        for name, old in replaced.items():
            ptr = old.untyped_storage().data_ptr()
            if ptr not in live:
                live.add(ptr)
                spare[name] = old
        return spare

    # ---------------------------------------------------------------------- decode loop

    def _run(self) -> None:
        try:
            with torch.no_grad():
                while self._step():
                    pass
        except BaseException as exc:
            log.exception("hf engine decode loop failed; failing every request in flight")
            with self._cond:
                self._closed = True
                error = self.died(f"its decode loop failed: {exc!r}")
                error.__cause__ = exc
                leftovers, waiters = self._take_everything()
                for req in leftovers:
                    req.fail(error)
            for fut, value in waiters:
                _resolve(fut, value)

    def _step(self) -> bool:
        """One scheduling round: pause handling, admission, prefill, one decode step."""
        scheduler = self._scheduler
        with self._cond:
            while True:
                if self._closed:
                    return False
                if self._pause_waiters:
                    self._interrupt_all_locked()
                    continue
                scheduler.drop_finished_locked()
                if self._to_drop or (not self._paused and scheduler.has_work_locked()):
                    break
                self._cond.wait()
            drop, self._to_drop = self._to_drop, []
            run = not self._paused and scheduler.has_work_locked()
            admitted = scheduler.admit_locked() if run else []
        if drop:
            self._drop_adapters(drop)
        if not run:
            return True
        with self._model_lock:
            version = self._version
            if admitted:
                scheduler.prefill(admitted, version)
            with self._cond:
                scheduler.joined_locked()
            scheduler.decode(version)
        return True

    def _interrupt_all_locked(self) -> None:
        interrupted = self._scheduler.interrupt_all_locked()
        waiters, self._pause_waiters = self._pause_waiters, []
        for w in waiters:
            # A pause() whose caller was cancelled (deadline, shutdown) has a cancelled
            # future: set_result would raise InvalidStateError and kill the decode loop.
            _resolve(w, interrupted)


def _stop_at_exit(ref: weakref.ref[HFEngine]) -> None:
    engine = ref()
    if engine is None:
        return
    with engine._cond:
        engine._closed = True
        engine._cond.notify_all()
    engine._thread.join(timeout=30)


__all__ = ["HFEngine"]
