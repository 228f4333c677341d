"""The ``vllm`` engine: generation on vLLM's async engine, in the rollout server's process.

vLLM runs its scheduler (EngineCore) and model worker as processes of its own; ``AsyncLLM``
in this process talks to them. vLLM is imported lazily (in :meth:`VLLMEngine.start`), so the
default install runs without it. Settings: ``rollout.vllm`` (:class:`VllmSettings`).

The engine contract, and how vLLM is made to keep it:

* Token ids in and out: prompts go in as ``TokensPrompt``, vLLM's tokenizer is never loaded
  (``skip_tokenizer_init``), so nothing is decoded and re-encoded. End-of-turn ids (the
  tokenizer's EOS and the generation config's) are passed as ``stop_token_ids``.
* Log-probs in our convention, ``log_softmax(logits / T)`` before truncation: vLLM computes
  them after temperature with ``logprobs_mode="processed_logprobs"``, but after top-p/top-k
  truncation too, so those two are refused (FieldError naming the field) unless off. Greedy
  requests get ``log_softmax(logits)``, as ours do.
* Pause for a weight update, ``rollout.vllm.pause_mode``:

  - ``abort`` (the default): requests in flight end with their partial output as INTERRUPTED
    and ``generate_resumable`` sends them again after resume. A request that raced the pause
    (it reached vLLM after the abort) is caught by the swap counter: any output that arrives
    after a swap began, for a request that started before it, ends that request INTERRUPTED
    without those tokens.
  - ``keep``: vLLM holds the requests, drops their KV cache and recomputes it under the new
    weights on resume, then goes on. vLLM labels each step with the served version
    (``update_weight_version``) and reports the spans on a request's final output; a request
    that lived through a swap holds back what arrives after the swap began until those spans
    say which version made each token (a request without spans ends INTERRUPTED instead).

  Either way every token carries the version it was generated under.
* Weight updates: socket and stream hand :meth:`load_weights` a state dict; it is checked
  against the checkpoint's names and shapes (nothing changes on a mismatch), staged in a
  safetensors file in shared memory that the next version is received straight into
  (:mod:`areal_servers.rollout.weight_staging`), and loaded by our worker extension
  (:mod:`areal_servers.rollout.vllm_worker`) through vLLM's layerwise reload. Disk and shared
  memory updates arrive as safetensors files: :meth:`load_weight_files` checks their headers
  and the worker reads them directly. A distributed update goes to the worker itself: it
  joins the sender's weight group (gloo, or NCCL GPU to GPU) and takes the broadcast while
  vLLM goes on generating (:meth:`receive_group`), then :meth:`load_received` swaps it in.
* LoRA (``model.lora.rank > 0``): updates bring adapters only, each loaded as a run-time
  adapter per version; a request runs on the adapter current when it started, and a
  replaced adapter is removed once no request uses it.
* Supervision: vLLM's processes are pinged every ``health_interval_s``; one that has died or
  does not answer within ``health_timeout_s``, or any call that finds vLLM's engine process
  dead (vLLM's ``EngineDeadError``), is the engine's death (:class:`EngineDied`, named
  :data:`ENGINE_PROCESS_DIED` on every path): the server stops taking work and exits (code 3)
  so its launcher replaces it, instead of a server that accepts work it can never finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
from areal_servers.rollout.adapters import (
    AdapterBook,
    NamedAdapters,
    check_adapter_update,
    write_adapter,
    write_peft_dir,
)
from areal_servers.rollout.engine import (
    AdapterLoad,
    EngineDied,
    EngineStatus,
    FinishReason,
    InferenceEngine,
    PauseGate,
    SamplingConfig,
    TokenEvent,
    TopLogprobs,
    unless_dead,
)
from areal_servers.rollout.served_model import (
    TensorSpec,
    check_specs,
    checkpoint_shapes,
    end_token_ids,
    file_specs,
    served_checkpoint,
    tensor_specs,
)
from areal_servers.rollout.weight_staging import StagedFile

from areal_grpc.config import LoraSettings, VllmSettings
from areal_grpc.errors import DataLossError, FieldError, PreconditionError
from areal_grpc.model import load_tokenizer
from areal_grpc.named_adapters import (
    CheckedAdapter,
    check_adapter_name,
    check_adapter_shapes,
    peft_tensors,
)
from areal_grpc.paths import remove_owned
from areal_grpc.precision import choose_dtype
from areal_grpc.shared_memory import own_root
from areal_grpc.weight_transfer import GroupParams

__all__ = ["ENGINE_PROCESS_DIED", "VLLMEngine", "vllm_available"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How a death of vLLM's engine process is named, whichever call found it (a generate, a weight
# load, the watchdog's ping), so that logs and tests read one cause.
ENGINE_PROCESS_DIED = "its engine process died"
# The longest context used when rollout.vllm.max_model_len is 0 (the KV cache must hold one
# sequence of that length).
DEFAULT_MAX_MODEL_LEN = 4096
# Head sizes vLLM's CPU attention backend serves (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Tokens one step of vLLM on a CPU takes at least (vLLM's own default for its LLM class there).
CPU_STEP_TOKENS = 4096
# vLLM's LoRA slots take one of these ranks (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM ids of named adapters start here, above any policy version (a run's adapter's id).
NAMED_ADAPTER_IDS = 1 << 30
# Shared memory for the weight file when it has room, else the temporary directory.
WORKER_EXTENSION = "areal_servers.rollout.vllm_worker.WorkerExtension"

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


def vllm_available() -> bool:
    """Whether vLLM can be imported here (the ``vllm`` extra is installed)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` or an exception in its cause/context chain is a ``kind``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class VLLMEngine(InferenceEngine):
    """An :class:`InferenceEngine` on vLLM's ``AsyncLLM`` (CPU or GPU)."""

    kind = "vllm"

    def __init__(
        self,
        model: str,
        settings: VllmSettings | None = None,
        *,
        seed: int = 0,
        dtype: str = "float32",
        lora: LoraSettings | None = None,
        max_adapters: int = 16,
        max_adapter_bytes: int = 1 << 30,
    ) -> None:
        """Serves ``model`` with vLLM in ``dtype`` (a rollout.dtype setting); ``max_adapters``
        named adapters of ``max_adapter_bytes`` together at most (when
        ``settings.max_adapter_rank`` lets vLLM serve any)."""
        self.settings = settings or VllmSettings()
        self.model_name = model
        self.seed = seed
        self.dtype, self._dtype_why = choose_dtype(
            dtype, "cuda" if torch.cuda.is_available() else "cpu"
        )
        self.weights_dtype = getattr(torch, self.dtype)
        self.lora = lora or LoraSettings()
        self.adapters_only = self.lora.rank > 0
        self._llm: Any = None
        self._version = 0
        self._gate = PauseGate()
        # vLLM's pause under way or done, until resume (see pause's wait).
        self._pausing: asyncio.Future[None] | None = None
        # Weight swaps begun so far: a request that sees this change under it ends INTERRUPTED.
        self._swaps = 0
        self._inflight: set[str] = set()
        self._generated_tokens = 0
        self._update_lock = asyncio.Lock()
        self._adapters = AdapterBook()
        self._adapter_ids: dict[str, int] = {}
        self._unloads: set[asyncio.Task[None]] = set()
        # Named adapters (LoadAdapter): vLLM's adapter id and directory of each load, by its
        # internal name; ids above every policy version's (a run's adapters use the version).
        self._named = NamedAdapters(max_adapters, max_adapter_bytes)
        named = self.settings.max_adapter_rank > 0 and max_adapters > 0
        self.max_adapter_bytes = max_adapter_bytes if named else 0
        self._named_ids: dict[str, int] = {}
        self._named_dirs: dict[str, Path] = {}
        self._next_named_id = itertools.count(NAMED_ADAPTER_IDS)
        # The file full updates are staged in (see weight_staging), and its directory.
        self._staged: StagedFile | None = None
        self._staging: Path | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False
        # Directories this engine made (the built-in model's checkpoint, weight files).
        self._owned: list[Path] = []
        self._served_dir = ""
        # Checkpoint tensor names and shapes a full update must match (empty: not known).
        self._expected: dict[str, tuple[int, ...]] = {}
        self._tied = False
        self.end_token_ids: frozenset[int] = frozenset()
        # Seconds the last full update took: writing its file, and vLLM's reload of it.
        self.last_load_s: tuple[float, float] = (0.0, 0.0)
        # Bytes the last full update copied into its staged file (0: received in place).
        self.last_staged_bytes = 0
        # The UUID of the GPU vLLM's worker runs on ("" on a CPU): NCCL from a sender on the
        # same GPU cannot form a group.
        self.device_uuid = ""
        # What the worker is receiving or has received from a weight group (name, shape,
        # floating point, dtype name), checked against the model before it is loaded.
        self._received: dict[str, TensorSpec] = {}
        # Where vLLM's processes put their socket files (see _build).
        self.rpc_dir: Path | None = None
        # The weight group vLLM's worker is in (None: none, or not known to be usable).
        self.worker_group: GroupParams | None = None
        # Set when the engine dies (see _guard).
        self._death = asyncio.Event()
        self.on_death(self._engine_died)

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Starts vLLM (its processes, the model load): seconds to minutes."""
        if self._llm is not None:
            return
        served = await asyncio.to_thread(self._prepare_model)
        self._served_dir = served
        config = json.loads((Path(served) / "config.json").read_text())
        self._check_model(config)
        self._tied = bool(config.get("tie_word_embeddings", False))
        self.vocab_size = int(config["vocab_size"])
        context = int(config.get("max_position_embeddings", 0) or DEFAULT_MAX_MODEL_LEN)
        self.max_context = self.settings.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
        self._expected = await asyncio.to_thread(checkpoint_shapes, Path(served))
        tokenizer = load_tokenizer(self.model_name)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.end_token_ids = frozenset(end_token_ids(Path(served), self.eos_token_id))
        self._llm = self._build(served)
        # vLLM labels every step with this; a kept request's spans are read back in it.
        await self._llm.update_weight_version(str(self._version))
        changed = await self._llm.collective_rpc(
            "areal_idle_spin", args=(self.settings.idle_spin_s,)
        )
        if not any(changed):
            log.warning("vllm engine: found no message queue to set idle_spin_s on")
        if torch.cuda.is_available():
            self.device_uuid = _first(await self._llm.collective_rpc("areal_device_uuid"))
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        log.info(
            "vllm engine: %s (%s: %s, max_model_len %d, KV cache %.1f GiB)",
            self.model_name,
            self.dtype,
            self._dtype_why,
            self.max_context,
            self.settings.kv_cache_gib,
        )

    def _prepare_model(self) -> str:
        """The directory vLLM loads (see served_checkpoint)."""
        served, owned = served_checkpoint(self.model_name, self.seed, "vllm")
        if owned is not None:
            self._owned.append(owned)
        return served

    def _check_model(self, config: Mapping[str, Any]) -> None:
        """FieldError for a model vLLM's CPU backend cannot serve (it would fail deep inside)."""
        if torch.cuda.is_available():
            return
        heads = int(config.get("num_attention_heads", 1))
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
        if head_dim not in CPU_HEAD_SIZES:
            raise FieldError(
                "model.source",
                f"{self.model_name} has attention heads of size {head_dim}; vLLM's CPU backend "
                f"serves {', '.join(map(str, CPU_HEAD_SIZES))} (builtin:tiny has 32)",
            )

    def _build(self, served: str) -> Any:
        s = self.settings
        # No usage reports (there is no network here, and a run should not phone home), and
        # vLLM's own start-up limit follows ours.
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
        os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(s.start_timeout_s))
        # vLLM's processes talk over ZeroMQ sockets it names in VLLM_RPC_BASE_PATH (/tmp by
        # default) and leaves behind; ours go in a directory this engine removes at close
        # (and that dies with this process's shared-memory directory after a kill -9).
        self.rpc_dir = self._rpc_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        if s.reserved_cpus is not None:
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(s.reserved_cpus)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        lora: dict[str, Any] = {}
        if self.adapters_only or self.max_adapter_bytes:
            ranks = {"model.lora.rank": self.lora.rank}
            if self.max_adapter_bytes:
                ranks["rollout.vllm.max_adapter_rank"] = s.max_adapter_rank
            key, wanted = max(ranks.items(), key=lambda kv: kv[1])
            rank = next((r for r in LORA_RANKS if r >= wanted), None)
            if rank is None:
                raise FieldError(key, f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
            # The current adapter, the ones requests still run on, and named adapters.
            lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": s.max_loras}
        scheduling: dict[str, Any] = {}
        if not torch.cuda.is_available():
            # After a partial (chunked) prefill vLLM rewinds the request's seeded generator,
            # which a CPU generator cannot do: the engine process dies ("CPU Generator does
            # not use offset") as soon as seeded requests bring more prompt tokens than one
            # step takes. Whole prefills only, with a step budget any one prompt fits in.
            scheduling = {
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(self.max_context, CPU_STEP_TOKENS),
            }
        args = AsyncEngineArgs(
            model=served,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_context,
            max_num_seqs=s.max_num_seqs,
            kv_cache_memory_bytes=int(s.kv_cache_gib * (1 << 30)),
            enforce_eager=True,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            **lora,
            **scheduling,
        )
        return AsyncLLM.from_engine_args(args)

    async def close(self) -> None:
        """Stops vLLM's processes and removes what this engine wrote."""
        self._closed = True
        self._gate.open()
        tasks = [t for t in (self._watchdog, *self._unloads) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        llm, self._llm = self._llm, None
        if llm is not None:
            # Its output handler would report the engine's processes going away as a failure.
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
                with contextlib.suppress(BaseException):
                    await handler
            # vLLM sends SIGTERM, then kills what has not exited within its default 5 s.
            await asyncio.to_thread(llm.shutdown)
        if self._staged is not None:
            self._staged.path.unlink(missing_ok=True)
            self._staged = None
        for path in self._owned:
            shutil.rmtree(path, ignore_errors=True)
        self._owned.clear()

    # ------------------------------------------------------------------------- supervision

    async def _watch(self) -> None:
        """Pings vLLM's worker through its engine process; a failure is the engine's death."""
        s = self.settings
        while not self._closed and self.failure is None:
            await asyncio.sleep(s.health_interval_s)
            if self._closed:
                return
            reason = await self._ping(s.health_timeout_s)
            if reason is not None and not self._closed:
                self.died(reason)
                return

    async def _ping(self, timeout_s: float) -> str | None:
        """None when vLLM's processes answer within ``timeout_s``; else what is wrong."""
        llm = self._llm
        if llm is None:
            return None
        if llm.errored:
            return ENGINE_PROCESS_DIED
        try:
            await asyncio.wait_for(
                llm.collective_rpc("areal_ping", timeout=timeout_s), timeout=timeout_s
            )
        except asyncio.TimeoutError:
            # A ping sent just before the engine process died waits out its time instead of
            # failing: say what happened, not only that nothing answered.
            return self._dead_reason() or f"its processes did not answer within {timeout_s:g} s"
        except Exception as exc:
            return self._dead_reason(exc) or f"its worker failed the ping ({exc!r})"
        return None

    def _dead_reason(self, exc: BaseException | None = None) -> str | None:
        """:data:`ENGINE_PROCESS_DIED` when vLLM says its engine process is gone (its flag,
        or its error anywhere in ``exc``'s chain); else None."""
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._llm
        if (llm is not None and llm.errored) or _caused_by(exc, EngineDeadError):
            return ENGINE_PROCESS_DIED
        return None

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """Around calls into vLLM: one that fails because its engine process died raises
        :class:`EngineDied` (and the engine is dead from then on), whatever vLLM raised."""
        try:
            yield
        except EngineDied:
            raise
        except Exception as exc:
            reason = self._dead_reason(exc)
            if reason is None:
                raise
            raise self.died(reason) from exc

    def _engine_died(self, reason: str) -> None:
        """The engine's own death listener: requests waiting for a resume go on (and raise
        :class:`EngineDied`), and calls into vLLM under way stop waiting (:meth:`_guard`)."""
        self._gate.open()
        self._death.set()

    async def _guard(self, call: Awaitable[T]) -> T:
        """Awaits a call into vLLM unless the engine dies first (see unless_dead), with
        vLLM's own errors of a dead engine process named as its death."""
        with self._calling():
            return await unless_dead(self, self._death, call)

    async def _rpc(self, method: str, *args: Any) -> Any:
        """A call of our worker extension's ``method`` (:meth:`_guard`ed); its answers."""
        return await self._guard(self._llm.collective_rpc(method, args=args))

    def _check_alive(self) -> None:
        self.check_alive()
        if self._llm is None:
            raise RuntimeError("the vllm engine is not started" if not self._closed else "closed")

    # -------------------------------------------------------------------------- generation

    def check_sampling(self, params: SamplingConfig, where: str = "sampling") -> None:
        """FieldError for sampling settings whose log-probs vLLM cannot report our way."""
        if params.top_p != 1.0:
            raise FieldError(
                f"{where}.top_p",
                f"must be 1 on the vllm engine (vLLM reports log-probs after top-p "
                f"truncation, ours are taken before it), got {params.top_p}",
            )
        if params.top_k != 0:
            raise FieldError(
                f"{where}.top_k",
                f"must be 0 on the vllm engine (vLLM reports log-probs after top-k "
                f"truncation, ours are taken before it), got {params.top_k}",
            )

    def _sampling_params(self, params: SamplingConfig) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.end_token_ids
        return SamplingParams(
            n=1,
            temperature=params.temperature,
            seed=params.seed,
            max_tokens=params.max_new_tokens,
            stop_token_ids=sorted(stops),
            ignore_eos=params.ignore_eos,
            # 0: the sampled token's log-prob only.
            logprobs=params.top_logprobs,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    async def stream(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> AsyncGenerator[TokenEvent, None]:
        """Generates one sample; see :meth:`InferenceEngine.stream` and the module's notes."""
        params.validate()
        self.check_sampling(params)
        self.check_prompt(input_ids, params)
        self.check_adapter(adapter)
        self._check_alive()
        await self._gate.enter()
        self._check_alive()
        # The named adapter's load is pinned until the request ends (see NamedAdapters).
        named = self._named.acquire(adapter) if adapter else ""
        # Closed explicitly: closing this generator (a cancelled call) must cancel the
        # request at once, not when the inner generator is collected.
        inner = self._stream(input_ids, params, named)
        try:
            with self._calling():
                async for event in inner:
                    yield event
        finally:
            await inner.aclose()
            if named:
                for internal in self._named.release(named):
                    self._unload_named_later(internal)

    async def _stream(
        self, input_ids: Sequence[int], params: SamplingConfig, named: str
    ) -> AsyncGenerator[TokenEvent, None]:
        from vllm.inputs import TokensPrompt

        adapter, adapter_version = self._adapters.acquire()
        # Without LoRA every token comes from the weights served when the request started
        # (an update interrupts it first); with LoRA the adapter pins them.
        version = adapter_version if self.adapters_only else self._version
        swaps = self._swaps
        keep = self.settings.pause_mode == "keep" and not self.adapters_only
        # keep mode: what arrived after a swap began, held until the final output's version
        # spans say which weights made each token (ids, log-probs, top log-probs).
        held: list[TokenEvent] = []
        emitted = 0
        rid = uuid.uuid4().hex
        self._inflight.add(rid)
        outputs = self._llm.generate(
            TokensPrompt(prompt_token_ids=[int(t) for t in input_ids]),
            self._sampling_params(params),
            rid,
            lora_request=self._named_request(named) if named else self._lora_request(adapter),
        )
        try:
            async for out in outputs:
                swapped = self._swaps != swaps and not self.adapters_only
                if swapped and not keep:
                    # The weights changed under this request (it raced a pause): what it
                    # produced from here on may come from either version.
                    yield TokenEvent(finish=FinishReason.INTERRUPTED)
                    return
                c = out.outputs[0]
                ids = [int(t) for t in c.token_ids]
                event = None
                if ids:
                    lps, top = _logprobs(c.logprobs, ids, params.top_logprobs)
                    self._generated_tokens += len(ids)
                    event = TokenEvent(ids, lps, [version] * len(ids), top=top)
                if swapped:
                    if event is not None:
                        held.append(event)
                    if not out.finished:
                        continue
                    labelled = _labelled(held, emitted, c.weight_versions)
                    if labelled is None:
                        # vLLM did not say which weights made the held tokens.
                        yield TokenEvent(finish=FinishReason.INTERRUPTED)
                        return
                    for e in labelled:
                        yield e
                elif event is not None:
                    emitted += len(event.token_ids)
                    yield event
                if out.finished:
                    yield TokenEvent(finish=self._finish_reason(c.finish_reason))
                    return
            raise RuntimeError(f"vLLM ended request {rid} without a finished output")
        finally:
            # Closing vLLM's generator aborts the request there (cancellation).
            await outputs.aclose()
            self._inflight.discard(rid)
            self._adapters.release(adapter)
            self._unload_idle()

    def _finish_reason(self, reason: str | None) -> FinishReason:
        if reason in _FINISH:
            return _FINISH[reason]
        if reason == "abort":
            # Aborted by a pause for an update: resumable. Otherwise vLLM gave up on it.
            return FinishReason.INTERRUPTED if self._gate.paused else FinishReason.CANCELLED
        raise RuntimeError(f"vLLM finished a request with unknown reason {reason!r}")

    def _lora_request(self, adapter: str) -> Any:
        if not adapter:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter, self._adapter_ids[adapter], str(self._adapters.dirs[adapter]))

    def _named_request(self, internal: str) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(internal, self._named_ids[internal], str(self._named_dirs[internal]))

    # -------------------------------------------------------------------- named adapters

    def adapters(self) -> list[str]:
        """Names of the named adapters held, sorted."""
        return self._named.names()

    async def load_adapter(
        self, name: str, tensors: Mapping[str, torch.Tensor], rank: int, alpha: float
    ) -> AdapterLoad:
        """Has vLLM hold the adapter as ``name`` (a peft directory it loads); see
        :meth:`InferenceEngine.load_adapter`."""
        if not self.max_adapter_bytes:
            raise NotImplementedError(
                "this vllm engine serves no named adapters (rollout.vllm.max_adapter_rank is 0)"
            )
        check_adapter_name(name, "header.name")
        if rank > self.settings.max_adapter_rank:
            raise FieldError(
                "header.rank",
                f"{rank} is above the rank vLLM serves here "
                f"(rollout.vllm.max_adapter_rank = {self.settings.max_adapter_rank})",
            )
        self._check_alive()
        checked = await asyncio.to_thread(
            check_adapter_shapes, tensors, rank, alpha, self._linear_dims
        )
        internal = self._named.reserve(name, checked.nbytes)
        try:
            path = await asyncio.to_thread(self._write_named, internal, checked)
            adapter_id = next(self._next_named_id)
            from vllm.lora.request import LoRARequest

            try:
                await self._guard(self._llm.add_lora(LoRARequest(internal, adapter_id, str(path))))
            except Exception as exc:
                await asyncio.to_thread(remove_owned, path)
                reason = self._dead_reason(exc)
                if reason is not None:
                    raise self.died(reason) from exc
                raise FieldError("tensors", f"vLLM refused the adapter: {exc}") from exc
        except BaseException:
            self._named.unreserve(name)
            raise
        self._named_ids[internal] = adapter_id
        self._named_dirs[internal] = path
        replaced, idle = self._named.install(name, internal)
        for old in idle:
            await self._unload_named(old)
        log.info("vllm engine: adapter %r loaded (%d bytes)", name, checked.nbytes)
        return AdapterLoad(name, checked.nbytes, len(checked.modules), replaced)

    async def remove_adapter(self, name: str) -> int:
        """Stops serving ``name``; vLLM drops it once no running request uses it."""
        for internal in self._named.remove(name):
            await self._unload_named(internal)
        log.info("vllm engine: adapter %r removed", name)
        return self._named.held_bytes

    def _linear_dims(self, module_name: str) -> tuple[int, int] | None:
        """(in, out) features of a linear layer of the served checkpoint; None for anything
        else (the embedding has a 2-d weight too, but no LoRA of vLLM's adapts it)."""
        shape = self._expected.get(f"{module_name}.weight")
        if shape is None or len(shape) != 2 or module_name.rsplit(".", 1)[-1] == "embed_tokens":
            return None
        return shape[1], shape[0]

    def _write_named(self, internal: str, checked: CheckedAdapter) -> Path:
        root = Path(tempfile.mkdtemp(prefix="areal-vllm-named-"))
        self._owned.append(root)
        path = root / internal

        from peft import LoraConfig

        config = LoraConfig(
            r=checked.rank,
            lora_alpha=checked.alpha,
            lora_dropout=0.0,
            target_modules=sorted({m.rsplit(".", 1)[-1] for m in checked.modules}),
            task_type="CAUSAL_LM",
        )
        write_peft_dir(path, peft_tensors(checked), config)
        return path

    def _unload_named_later(self, internal: str) -> None:
        task = asyncio.get_running_loop().create_task(self._unload_named(internal))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload_named(self, internal: str) -> None:
        await self._remove_lora(
            internal, self._named_ids.pop(internal), self._named_dirs.pop(internal)
        )

    # ------------------------------------------------------------------ pause and weights

    async def pause(self, wait: bool = True) -> int:
        """Stops generation; new requests wait for :meth:`resume`. In abort mode every
        request in flight ends INTERRUPTED with its partial output (the count is returned);
        in keep mode vLLM holds them (0).

        ``wait`` False returns before vLLM has paused: a fleet update pauses first and then
        gathers and sends the weights, so vLLM's own pause (tens of ms) runs meanwhile, and
        a swap or :meth:`resume` waits for it."""
        self._check_alive()
        self._gate.close()
        keep = self.settings.pause_mode == "keep"
        running = 0 if keep else len(self._inflight)
        if self._pausing is None:
            self._pausing = asyncio.ensure_future(self._pause_vllm(keep))
        if wait:
            with self._calling():
                await self._pausing
        return running

    async def _pause_vllm(self, keep: bool) -> None:
        if keep:
            await self._guard(self._llm.pause_generation(mode="keep", clear_cache=True))
            return
        await self._guard(self._llm.pause_generation(mode="abort", clear_cache=True))
        if self._inflight:
            # Requests that reached vLLM after its abort (they wait in its paused queue).
            await self._guard(self._llm.abort(list(self._inflight)))

    async def resume(self) -> None:
        """Lets requests decode again."""
        self._check_alive()
        with self._calling():
            if self._pausing is not None:
                await self._pausing
                self._pausing = None
            await self._guard(self._llm.resume_generation())
        self._gate.open()

    async def wait_until_resumed(self) -> None:
        """Returns when generation is not paused."""
        await self._gate.wait_open()

    async def load_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, owned: bool = False
    ) -> dict[str, torch.Tensor]:
        """Checks ``state_dict`` against the model, then loads it into vLLM (see the module).

        vLLM keeps its own copy, so tensors handed over (``owned``) are handed back once
        loaded: the next update receives into them, pages already mapped, instead of into
        fresh memory (513 MiB for SmolLM2: a copy into warm buffers costs a fifth of one
        into fresh memory here)."""
        self._check_alive()
        async with self._update_lock:
            self._check_newer(version)
            if self.adapters_only:
                with self._calling():
                    await self._load_adapter(state_dict, version)
                return {}
            tensors = self._checked(state_dict)
            async with self._swapping(version):
                staged = await self._reload(tensors, version)
        if not owned:
            return {}
        # The next version is received into the staged file itself.
        staged.lent = set(staged.views)
        return {**state_dict, **staged.views}

    def _check_newer(self, version: int) -> None:
        if version <= self._version:
            raise PreconditionError(
                f"weights version {version} is not newer than the served version {self._version}"
            )

    @contextlib.asynccontextmanager
    async def _swapping(self, version: int) -> AsyncIterator[None]:
        """Generation paused (unless the caller paused it) while the body replaces the
        weights with ``version``'s, which is served from then on."""
        paused_here = not self._gate.paused
        with self._calling():
            if paused_here:
                await self.pause()
            elif self._pausing is not None:
                await self._pausing
        self._swaps += 1
        try:
            yield
        except EngineDied:
            raise
        except BaseException as exc:
            # The worker may hold part of the update: nothing trustworthy is served.
            died = self.died(self._dead_reason(exc) or f"loading version {version} failed: {exc!r}")
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise died from exc
        with self._calling():
            # Before resume: the first step under the new weights carries their label.
            await self._guard(self._llm.update_weight_version(str(version)))
        self._version = version
        if paused_here:
            await self.resume()

    def _checked(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors to load, or ValueError (nothing changed) when they do not fit."""
        tensors = dict(state_dict)
        if self._tied:
            # The head is the embedding: vLLM loads no head of a tied model.
            tensors.pop("lm_head.weight", None)
        check_specs(self._expected, tensor_specs(tensors))
        return tensors

    async def load_weight_files(self, files: Sequence[Path], version: int) -> int:
        """Loads a version stored as safetensors files (a disk or shared-memory update)
        straight from them: vLLM's worker reads the files, so nothing is read or written
        here first (the write is most of an update's own cost otherwise). Checked from the
        files' headers before anything changes (ValueError); returns the tensors loaded."""
        self._check_alive()
        async with self._update_lock:
            self._check_newer(version)
            specs = await asyncio.to_thread(file_specs, files)
            skip = ["lm_head.weight"] if self._tied else []
            check_specs(self._expected, {n: v for n, v in specs.items() if n not in skip})
            async with self._swapping(version):
                start = time.perf_counter()
                count = await self._rpc("areal_load_files", [str(f) for f in files], skip)
                done = time.perf_counter()
        self.last_load_s = (0.0, done - start)
        log.info(
            "vllm engine: version %d loaded: 0.000 s writing 0 MiB, %.3f s in vLLM's reload "
            "(read from the update's %d files)",
            version,
            done - start,
            len(files),
        )
        return int(_first(count))

    async def receive_group(
        self, params: GroupParams, specs: Sequence[tuple[str, torch.dtype, list[int]]]
    ) -> None:
        """Has vLLM's worker take a DISTRIBUTED update: it joins the weight group ``params``
        describes (the one it is in is kept while they stay the same) and receives the
        broadcast of ``specs``, in order, into buffers of its own; vLLM goes on generating
        meanwhile. DataLossError when the transfer fails; cancelled, the worker gives it up."""
        self._check_alive()
        self._received = {}
        # Until it is known to have succeeded: a failed receive leaves the worker's group.
        self.worker_group = None
        wire = [
            [name, str(dtype).removeprefix("torch."), list(shape)] for name, dtype, shape in specs
        ]
        try:
            with self._calling():
                await self._rpc("areal_group_receive", asdict(params), wire)
                delay = 0.002
                while True:
                    state, why = _first(await self._rpc("areal_group_poll"))
                    if state == "done":
                        break
                    if state == "failed":
                        raise DataLossError(f"vLLM's worker did not receive the weights: {why}")
                    self._check_alive()
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 0.01)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._rpc("areal_group_abandon")
            raise
        self.worker_group = params
        self._received = {
            name: (tuple(shape), dtype.is_floating_point, str(dtype))
            for name, dtype, shape in specs
        }

    async def load_received(self, version: int, *, keep: bool = True) -> int:
        """Swaps in what :meth:`receive_group` took, checked against the model first
        (ValueError, nothing changed); the tensors loaded. ``keep``: the worker receives the
        next update into the same buffers."""
        self._check_alive()
        async with self._update_lock:
            self._check_newer(version)
            received, self._received = self._received, {}
            if not received:
                raise RuntimeError("no weights were received to load")
            skip = ["lm_head.weight"] if self._tied else []
            check_specs(self._expected, {n: v for n, v in received.items() if n not in skip})
            async with self._swapping(version):
                start = time.perf_counter()
                count = _first(await self._rpc("areal_group_load", skip, keep))
                done = time.perf_counter()
        self.last_load_s = (0.0, done - start)
        self.last_staged_bytes = 0
        log.info(
            "vllm engine: version %d loaded: 0.000 s writing 0 MiB, %.3f s in vLLM's reload "
            "(received in its worker)",
            version,
            done - start,
        )
        return int(count)

    async def _reload(self, tensors: dict[str, torch.Tensor], version: int) -> StagedFile:
        """Puts the tensors in this engine's staged weight file (received there already when
        they are its own views: see :mod:`weight_staging`) and has the worker reload it."""
        start = time.perf_counter()
        staged = self._staged
        if staged is not None and staged.can_take(tensors):
            copied = await asyncio.to_thread(staged.fill, tensors)
        else:
            # A new file: the old one's views may still be out receiving (they keep its
            # memory until dropped), so it is never written again.
            copied = sum(t.numel() * t.element_size() for t in tensors.values())
            path = self._staging_dir(copied) / f"staged-v{version}.safetensors"
            staged = await asyncio.to_thread(StagedFile.write, path, tensors)
            old, self._staged = self._staged, staged
            if old is not None:
                old.path.unlink(missing_ok=True)
        written = time.perf_counter()
        await self._rpc("areal_load_weights", str(staged.path))
        done = time.perf_counter()
        self.last_load_s = (written - start, done - written)
        self.last_staged_bytes = copied
        log.info(
            "vllm engine: version %d loaded: %.3f s writing %.0f MiB, %.3f s in vLLM's reload",
            version,
            written - start,
            copied / 2**20,
            done - written,
        )
        return staged

    def _rpc_dir(self) -> Path:
        """A fresh directory for vLLM's socket files, removed with this engine."""
        own = own_root()
        parent = own[0] if own is not None else None
        path = Path(tempfile.mkdtemp(prefix="vllm-rpc-", dir=parent))
        self._owned.append(path)
        return path

    def _staging_dir(self, nbytes: int) -> Path:
        """Where the staged weight file lives: this process's shared-memory directory
        (removed at exit, and swept after a kill -9), else a directory on disk."""
        if self._staging is None:
            own = own_root()
            if own is not None and shutil.disk_usage(own[0]).free > 2 * nbytes:
                self._staging = own[0]
            else:
                self._staging = Path(tempfile.mkdtemp(prefix="areal-vllm-weights-"))
                self._owned.append(self._staging)
        return self._staging

    async def _load_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Loads the adapters as vLLM's run-time adapter for ``version``; new requests use it,
        and the one it replaces is removed once no request uses it."""
        check_adapter_update(state_dict.keys(), self._adapters.names)
        root = Path(tempfile.mkdtemp(prefix="areal-vllm-lora-"))
        self._owned.append(root)
        name = f"areal-v{version}"
        path = root / f"lora-v{version}"
        await asyncio.to_thread(write_adapter, self.model_name, self.lora, state_dict, path)
        from vllm.lora.request import LoRARequest

        try:
            await self._guard(self._llm.add_lora(LoRARequest(name, version, str(path))))
        except BaseException:
            await asyncio.to_thread(remove_owned, path)
            raise
        self._adapter_ids[name] = version
        self._adapters.install(name, path, version, state_dict.keys())
        self._version = version
        self._unload_idle()

    def _unload_idle(self) -> None:
        for name, path in self._adapters.idle():
            task = asyncio.get_running_loop().create_task(self._unload(name, path))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload(self, name: str, path: Path) -> None:
        await self._remove_lora(name, self._adapter_ids.pop(name), path)

    async def _remove_lora(self, name: str, adapter_id: int, path: Path) -> None:
        """Has vLLM drop a run-time adapter no request uses any more, and removes its files."""
        try:
            await self._guard(self._llm.remove_lora(adapter_id))
        except Exception as exc:
            # Nothing is served from it any more either way; a leftover costs vLLM memory only.
            log.warning("removing LoRA adapter %s from vLLM failed: %s", name, exc)
        await asyncio.to_thread(remove_owned, path)

    async def settle(self) -> None:
        """Waits for adapter removals under way (tests, shutdown)."""
        while self._unloads:
            await asyncio.gather(*list(self._unloads), return_exceptions=True)

    # -------------------------------------------------------------------------- status

    @property
    def version(self) -> int:
        """Policy version being served."""
        return self._version

    def status(self) -> EngineStatus:
        """Requests in vLLM, requests waiting for resume, version, tokens generated."""
        return EngineStatus(
            version=self._version,
            running=len(self._inflight),
            queued=self._gate.queued,
            paused=self._gate.paused,
            generated_tokens=self._generated_tokens,
        )


def _first(results: Any) -> Any:
    """The one worker's answer to a ``collective_rpc`` (vLLM returns a list, one per worker)."""
    return results[0]


def _logprobs(
    entries: Sequence[Mapping[int, Any]] | None, ids: Sequence[int], top_n: int
) -> tuple[list[float], list[TopLogprobs]]:
    """The sampled tokens' log-probs and, with ``top_n``, each position's most likely ones."""
    if entries is None or len(entries) != len(ids):
        raise RuntimeError("vLLM returned no log-prob for a generated token")
    lps = [float(d[t].logprob) for d, t in zip(entries, ids, strict=True)]
    top: list[TopLogprobs] = []
    if top_n:
        for d in entries:
            best = sorted(d.items(), key=lambda kv: kv[1].rank)[:top_n]
            top.append(([int(t) for t, _ in best], [float(lp.logprob) for _, lp in best]))
    return lps, top


def _labelled(held: Sequence[TokenEvent], first: int, spans: Any) -> list[TokenEvent] | None:
    """``held`` (output tokens ``first`` on) with each token's version from vLLM's final
    weight-version spans, or None when the spans do not cover them with our integer labels."""
    if not spans:
        return None if held else []
    try:
        bounds = [(int(s.version), int(s.start), int(s.end)) for s in spans]
    except ValueError:
        return None
    out: list[TokenEvent] = []
    index = first
    for e in held:
        versions = []
        for _ in e.token_ids:
            label = next((v for v, lo, hi in bounds if lo <= index < hi), None)
            if label is None:
                return None
            versions.append(label)
            index += 1
        out.append(TokenEvent(e.token_ids, e.logprobs, versions, top=e.top))
    return out
