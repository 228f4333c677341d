"""The inference-engine interface shared by the ``hf`` and ``sglang`` engines.

An engine turns token ids into sampled tokens, each with its log-probability and the policy
version that produced it. It can be paused at a token boundary (in-flight requests end with
``FinishReason.INTERRUPTED`` and their partial output) and resumed, and its weights can be
swapped atomically for a newer version.

Log-probabilities are taken under the *sampling distribution*: ``log_softmax(logits / T)``,
after temperature and before top-p / top-k truncation (as ``Completion.output_logprobs`` in
rollout.proto says). Greedy decoding (T = 0) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
from arealgrpc.v1 import common_pb2, rollout_pb2

from areal_grpc.errors import FieldError, NotFoundError, UnavailableError
from areal_grpc.sampling import MIN_TEMPERATURE

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDied(UnavailableError):
    """The engine's own processes or loop died, or stopped answering: nothing more runs on it.

    Every engine raises it for every call once that happened (a generate, a weight load, a
    health ping), with the same reason; the rollout server then stops taking work, answers
    UNAVAILABLE, and exits (:data:`areal_grpc.server.EXIT_FATAL`) so that its launcher
    replaces it. Work that fails this way is the server's fault, not the episode's: the
    coordinator runs it again elsewhere.
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"the {kind} engine died: {reason}")
        self.reason = reason


class FinishReason(enum.IntEnum):
    """Why a generation ended; values equal ``arealgrpc.v1.FinishReason``."""

    UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
    STOP = common_pb2.FINISH_REASON_STOP
    LENGTH = common_pb2.FINISH_REASON_LENGTH
    INTERRUPTED = common_pb2.FINISH_REASON_INTERRUPTED
    CANCELLED = common_pb2.FINISH_REASON_CANCELLED


# Most alternatives a request may ask for per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20

# The most likely tokens at one position: (ids, log-probs), most likely first.
TopLogprobs = tuple[list[int], list[float]]


def top_logprobs_proto(top: Sequence[TopLogprobs]) -> list[rollout_pb2.TopLogprobs]:
    """As ``arealgrpc.v1.TopLogprobs`` messages."""
    return [rollout_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in top]


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters of one request (one sample; ``n_samples`` is for callers)."""

    # 0 means greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 means no limit.
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    n_samples: int = 1
    ignore_eos: bool = False
    # Seed of this request's sampling (None: the engine's own stream); see SamplingParams.
    seed: int | None = None
    # Most likely alternatives reported per generated token (0: none).
    top_logprobs: int = 0

    def validate(self, where: str = "sampling") -> None:
        """Raises :class:`FieldError` naming the first bad field."""
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise FieldError(f"{where}.temperature", f"must be >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # logits / T overflows to inf for tiny T, and the log-probs become NaN.
            raise FieldError(
                f"{where}.temperature",
                f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise FieldError(f"{where}.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FieldError(f"{where}.top_k", f"must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise FieldError(f"{where}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.n_samples < 1:
            raise FieldError(f"{where}.n_samples", f"must be >= 1, got {self.n_samples}")
        for i, tok in enumerate(self.stop_token_ids):
            if tok < 0:
                raise FieldError(f"{where}.stop_token_ids[{i}]", f"negative token id {tok}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise FieldError(
                f"{where}.top_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
            )

    @classmethod
    def from_proto(
        cls,
        msg: common_pb2.SamplingParams,
        *,
        default_max_new_tokens: int,
        where: str = "sampling",
    ) -> SamplingConfig:
        """Server defaults for unset fields; FieldError for bad values (n_samples 0 -> 1)."""
        if msg.max_new_tokens < 0:
            raise FieldError(f"{where}.max_new_tokens", f"must be >= 1, got {msg.max_new_tokens}")
        if msg.n_samples < 0:
            raise FieldError(f"{where}.n_samples", f"must be >= 1, got {msg.n_samples}")
        cfg = cls(
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k,
            max_new_tokens=msg.max_new_tokens or default_max_new_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            n_samples=msg.n_samples or 1,
            ignore_eos=msg.ignore_eos,
            seed=msg.seed if msg.HasField("seed") else None,
            top_logprobs=msg.top_logprobs,
        )
        cfg.validate(where)
        return cfg

    def to_proto(self) -> common_pb2.SamplingParams:
        """The proto form (every field set explicitly)."""
        return common_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
            n_samples=self.n_samples,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            top_logprobs=self.top_logprobs,
        )

    def with_updates(self, **changes: object) -> SamplingConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass
class TokenEvent:
    """Tokens decoded since the previous event, or the end of a request (``finish`` set)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    # Per token, the most likely (ids, log-probs) when the request asked for them.
    top: list[TopLogprobs] = field(default_factory=list)


