"""The ``hf`` engine: an in-process transformers causal LM with continuous batching.

One background thread owns the model and decodes every running request together, one token
per step, over a shared left-padded KV cache. A request that arrives while others decode is
prefilled and joins the batch at the next step; a finished, cancelled or interrupted request
leaves it at the next step. The asyncio side only enqueues requests and receives tokens
(through ``loop.call_soon_threadsafe``), so the event loop never blocks on torch.

Which waiting requests join the batch is :mod:`.admission`'s rule, and how each step's
tokens are drawn (and their log-probabilities) is :mod:`.sampler`'s.
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
from collections import deque
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from areal_servers.rollout.admission import admit
from areal_servers.rollout.engine import (
    EngineStatus,
    FinishReason,
    InferenceEngine,
    SamplingConfig,
    TokenEvent,
)
from areal_servers.rollout.sampler import sample
from transformers import DynamicCache, PreTrainedModel

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.errors import PreconditionError
from areal_grpc.model import adapter_names, is_lora, load_model, load_tokenizer

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]


class EngineFailedError(RuntimeError):
    """The decode loop died; every request in flight (and any later one) gets this."""


@dataclass(eq=False)
class _Request:
    rid: int
    prompt: list[int]
    params: SamplingConfig
    loop: asyncio.AbstractEventLoop
    # TokenEvents, or the exception that ended the request (raised to the caller).
    queue: asyncio.Queue[TokenEvent | BaseException]
    stop_ids: frozenset[int]
    generated: int = 0
    # The request's own sampling stream (a seeded request), else None: the engine's.
    generator: torch.Generator | None = None
    # Sampled but not yet fed through the model.
    pending_token: int = -1
    cancelled: bool = False
    done: bool = False


@dataclass
class _Batch:
    """The running rows: request i owns row i of every cache tensor and of ``mask``."""

    requests: list[_Request] = field(default_factory=list)
    kv: KV = field(default_factory=list)
    # The live cache object holding ``kv``, reused while the rows stay the same (building one
    # from tensors costs a copy of the whole cache); None after rows joined or left.
    cache: DynamicCache | None = None
    # [B, T] 1 where the cache holds a real token (left padding is 0).
    mask: torch.Tensor | None = None


def _slots(req: _Request) -> int:
    """KV cache slots a request may need: its prompt and every token it may generate."""
    return len(req.prompt) + req.params.max_new_tokens


def _resolve(fut: concurrent.futures.Future, value: object) -> None:
    """Sets a waiter's result unless it is already done (its awaiting task was cancelled)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if not fut.done():
            fut.set_result(value)


