"""The hf engine's continuous-batching scheduler: the waiting queue, the running batch over one
shared left-padded KV cache, and the steps the decode loop runs on them.

A request waits in the queue until :mod:`.admission` lets it join (row limit, KV budget); it is
then prefilled, samples its first token and joins the batch, which decodes one token per row
per step. A finished, cancelled or interrupted row leaves at the next scheduling round. How each
step's tokens are drawn is :mod:`.sampler`'s.

Locking: every queue, batch and request-flag change happens under the engine's condition
(``cond``, shared so the decode loop's wait sees the engine's pause state and this queue
together); methods named ``*_locked`` expect the caller to hold it. The forward passes
(:meth:`Scheduler.prefill`, :meth:`Scheduler.decode`) run without it, under the engine's model
lock, so only the decode thread, or a weight swap holding the model lock, ever changes the
batch while they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from areal_servers.rollout.admission import admit
from areal_servers.rollout.engine import FinishReason, SamplingConfig, TokenEvent
from areal_servers.rollout.sampler import sample
from transformers import DynamicCache, PreTrainedModel

from areal_grpc.named_adapters import BASE_ROWS, RowAdapters

__all__ = ["EngineFailedError", "Request", "Scheduler", "slots"]

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]


class EngineFailedError(RuntimeError):
    """The decode loop died; every request in flight (and any later one) gets this."""


@dataclass(eq=False)
class Request:
    """One sample in flight: its prompt, sampling settings and the caller's event queue."""

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
    # The peft adapter this row computes (a named adapter's engine-internal name); "": the
    # run's own policy.
    adapter: str = ""
    cancelled: bool = False
    done: bool = False

    def emit(self, event: TokenEvent | BaseException) -> None:
        """Hands ``event`` to the caller's event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:
            # The caller's event loop is gone: nobody is listening any more.
            self.cancelled = True

    def finish(self, reason: FinishReason) -> None:
        """Ends the request with ``reason`` (once; later calls do nothing)."""
        if self.done:
            return
        self.done = True
        self.emit(TokenEvent(finish=reason))

    def fail(self, error: BaseException) -> None:
        """Ends the request by raising ``error`` to its caller (once)."""
        if self.done:
            return
        self.done = True
        self.emit(error)


@dataclass
class _Batch:
    """The running rows: request i owns row i of every cache tensor and of ``mask``."""

    requests: list[Request] = field(default_factory=list)
    kv: KV = field(default_factory=list)
    # The live cache object holding ``kv``, reused while the rows stay the same (building one
    # from tensors costs a copy of the whole cache); None after rows joined or left.
    cache: DynamicCache | None = None
    # [B, T] 1 where the cache holds a real token (left padding is 0).
    mask: torch.Tensor | None = None


def slots(req: Request) -> int:
    """KV cache slots a request may need: its prompt and every token it may generate."""
    return len(req.prompt) + req.params.max_new_tokens


def _pad_left(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class Scheduler:
    """The waiting queue and the running batch of one model, and the steps that advance them."""

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        cond: threading.Condition,
        *,
        max_running: int,
        max_batch_tokens: int | None,
        max_context: int = 0,
        seed: int = 0,
    ) -> None:
        """Batches requests for ``model`` (already on ``device``) under ``cond``: at most
        ``max_running`` rows within ``max_batch_tokens`` KV slots (None: no budget); a row
        ends LENGTH at ``max_context`` (0: none); unseeded rows sample from a stream seeded
        with ``seed``."""
        self.model = model
        self.device = device
        self.cond = cond
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.max_context = max_context
        self.pending: deque[Request] = deque()
        # Taken off the queue and being prefilled (in neither ``pending`` nor the batch yet).
        self.admitting: list[Request] = []
        self.batch = _Batch()
        # Tokens sampled for live requests since the start.
        self.generated_tokens = 0
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        # Rows the embedding can look up and the sampler may return (the lm_head can have
        # more rows than the embedding, e.g. padded vocabularies).
        emb = model.get_input_embeddings()
        self.token_limit = min(
            n
            for n in (int(model.config.vocab_size), int(getattr(emb, "num_embeddings", 0) or 0))
            if n > 0
        )
        self._warned_nonfinite = False
        # Set while the model holds named adapters: every forward pass then names each row's
        # adapter (peft's mixed-adapter batch), the run's own rows ``own_adapter``; the
        # engine reinstalls the hooks whenever it adds or drops LoRA layers.
        self.mixed = False
        self.own_adapter = BASE_ROWS
        self.row_adapters = RowAdapters()

    @contextlib.contextmanager
    def _rows(self, reqs: list[Request]) -> Iterator[None]:
        """Within it, each row computes its request's adapter (nothing to do when the model
        computes one policy for all)."""
        if not self.mixed:
            yield
            return
        self.row_adapters.names = [r.adapter or self.own_adapter for r in reqs]
        try:
            yield
        finally:
            self.row_adapters.names = None

    # ------------------------------------------------------------------------- requests

    def submit_locked(self, req: Request) -> None:
        """Queues ``req`` behind every request already waiting."""
        self.pending.append(req)

    def cancel(self, req: Request) -> None:
        """Marks ``req`` cancelled: it leaves the queue now, or the batch at the next round."""
        with self.cond:
            req.cancelled = True
            with contextlib.suppress(ValueError):
                self.pending.remove(req)
            self.cond.notify_all()

    def has_work_locked(self) -> bool:
        """Whether a request waits or a row runs."""
        return bool(self.pending or self.batch.requests)

    def running_locked(self) -> int:
        """Rows of the batch still generating."""
        return sum(1 for r in self.batch.requests if not r.cancelled and not r.done)

    def in_flight_locked(self) -> int:
        """Rows of the batch plus the requests being prefilled to join it."""
        return len(self.batch.requests) + len(self.admitting)

    def take_all_locked(self) -> list[Request]:
        """Empties the queue, the admission and the batch; returns their requests, unended."""
        leftovers = list(self.pending) + self.admitting + list(self.batch.requests)
        self.pending.clear()
        self.admitting = []
        self.batch = _Batch()
        return leftovers

    # ----------------------------------------------------------------------- scheduling

    def admit_locked(self) -> list[Request]:
        """Takes off the queue the requests that join the batch this round (see
        :func:`.admission.admit`); they count as admitting until :meth:`joined_locked`."""
        self.admitting = admit(
            self.pending, self.batch.requests, self.max_running, self.max_batch_tokens, slots
        )
        return self.admitting

    def joined_locked(self) -> None:
        """Ends the round's admission once its prefill is done."""
        self.admitting = []
        # Rows cancelled or finished meanwhile (during the prefill, or since the round began)
        # leave before the step, so no stale row is ever fed to the model.
        self.drop_finished_locked()

    def interrupt_all_locked(self) -> int:
        """Ends every live row INTERRUPTED and empties the batch; returns how many ended."""
        interrupted = 0
        for req in self.batch.requests:
            if not req.cancelled and not req.done:
                interrupted += 1
                req.finish(FinishReason.INTERRUPTED)
        self.batch = _Batch()
        return interrupted

    def drop_finished_locked(self) -> None:
        """Removes finished and cancelled rows (and the padding columns they leave)."""
        keep = [i for i, r in enumerate(self.batch.requests) if not r.cancelled and not r.done]
        if len(keep) == len(self.batch.requests):
            return
        if not keep:
            self.batch = _Batch()
            return
        index = torch.tensor(keep, device=self.device)
        mask = self.batch.mask
        assert mask is not None
        mask = mask.index_select(0, index)
        # Columns that are padding in every remaining row carry nothing: trim them.
        valid_cols = torch.nonzero(mask.any(dim=0)).flatten()
        start = int(valid_cols[0]) if valid_cols.numel() else mask.shape[1]
        kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in self.batch.kv
        ]
        self.batch = _Batch(
            requests=[self.batch.requests[i] for i in keep], kv=kv, mask=mask[:, start:]
        )

    # ------------------------------------------------------------------------- forwards

    def prefill(self, admitted: list[Request], version: int) -> None:
        """Runs the prompts of ``admitted``, samples their first tokens (tagged ``version``)
        and merges the rows still live into the batch."""
        # Same-length prompts are prefilled together without padding (the n samples of one
        # prompt always share a length), so prefill never attends over pad tokens.
        by_length: dict[int, list[Request]] = {}
        for req in admitted:
            by_length.setdefault(len(req.prompt), []).append(req)
        for length, reqs in by_length.items():
            ids = torch.tensor([r.prompt for r in reqs], dtype=torch.long, device=self.device)
            with self._rows(reqs):
                out = self.model(input_ids=ids, use_cache=True)
            logits = out.logits[:, -1, :].float()
            self.sample_and_emit(reqs, logits, version)
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

    def _merge(self, reqs: list[Request], kv: KV, mask: torch.Tensor) -> None:
        with self.cond:
            batch = self.batch
            if not batch.requests:
                self.batch = _Batch(requests=list(reqs), kv=kv, mask=mask)
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
            self.batch = _Batch(requests=batch.requests + reqs, kv=merged_kv, mask=merged_mask)

    def decode(self, version: int) -> None:
        """One token for every row of the batch (tagged ``version``); nothing when it is empty."""
        batch = self.batch
        if not batch.requests:
            return
        assert batch.mask is not None
        # Cancelled rows still ride along this step (their tokens are discarded); they are
        # removed at the next scheduling round.
        toks = [r.pending_token for r in batch.requests]
        bad = [i for i, t in enumerate(toks) if not 0 <= t < self.token_limit]
        if bad:
            # Cannot happen for a live row; a dead one rides along with a harmless id.
            with self.cond:
                for i in bad:
                    r = batch.requests[i]
                    if not (r.cancelled or r.done):
                        log.error(
                            "hf engine: request %d has no valid next token %d", r.rid, toks[i]
                        )
                        r.fail(EngineFailedError(f"invalid next token {toks[i]} (internal error)"))
                    toks[i] = 0
        ids = torch.tensor([[t] for t in toks], dtype=torch.long, device=self.device)
        positions = batch.mask.sum(dim=1, keepdim=True)
        mask = torch.cat([batch.mask, torch.ones_like(positions)], dim=1)
        cache = batch.cache
        if cache is None:
            cache = DynamicCache(ddp_cache_data=batch.kv, config=self.model.config)
        with self._rows(batch.requests):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        with self.cond:
            if self.batch is batch:
                self.batch = _Batch(
                    requests=batch.requests, kv=kv, mask=mask, cache=out.past_key_values
                )
        self.sample_and_emit(batch.requests, out.logits[:, -1, :].float(), version)

    def sample_and_emit(self, reqs: list[Request], logits: torch.Tensor, version: int) -> None:
        """Draws row i's next token from ``logits[i]`` for each live request of ``reqs``,
        sends it to the caller and ends the request at a stop token or its length limit."""
        # Only ids the embedding (and the tokenizer) know may be sampled.
        drawn = sample(
            logits[:, : self.token_limit],
            [r.params for r in reqs],
            self._generator,
            [r.generator for r in reqs],
        )
        if drawn.fell_back and not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("hf engine: non-finite logits at version %d; using argmax", version)
        tokens_l, logp_l, tops = drawn.tokens, drawn.logprobs, drawn.top
        produced = 0
        with self.cond:
            for r, tok, lp, top in zip(reqs, tokens_l, logp_l, tops, strict=True):
                if r.cancelled or r.done:
                    continue
                r.generated += 1
                r.pending_token = tok
                produced += 1
                r.emit(TokenEvent([tok], [lp], [version], top=top))
                if tok in r.stop_ids:
                    r.finish(FinishReason.STOP)
                elif r.generated >= r.params.max_new_tokens or (
                    self.max_context and len(r.prompt) + r.generated >= self.max_context
                ):
                    r.finish(FinishReason.LENGTH)
            self.generated_tokens += produced