@dataclass
class GenerationResult:
    """One finished (or interrupted) sample."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    output_top: list[TopLogprobs] = field(default_factory=list)

    def extend(self, event: TokenEvent) -> None:
        """Appends an event's tokens (and its finish reason, when it has one)."""
        self.output_ids += event.token_ids
        self.output_logprobs += event.logprobs
        self.output_versions += event.versions
        self.output_top += event.top
        if event.finish is not None:
            self.finish_reason = event.finish

    def to_proto(self) -> rollout_pb2.Completion:
        """As an ``arealgrpc.v1.Completion``."""
        return rollout_pb2.Completion(
            output_ids=self.output_ids,
            output_logprobs=self.output_logprobs,
            output_versions=self.output_versions,
            finish_reason=int(self.finish_reason),
            output_top_logprobs=top_logprobs_proto(self.output_top),
        )


@dataclass(frozen=True)
class AdapterLoad:
    """What loading a named adapter did."""

    name: str
    nbytes: int
    adapted_layers: int
    replaced: bool


@dataclass(frozen=True)
class EngineStatus:
    """Load and version numbers of an engine."""

    version: int
    running: int
    queued: int
    paused: bool
    generated_tokens: int


class InferenceEngine(abc.ABC):
    """Token-in / token-out generation with per-token versions, pause/resume, weight swap."""

    #: "hf" or "sglang".
    kind: str = ""
    #: Model name or local path.
    model_name: str = ""
    #: Token ids must be below this.
    vocab_size: int = 0
    #: Longest prompt + output the model accepts.
    max_context: int = 0
    #: Longest prompt + output one request may take of the server's memory budget (0: none).
    max_request_tokens: int = 0
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    #: Weight updates bring LoRA adapters only; the base weights stay as loaded.
    adapters_only: bool = False
    #: Bytes the engine gives named adapters (:meth:`load_adapter`); 0: it serves none.
    max_adapter_bytes: int = 0
    #: Why the engine died (:meth:`died`); None while it serves.
    failure: str | None = None
    #: The dtype of the floating-point weights an update brings (what the engine serves
    #: them in): senders are told to send it. None: any (the engine converts).
    weights_dtype: torch.dtype | None = None

    # ------------------------------------------------------------------------ death

    def on_death(self, listener: Callable[[str], None]) -> None:
        """Calls ``listener(reason)`` once, when the engine dies (at once if it has)."""
        if self.failure is not None:
            listener(self.failure)
            return
        self.__dict__.setdefault("_death_listeners", []).append(listener)

    def died(self, reason: str) -> EngineDied:
        """Records that the engine died (the first reason stands), tells the listeners, and
        returns the error for the caller to raise."""
        if self.failure is None:
            self.failure = reason
            log.critical("%s engine failed: %s; this rollout server exits", self.kind, reason)
            for listener in self.__dict__.pop("_death_listeners", []):
                listener(reason)
        return EngineDied(self.kind, self.failure)

    def check_alive(self) -> None:
        """Raises :class:`EngineDied` once the engine has died."""
        if self.failure is not None:
            raise EngineDied(self.kind, self.failure)

    @abc.abstractmethod
    def stream(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> AsyncGenerator[TokenEvent, None]:
        """Generates one sample, yielding tokens as decoded; the last event has ``finish``.

        ``adapter``: the named adapter (:meth:`load_adapter`) that generates it; "" the run's
        own policy. Closing the iterator early (or cancelling the consuming task) cancels the
        request and frees its slot.
        """

    async def generate(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> GenerationResult:
        """Generates one sample and returns it whole (an interrupted one ends INTERRUPTED)."""
        result = GenerationResult()
        stream = self.stream(input_ids, params, adapter)
        try:
            async for event in stream:
                result.extend(event)
        finally:
            await stream.aclose()
        return result

    async def generate_n(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> list[GenerationResult]:
        """``params.n_samples`` independent samples, decoded concurrently (a seeded request's
        sample i uses seed + i), by the named ``adapter`` ("": the run's own policy)."""
        seeds = [
            None if params.seed is None else (params.seed + i) % 2**64
            for i in range(params.n_samples)
        ]
        return list(
            await asyncio.gather(
                *(
                    self.generate(input_ids, params.with_updates(n_samples=1, seed=seed), adapter)
                    for seed in seeds
                )
            )
        )

    @abc.abstractmethod
    async def pause(self, wait: bool = True) -> int:
        """Stops decoding at the next token boundary; returns how many requests it interrupted.

        Requests submitted while paused wait until :meth:`resume`. ``wait`` False: returns
        once no new step will start, with the number of requests running then; those end
        INTERRUPTED when the step in progress ends, and :meth:`load_weights` swaps only after
        that (an engine that cannot tell waits anyway).
        """

    @abc.abstractmethod
    async def resume(self) -> None:
        """Resumes decoding."""

    @abc.abstractmethod
    async def wait_until_resumed(self) -> None:
        """Returns at once when not paused, else when :meth:`resume` is called."""

    async def start(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op here
        """Gets ready to serve; an engine backed by a server of its own launches or reaches
        it here (default: nothing to do)."""

    @abc.abstractmethod
    async def load_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, owned: bool = False
    ) -> dict[str, torch.Tensor]:
        """Swaps in a full state dict atomically, serving ``version`` from then on.

        ``owned``: the caller hands the tensors over (fresh, referenced by nobody else, never
        changed afterwards), so the engine may keep them without a copy and hand back the
        tensors they replaced, by name, for the caller to reuse (an engine that copies may
        hand back the given ones once it is done with them); ``{}`` when it hands nothing
        back. Raises
        :class:`areal_grpc.errors.PreconditionError` unless ``version`` is newer than the
        served one, and ValueError (nothing changed) when the state dict does not match.
        """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights being served (0 for the initial weights)."""

    @abc.abstractmethod
    def status(self) -> EngineStatus:
        """Current load and version numbers."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Cancels everything in flight and releases resources."""

    # ---------------------------------------------------------------- named adapters

    def adapters(self) -> list[str]:
        """Names of the named adapters held (:meth:`load_adapter`), sorted; none by default."""
        return []

    def check_adapter(self, name: str, field: str = "adapter") -> None:
        """NotFoundError naming ``field`` unless ``name`` is "" (the run's own policy) or a
        named adapter the engine holds."""
        if name and name not in self.adapters():
            raise NotFoundError(field, f"no adapter {name!r} is loaded")

    async def load_adapter(
        self, name: str, tensors: Mapping[str, torch.Tensor], rank: int, alpha: float
    ) -> AdapterLoad:
        """Holds the LoRA adapter ``tensors`` (peft's saved names) as ``name`` from now on,
        replacing a load of that name (requests running on it finish on it). FieldError for a
        bad name or tensors that do not match the model, ExhaustedError at the caps.
        Engines without named adapters raise NotImplementedError."""
        raise NotImplementedError(f"the {self.kind or 'this'} engine serves no named adapters")

    async def remove_adapter(self, name: str) -> int:
        """Stops serving ``name`` (requests running on it finish on it); returns the bytes held
        for named adapters once those are freed. NotFoundError when ``name`` is not held."""
        raise NotFoundError("name", f"no adapter {name!r} is loaded")

    def check_prompt(
        self,
        input_ids: Sequence[int],
        params: SamplingConfig,
        ids_field: str = "input_ids",
        max_new_field: str = "sampling.max_new_tokens",
    ) -> None:
        """FieldError unless the prompt is non-empty, in the vocabulary and fits the context."""
        if len(input_ids) == 0:
            raise FieldError(ids_field, "must not be empty")
        for i, tok in enumerate(input_ids):
            if not 0 <= tok < self.vocab_size:
                raise FieldError(
                    f"{ids_field}[{i}]",
                    f"token id {tok} is outside the vocabulary (size {self.vocab_size})",
                )
        limit = self.max_request_tokens
        if limit and len(input_ids) + params.max_new_tokens > limit:
            raise FieldError(
                max_new_field,
                f"prompt ({len(input_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the server's max_batch_tokens ({limit})",
            )
        if self.max_context and len(input_ids) >= self.max_context:
            raise FieldError(
                ids_field,
                f"prompt of {len(input_ids)} tokens leaves no room in the model's context "
                f"of {self.max_context}",
            )
        if self.max_context and len(input_ids) + params.max_new_tokens > self.max_context:
            raise FieldError(
                max_new_field,
                f"prompt ({len(input_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the model's context of {self.max_context}",
            )


class AdapterBound:
    """An engine whose generations use one named adapter unless told another: what an episode's
    workflow gets as its engine when the task names an adapter, so that every way a workflow
    generates (generate, generate_n, stream, generate_resumable) uses it. Everything else is
    the engine's."""

    def __init__(self, engine: InferenceEngine, adapter: str) -> None:
        """Generations on ``engine`` by ``adapter``."""
        self._engine = engine
        self.adapter = adapter

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def stream(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> AsyncGenerator[TokenEvent, None]:
        """The engine's :meth:`InferenceEngine.stream` by the bound adapter."""
        return self._engine.stream(input_ids, params, adapter or self.adapter)

    async def generate(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> GenerationResult:
        """The engine's :meth:`InferenceEngine.generate` by the bound adapter."""
        return await self._engine.generate(input_ids, params, adapter or self.adapter)

    async def generate_n(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> list[GenerationResult]:
        """The engine's :meth:`InferenceEngine.generate_n` by the bound adapter."""
        return await self._engine.generate_n(input_ids, params, adapter or self.adapter)


class PauseGate:
    """The pause state of an engine backed by a server of its own: requests wait here while
    generation is paused, counted as queued, and go on at resume."""

    def __init__(self) -> None:
        self.paused = False
        self.queued = 0
        self._open = asyncio.Event()
        self._open.set()

    async def enter(self) -> None:
        """Returns at once when not paused, else at resume (counted as queued meanwhile)."""
        self.queued += 1
        try:
            await self._open.wait()
        finally:
            self.queued -= 1

    def close(self) -> None:
        """Generation is paused: requests that arrive wait."""
        self.paused = True
        self._open.clear()

    def open(self) -> None:
        """Generation resumes: waiting requests go on."""
        self.paused = False
        self._open.set()

    async def wait_open(self) -> None:
        """Returns when generation is not paused."""
        await self._open.wait()


async def unless_dead(engine: InferenceEngine, death: asyncio.Event, call: Awaitable[T]) -> T:
    """Awaits ``call`` unless ``engine`` dies first (``death`` is set when it does): an engine
    with processes of its own may never answer a call that waited on one that died.
    :class:`EngineDied` either way."""
    task = asyncio.ensure_future(call)
    dead = asyncio.ensure_future(death.wait())
    try:
        await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        dead.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        if engine.failure is None:
            raise asyncio.CancelledError
        raise EngineDied(engine.kind, engine.failure)
    return task.result()


async def generate_resumable(
    engine: InferenceEngine, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
) -> GenerationResult:
    """Generates one sample to completion across pauses (AReaL's ``RemoteInfEngine.agenerate``).

    When a pause interrupts the request, it is re-sent after resume as prompt + partial
    output with the remaining token budget, so the result can mix policy versions; the
    partial tokens keep the version that produced them.
    """
    prompt = list(input_ids)
    result = GenerationResult()
    budget = params.max_new_tokens
    while True:
        chunk = await engine.generate(
            prompt + result.output_ids,
            params.with_updates(max_new_tokens=budget - len(result.output_ids)),
            adapter,
        )
        result.extend(
            TokenEvent(
                chunk.output_ids,
                chunk.output_logprobs,
                chunk.output_versions,
                top=chunk.output_top,
            )
        )
        if chunk.finish_reason != FinishReason.INTERRUPTED:
            result.finish_reason = chunk.finish_reason
            return result
        if len(result.output_ids) >= budget:
            result.finish_reason = FinishReason.LENGTH
            return result
        await engine.wait_until_resumed()


__all__ = [
    "AdapterBound",
    "AdapterLoad",
    "EngineDied",
    "EngineStatus",
    "FinishReason",
    "GenerationResult",
    "InferenceEngine",
    "PauseGate",
    "SamplingConfig",
    "TokenEvent",
    "generate_resumable",
    "unless_dead",
]