def _pad_left(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


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
        (device, max_running_requests, max_batch_tokens); ``model``: an already loaded one."""
        self.policy = policy or ModelConfig()
        self.rollout = rollout or RolloutConfig()
        device = self.rollout.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model_name = self.policy.source
        if model is None:
            model = load_model(self.policy.source, seed=self.policy.seed, lora=self.policy.lora)
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
        self._model.requires_grad_(False)
        log.info("hf engine: %s on %s", self.model_name, self.device)
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
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(self.policy.seed)

        self._cond = threading.Condition()
        # Held for every forward step and for a weight swap, so a swap lands between steps.
        self._model_lock = threading.Lock()
        self._pending: deque[_Request] = deque()
        # Taken off the queue and being prefilled (in neither _pending nor the batch yet).
        self._admitting: list[_Request] = []
        self._batch = _Batch()
        # Set when the decode loop died: why, for every later request.
        self._failure: BaseException | None = None
        self._paused = False
        self._closed = False
        self._version = 0
        self._generated_tokens = 0
        self._pause_waiters: list[concurrent.futures.Future[int]] = []
        self._resume_waiters: list[concurrent.futures.Future[None]] = []
        self._ids = itertools.count()
        # Rows the embedding can look up and the sampler may return (the lm_head can have
        # more rows than the embedding, e.g. padded vocabularies).
        emb = self._model.get_input_embeddings()
        self._token_limit = min(
            n for n in (self.vocab_size, int(getattr(emb, "num_embeddings", 0) or 0)) if n > 0
        )
        self._warned_nonfinite = False
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
            running = sum(1 for r in self._batch.requests if not r.cancelled and not r.done)
            return EngineStatus(
                version=self._version,
                running=running,
                queued=len(self._pending),
                paused=self._paused,
                generated_tokens=self._generated_tokens,
            )

    async def stream(
        self, input_ids: Sequence[int], params: SamplingConfig
    ) -> AsyncGenerator[TokenEvent, None]:
        """Generates one sample; see :meth:`InferenceEngine.stream`."""
        params.validate()
        self.check_prompt(input_ids, params)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.end_token_ids
        req = _Request(
            rid=next(self._ids),
            prompt=[int(t) for t in input_ids],
            params=params,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            stop_ids=frozenset(stops),
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
        with self._cond:
            if self._failure is not None:
                raise EngineFailedError(f"hf engine decode loop failed: {self._failure!r}")
            if self._closed:
                raise RuntimeError("engine is closed")
            self._pending.append(req)
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
                self._cancel(req)

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
            running = len(self._batch.requests) + len(self._admitting)
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

    async def close(self) -> None:
        """Stops the decode thread; outstanding requests end CANCELLED."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join)
        with self._cond:
            leftovers, waiters = self._take_everything()
        for req in leftovers:
            self._finish(req, FinishReason.CANCELLED)
        for fut, value in waiters:
            _resolve(fut, value)

    def _take_everything(
        self,
    ) -> tuple[list[_Request], list[tuple[concurrent.futures.Future, object]]]:
        """Empties the queue and the batch; call under ``_cond``.

        Returns the requests in flight (for the caller to end) and the pause/resume waiters
        with the value each is released with (0 interrupted, None), for the caller to resolve.
        """
        leftovers = list(self._pending) + self._admitting + list(self._batch.requests)
        self._pending.clear()
        self._admitting = []
        self._batch = _Batch()
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

    # ------------------------------------------------------------------------ scheduling

    def _cancel(self, req: _Request) -> None:
        with self._cond:
            req.cancelled = True
            with contextlib.suppress(ValueError):
                self._pending.remove(req)
            self._cond.notify_all()

    def _emit(self, req: _Request, event: TokenEvent | BaseException) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, event)
        except RuntimeError:
            # The caller's event loop is gone: nobody is listening any more.
            req.cancelled = True

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if req.done:
            return
        req.done = True
        self._emit(req, TokenEvent(finish=reason))

    def _fail(self, req: _Request, error: BaseException) -> None:
        if req.done:
            return
        req.done = True
        self._emit(req, error)

    def _run(self) -> None:
        try:
            with torch.no_grad():
                while self._step():
                    pass
        except BaseException as exc:
            log.exception("hf engine decode loop failed; failing every request in flight")
            error = EngineFailedError(f"hf engine decode loop failed: {exc!r}")
            error.__cause__ = exc
            with self._cond:
                self._closed = True
                self._failure = exc
                leftovers, waiters = self._take_everything()
                for req in leftovers:
                    self._fail(req, error)
            for fut, value in waiters:
                _resolve(fut, value)

    def _step(self) -> bool:
        """One scheduling round: pause handling, admission, prefill, one decode step."""
        with self._cond:
            while True:
                if self._closed:
                    return False
                if self._pause_waiters:
                    self._interrupt_all_locked()
                    continue
                self._drop_finished_locked()
                if not self._paused and (self._pending or self._batch.requests):
                    break
                self._cond.wait()
            admitted = admit(
                self._pending,
                self._batch.requests,
                self.rollout.max_running_requests,
                self.rollout.max_batch_tokens,
                _slots,
            )
            self._admitting = admitted
        with self._model_lock:
            version = self._version
            if admitted:
                self._prefill(admitted, version)
            with self._cond:
                self._admitting = []
                # Rows cancelled or finished meanwhile (during the prefill, or since the round
                # began) leave before the step, so no stale row is ever fed to the model.
                self._drop_finished_locked()
            if self._batch.requests:
                self._decode(version)
        return True

    def _interrupt_all_locked(self) -> None:
        interrupted = 0
        for req in self._batch.requests:
            if not req.cancelled and not req.done:
                interrupted += 1
                self._finish(req, FinishReason.INTERRUPTED)
        self._batch = _Batch()
        waiters, self._pause_waiters = self._pause_waiters, []
        for w in waiters:
            # A pause() whose caller was cancelled (deadline, shutdown) has a cancelled
            # future: set_result would raise InvalidStateError and kill the decode loop.
            _resolve(w, interrupted)

    def _drop_finished_locked(self) -> None:
        keep = [i for i, r in enumerate(self._batch.requests) if not r.cancelled and not r.done]
        if len(keep) == len(self._batch.requests):
            return
        if not keep:
            self._batch = _Batch()
            return
        index = torch.tensor(keep, device=self.device)
        mask = self._batch.mask
        assert mask is not None
        mask = mask.index_select(0, index)
        # Columns that are padding in every remaining row carry nothing: trim them.
        valid_cols = torch.nonzero(mask.any(dim=0)).flatten()
        start = int(valid_cols[0]) if valid_cols.numel() else mask.shape[1]
        kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in self._batch.kv
        ]
        self._batch = _Batch(
            requests=[self._batch.requests[i] for i in keep], kv=kv, mask=mask[:, start:]
        )

    # ------------------------------------------------------------------------ decoding

    def _prefill(self, admitted: list[_Request], version: int) -> None:
        # Same-length prompts are prefilled together without padding (the n samples of one
        # prompt always share a length), so prefill never attends over pad tokens.
        by_length: dict[int, list[_Request]] = {}
        for req in admitted:
            by_length.setdefault(len(req.prompt), []).append(req)
        for length, reqs in by_length.items():
            ids = torch.tensor([r.prompt for r in reqs], dtype=torch.long, device=self.device)
            out = self._model(input_ids=ids, use_cache=True)
            logits = out.logits[:, -1, :].float()
            self._sample_and_emit(reqs, logits, version)
            kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            mask = torch.ones(len(reqs), length, dtype=torch.long, device=self.device)
            # A request cancelled before its first token was sampled has no pending token
            # (-1): it must not join the batch, or the next decode step would feed -1 to the
            # embedding ("IndexError: index out of range in self").
            keep = [i for i, r in enumerate(reqs) if not r.done and not r.cancelled]
            if not keep:
                continue
            if len(keep) < len(reqs):
                index = torch.tensor(keep, device=self.device)
                kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in kv]
                mask = mask.index_select(0, index)
            self._merge([reqs[i] for i in keep], kv, mask)

    def _merge(self, reqs: list[_Request], kv: KV, mask: torch.Tensor) -> None:
        with self._cond:
            batch = self._batch
            if not batch.requests:
                self._batch = _Batch(requests=list(reqs), kv=kv, mask=mask)
                return
            assert batch.mask is not None
            t = max(batch.mask.shape[1], mask.shape[1])
            pad_old, pad_new = t - batch.mask.shape[1], t - mask.shape[1]
            merged_kv = [
                (
                    torch.cat([_pad_left(k0, pad_old, 2), _pad_left(k1, pad_new, 2)]),
                    torch.cat([_pad_left(v0, pad_old, 2), _pad_left(v1, pad_new, 2)]),
                )
                for (k0, v0), (k1, v1) in zip(batch.kv, kv, strict=True)
            ]
            merged_mask = torch.cat(
                [_pad_left(batch.mask, pad_old, 1), _pad_left(mask, pad_new, 1)]
            )
            self._batch = _Batch(requests=batch.requests + reqs, kv=merged_kv, mask=merged_mask)

    def _decode(self, version: int) -> None:
        batch = self._batch
        assert batch.mask is not None
        # Cancelled rows still ride along this step (their tokens are discarded); they are
        # removed at the next scheduling round.
        toks = [r.pending_token for r in batch.requests]
        bad = [i for i, t in enumerate(toks) if not 0 <= t < self._token_limit]
        if bad:
            # Cannot happen for a live row; a dead one rides along with a harmless id.
            with self._cond:
                for i in bad:
                    r = batch.requests[i]
                    if not (r.cancelled or r.done):
                        log.error(
                            "hf engine: request %d has no valid next token %d", r.rid, toks[i]
                        )
                        self._fail(
                            r, EngineFailedError(f"invalid next token {toks[i]} (internal error)")
                        )
                    toks[i] = 0
        ids = torch.tensor([[t] for t in toks], dtype=torch.long, device=self.device)
        positions = batch.mask.sum(dim=1, keepdim=True)
        mask = torch.cat([batch.mask, torch.ones_like(positions)], dim=1)
        cache = batch.cache
        if cache is None:
            cache = DynamicCache(ddp_cache_data=batch.kv, config=self._model.config)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        with self._cond:
            if self._batch is batch:
                self._batch = _Batch(
                    requests=batch.requests, kv=kv, mask=mask, cache=out.past_key_values
                )
        self._sample_and_emit(batch.requests, out.logits[:, -1, :].float(), version)

    def _sample_and_emit(self, reqs: list[_Request], logits: torch.Tensor, version: int) -> None:
        # Only ids the embedding (and the tokenizer) know may be sampled.
        drawn = sample(
            logits[:, : self._token_limit],
            [r.params for r in reqs],
            self._generator,
            [r.generator for r in reqs],
        )
        if drawn.fell_back and not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("hf engine: non-finite logits at version %d; using argmax", version)
        tokens_l, logp_l, tops = drawn.tokens, drawn.logprobs, drawn.top
        produced = 0
        with self._cond:
            for r, tok, lp, top in zip(reqs, tokens_l, logp_l, tops, strict=True):
                if r.cancelled or r.done:
                    continue
                r.generated += 1
                r.pending_token = tok
                produced += 1
                self._emit(r, TokenEvent([tok], [lp], [version], top=top))
                if tok in r.stop_ids:
                    self._finish(r, FinishReason.STOP)
                elif r.generated >= r.params.max_new_tokens or (
                    self.max_context and len(r.prompt) + r.generated >= self.max_context
                ):
                    self._finish(r, FinishReason.LENGTH)
            self._generated_tokens += produced


def _stop_at_exit(ref: weakref.ref[HFEngine]) -> None:
    engine = ref()
    if engine is None:
        return
    with engine._cond:
        engine._closed = True
        engine._cond.notify_all()
    engine._thread.join(timeout=30)


__all__ = ["EngineFailedError", "HFEngine"]
