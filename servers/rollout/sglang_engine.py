"""The ``sglang`` engine: drives an SGLang server over its HTTP API (SGLang 0.5.21).

The rollout server launches the SGLang server as its child (:mod:`sglang_server`), or attaches
to one at ``rollout.sglang.urls``. Settings: ``rollout.sglang`` (:class:`SglangSettings`).
What was checked against the real server on a CPU, and how the engine contract is kept:

* Token ids in and out: ``POST /generate`` with ``input_ids``, ``return_logprob``, one request
  per sample, each with a request id of its own (``rid``: a uuid; SGLang matches ids by
  prefix when it aborts, so none is a prefix of another). SGLang never loads the tokenizer
  (``--skip-tokenizer-init``). End-of-turn ids are passed as ``stop_token_ids``; SGLang's
  ``ignore_eos`` also disables those, so a request that ignores EOS but has stop ids is cut
  at the first stop id here, which is exact (the tokens before it do not depend on what comes
  after).
* Log-probs: ``meta_info.output_token_logprobs`` is ``log_softmax(logits / T)`` over the whole
  vocabulary, before top-p / top-k truncation (SGLang's sampler divides by T, takes the
  softmax, and truncates a sorted copy): our convention, so every sampling setting is taken.
  Greedy requests get ``log_softmax(logits)``. In float32 they match the trainer's to ~1e-5
  (SGLang loads float16 on a CPU unless told: a launched server is always given
  ``rollout.dtype``'s choice). ``sampling.seed`` is refused: SGLang honours seeds in its
  deterministic mode only, which its CPU attention does not offer.
* Cancelling a request sends ``POST /abort_request {"rid"}`` (and closes its connection).
* Per-token policy versions: every update names its version (``weight_version``), and each
  token takes the version of the ``meta_info.weight_versions`` span it lies in.
* Pause for an update, ``rollout.sglang.pause_mode``: ``abort`` (the default, AReaL's)
  returns requests in flight with their partial output, INTERRUPTED, and
  ``generate_resumable`` sends them again after resume; ``retract`` has SGLang hold them, free
  their KV cache and recompute it under the new weights on resume. SGLang's ``in_place``
  mode is not offered: it keeps KV computed by the old weights, and an update with the cache
  flush SGLang needs then kills the server.
* Weight updates, each checked against the checkpoint's tensor names and shapes first (SGLang
  takes a missing tensor as "keep the old one" and ignores unknown ones):

  - files (DISK, SHARED_MEMORY; STREAM and SOCKET state dicts are written to a staged file in
    shared memory first): ``POST /update_weights_from_disk`` on their directory. SGLang keeps
    the old weights when it fails.
  - DISTRIBUTED: SGLang joins the sender's weight group (``/init_weights_update_group``; gloo
    on a CPU, NCCL on a GPU) and takes one ``/update_weights_from_distributed`` with every
    tensor, inside ``/begin_weight_update`` ... ``/end_weight_update`` (SGLang 0.5.21 refuses
    it outside such a session). SGLang loads only once every tensor has arrived.
  - ``/update_weights_from_tensor`` is not used: its payload is pickled tensors.

* LoRA (``model.lora.rank > 0``, GPU only): updates bring adapters only, loaded with ``POST
  /load_lora_adapter`` as ``<name>-v<version>``; generation names it in ``lora_path``, and a
  replaced adapter is unloaded once no request uses it. SGLang's LoRA layers pin host memory,
  which a CPU-only torch cannot: on a CPU it is refused at start, naming ``model.lora.rank``.
* Supervision: a launched server whose process exits, or a server that fails ``/health`` twice
  in a row, is the engine's death (:class:`EngineDied`), as is any call that finds the
  launched process gone; calls under way stop waiting, and the rollout server exits so that
  its launcher replaces it.

Calls are retried with tenacity on transient failures (connection errors, timeouts, HTTP
5xx) where that is safe (not joining a group, not a distributed update), as AReaL does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import uuid
from collections.abc import AsyncGenerator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
from areal_servers.rollout.adapters import AdapterBook, check_adapter_update, write_adapter
from areal_servers.rollout.engine import (
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
    check_specs,
    checkpoint_shapes,
    end_token_ids,
    file_specs,
    served_checkpoint,
    tensor_specs,
)
from areal_servers.rollout.sglang_server import (
    SGLangProcess,
    launch_argv,
    launch_env,
    sglang_python,
)
from safetensors.torch import save_file
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
)

from areal_grpc import tracing
from areal_grpc.config import LoraSettings, SglangSettings
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.model import load_tokenizer
from areal_grpc.paths import remove_owned
from areal_grpc.ports import free_port
from areal_grpc.precision import choose_dtype
from areal_grpc.shared_memory import own_root
from areal_grpc.weight_transfer import GroupParams

__all__ = [
    "HTTPResponse",
    "SGLangEngine",
    "SGLangError",
    "TransientHTTPError",
    "generate_payload",
    "http_request",
    "parse_generate_response",
    "token_versions",
]

log = logging.getLogger(__name__)
# httpx logs every request at INFO: one line per generation would drown the server's log.
logging.getLogger("httpx").setLevel(logging.WARNING)

T = TypeVar("T")

# SGLang's "no top-k limit".
NO_TOP_K = -1
# A launched server that stopped answering may still be on its way out: how long a failed
# call waits for its exit before it is treated as a passing failure.
EXIT_WAIT_S = 3.0
# /health failures in a row that make the server dead.
HEALTH_FAILURES = 2


class TransientHTTPError(ConnectionError):
    """A failure worth retrying: no connection, a timeout, or an HTTP 5xx answer."""


class SGLangError(RuntimeError):
    """SGLang answered, but with an error or a malformed body."""


@dataclass
class HTTPResponse:
    """Status code and body of one HTTP exchange."""

    status: int
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body.decode("utf-8"))


def http_client(timeout_s: float = 60.0) -> httpx.AsyncClient:
    """A pooled HTTP client for one SGLang server (keep-alive, no connection limit).

    No limit: every in-flight ``/generate`` holds a connection for its whole generation.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)


async def http_request(
    url: str,
    method: str,
    path: str,
    payload: Any = None,
    timeout_s: float = 60.0,
    client: httpx.AsyncClient | None = None,
) -> HTTPResponse:
    """One request (JSON body) to ``url``; TransientHTTPError on network failure or HTTP 5xx.

    ``client``: a pooled client from :func:`http_client` (else a one-off connection).
    """
    headers = {"Accept": "application/json"}
    # W3C trace context of the current span, so SGLang's own spans (--enable-trace) join the
    # episode's trace.
    ctx = tracing.to_proto()
    if ctx.traceparent:
        headers["traceparent"] = ctx.traceparent
    if ctx.tracestate:
        headers["tracestate"] = ctx.tracestate
    target = f"{url}{path}"
    own = client is None
    http = http_client(timeout_s) if client is None else client
    try:
        resp = await http.request(method, target, json=payload, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException as exc:
        raise TransientHTTPError(f"{target}: no answer in {timeout_s} s") from exc
    except httpx.TransportError as exc:
        raise TransientHTTPError(f"{target}: {type(exc).__name__}: {exc}") from exc
    finally:
        if own:
            await http.aclose()
    if resp.status_code >= 500:
        raise TransientHTTPError(f"{target}: HTTP {resp.status_code}: {resp.content[:200]!r}")
    return HTTPResponse(resp.status_code, resp.content)


def generate_payload(
    input_ids: Sequence[int],
    params: SamplingConfig,
    rid: str = "",
    lora_path: str = "",
    end_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The ``/generate`` body for one sample; ``end_ids``: the model's end-of-turn ids (they
    stop it unless it ignores EOS), ``lora_path``: a loaded adapter to generate with."""
    if params.ignore_eos:
        # SGLang's ignore_eos also turns stop_token_ids off: the caller cuts at them instead.
        stops: list[int] = []
    else:
        stops = sorted({*params.stop_token_ids, *end_ids})
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else NO_TOP_K,
            "max_new_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.temperature == 0 else params.temperature,
            "stop_token_ids": stops,
            "ignore_eos": params.ignore_eos,
        },
        "return_logprob": True,
        "stream": False,
    }
    if rid:
        payload["rid"] = rid
    if params.top_logprobs:
        payload["top_logprobs_num"] = params.top_logprobs
    if lora_path:
        payload["lora_path"] = lora_path
    return payload


def parse_generate_response(body: Any) -> tuple[list[int], list[float], str]:
    """(tokens, logprobs, finish type) from a ``/generate`` answer; SGLangError if malformed."""
    if not isinstance(body, dict):
        raise SGLangError(f"/generate answered a {type(body).__name__}, not a JSON object")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise SGLangError("/generate answer has no meta_info object")
    finish = meta.get("finish_reason") or {}
    kind = str(finish.get("type", "")) if isinstance(finish, dict) else str(finish)
    message = str(finish.get("message", "")) if isinstance(finish, dict) else ""
    if kind == "abort" and message.startswith("Abort before prefill"):
        return [], [], "abort"
    triples = meta.get("output_token_logprobs") or []
    tokens = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    return tokens, logprobs, kind


def parse_top_logprobs(body: Mapping[str, Any], n: int) -> list[TopLogprobs]:
    """Per output token, (ids, log-probs) from ``meta_info.output_top_logprobs`` (a list per
    token of ``[logprob, token_id, text]`` entries); SGLangError if it does not match."""
    rows = body["meta_info"].get("output_top_logprobs") or []
    if len(rows) != n:
        raise SGLangError(f"/generate gave top log-probs for {len(rows)} of {n} tokens")
    return [([int(e[1]) for e in row], [float(e[0]) for e in row]) for row in rows]


def token_versions(meta: Mapping[str, Any], n: int) -> list[int]:
    """Each of ``n`` output tokens' policy version, from SGLang's ``weight_versions`` spans
    (``{"version", "start", "end"}`` over output positions), else its one ``weight_version``;
    SGLangError when they do not cover the tokens with integer labels (ours)."""
    spans = meta.get("weight_versions")
    if not spans:
        spans = [{"version": meta.get("weight_version"), "start": 0, "end": n}]
    try:
        bounds = [(int(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    except (KeyError, TypeError, ValueError):
        raise SGLangError(f"/generate's weight versions are not this engine's: {spans}") from None
    out = []
    for i in range(n):
        label = next((v for v, lo, hi in bounds if lo <= i < hi), None)
        if label is None:
            raise SGLangError(f"/generate's weight versions {spans} do not cover token {i}")
        out.append(label)
    return out


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class SGLangEngine(InferenceEngine):
    """An :class:`InferenceEngine` backed by an SGLang server's HTTP API."""

    kind = "sglang"

    def __init__(
        self,
        model: str,
        settings: SglangSettings | None = None,
        *,
        url: str = "",
        seed: int = 0,
        dtype: str = "float32",
        lora: LoraSettings | None = None,
        request_timeout_s: float = 3600.0,
        request_retries: int = 3,
        retry_wait_s: float = 0.5,
        lora_name: str = "areal",
    ) -> None:
        """Serves ``model`` (a named model, a local checkpoint or a built-in one) on the SGLang
        server at ``url``, or on one it launches in ``dtype`` (a rollout.dtype setting) when
        ``url`` is empty (:meth:`start`)."""
        self.settings = settings or SglangSettings()
        self.model_name = model
        self.seed = seed
        self.lora = lora or LoraSettings()
        self.adapters_only = self.lora.rank > 0
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.request_retries = request_retries
        self.retry_wait_s = retry_wait_s
        self.lora_name = lora_name
        self.dtype = dtype
        self.process: SGLangProcess | None = None
        self._version = 0
        self._gate = PauseGate()
        # Pauses begun so far: a request aborted after one began was interrupted by it.
        self._pauses = 0
        self._running = 0
        self._generated_tokens = 0
        self._http = http_client(request_timeout_s)
        self._adapters = AdapterBook()
        self._background: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False
        self._death = asyncio.Event()
        self.on_death(self._engine_died)
        # Directories this engine wrote (the built-in model's checkpoint, staged weights).
        self._owned: list[Path] = []
        self._staged: Path | None = None
        # The checkpoint's tensor shapes an update must match; its tied head is not sent.
        self._expected: dict[str, tuple[int, ...]] = {}
        self._tied = False
        self.end_token_ids: frozenset[int] = frozenset()
        # The weight group SGLang was told to join.
        self.group: GroupParams | None = None
        self.gpu = torch.cuda.is_available()

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Launches the SGLang server (unless attached to one) and waits until it serves."""
        if self.lora.rank and not self.gpu and not self.url:
            raise FieldError(
                "model.lora.rank",
                "SGLang's CPU path serves no LoRA adapters (its LoRA layers pin host memory, "
                "which a CPU-only torch cannot): use rollout.engine=hf or vllm for LoRA on a CPU",
            )
        served, owned = await asyncio.to_thread(
            served_checkpoint, self.model_name, self.seed, "sglang"
        )
        if owned is not None:
            self._owned.append(owned)
        config = json.loads((Path(served) / "config.json").read_text())
        self._tied = bool(config.get("tie_word_embeddings", False))
        self.vocab_size = int(config["vocab_size"])
        self.max_context = int(config.get("max_position_embeddings", 0) or 0)
        self._expected = await asyncio.to_thread(checkpoint_shapes, Path(served))
        tokenizer = load_tokenizer(self.model_name)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.end_token_ids = frozenset(end_token_ids(Path(served), self.eos_token_id))
        if not self.url:
            python = await asyncio.to_thread(sglang_python, self.settings)
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            dtype, why = choose_dtype(self.dtype, "cuda" if self.gpu else "cpu")
            log.info("sglang engine: serving %s in %s (%s)", self.model_name, dtype, why)
            # An attached server's dtype is its own affair: updates then come as they are.
            self.weights_dtype = getattr(torch, dtype)
            argv = launch_argv(
                python,
                served,
                port,
                self.settings,
                seed=self.seed,
                dtype=dtype,
                gpu=self.gpu,
                lora=self.lora,
            )
            self.process = SGLangProcess(argv, launch_env(self.gpu))
        await self.wait_healthy(self.settings.start_timeout_s)
        # Every token is labelled with the version it was generated under, this one first.
        await self._post(
            "/update_weight_version",
            {"new_version": str(self._version), "abort_all_requests": False},
        )
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        log.info(
            "sglang engine: %s at %s (%s)",
            self.model_name,
            self.url,
            "launched" if self.process is not None else "attached",
        )

    async def wait_healthy(self, timeout_s: float) -> None:
        """Polls ``GET /health`` every second until it answers 200; a launched server that
        exits first fails at once with its last words, TimeoutError after ``timeout_s``."""

        async def healthy() -> bool:
            if self.process is not None and self.process.exit_code() is not None:
                why = f"SGLang's {self.process.exited()[4:]} before it served: "
                why += self.process.last_lines()
                if any(w in why for w in ("ImportError", "ModuleNotFoundError")):
                    # A broken install, not a broken run.
                    raise FieldError("rollout.sglang.python", why)
                raise RuntimeError(f"rollout.sglang: {why}")
            try:
                health = await http_request(self.url, "GET", "/health", None, 30.0, self._http)
            except TransientHTTPError:
                return False
            return health.status == 200

        poll = AsyncRetrying(
            retry=retry_if_result(lambda ok: not ok),
            stop=stop_after_delay(timeout_s),
            wait=wait_fixed(1.0),
        )
        try:
            await poll(healthy)
        except RetryError:
            raise TimeoutError(
                f"sglang at {self.url} not healthy within {timeout_s:g} s "
                "(rollout.sglang.start_timeout_s)"
            ) from None

    async def close(self) -> None:
        """Stops a launched server and removes what this engine wrote."""
        self._closed = True
        self._gate.open()
        tasks = [t for t in (self._watchdog, *self._background) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.process is not None:
            # A dead or frozen SGLang drains nothing: no grace to wait out.
            grace_s = 10.0 if self.failure is None else 1.0
            await asyncio.to_thread(self.process.stop, grace_s)
        await self._http.aclose()
        for path in self._owned:
            shutil.rmtree(path, ignore_errors=True)
        self._owned.clear()

    # ------------------------------------------------------------------------- supervision

    async def _watch(self) -> None:
        """Checks the server every ``health_interval_s`` (see the module doc)."""
        s = self.settings
        failed = 0
        while not self._closed and self.failure is None:
            await asyncio.sleep(s.health_interval_s)
            if self._closed:
                return
            if self.process is not None and self.process.exit_code() is not None:
                self.died(self.process.exited())
                return
            if self._gate.paused:
                # SGLang answers /health only once it generates again.
                failed = 0
                continue
            why = await self._health(s.health_timeout_s)
            failed = 0 if why is None else failed + 1
            if failed >= HEALTH_FAILURES and not self._closed and not self._gate.paused:
                self.died(await self._exit_reason() or why or "")
                return

    async def _health(self, timeout_s: float) -> str | None:
        """None when ``GET /health`` answers 200 within ``timeout_s``; else what is wrong."""
        try:
            resp = await http_request(self.url, "GET", "/health", None, timeout_s, self._http)
        except TransientHTTPError as exc:
            return f"its server did not answer /health ({exc})"
        if resp.status != 200:
            return f"its server answered /health with HTTP {resp.status}"
        return None

    async def _exit_reason(self) -> str | None:
        """How the launched server ended, waiting up to EXIT_WAIT_S for one on its way out;
        None while it runs (or when attached: its process is not ours)."""
        if self.process is None:
            return None
        for _ in range(int(EXIT_WAIT_S / 0.1)):
            if self.process.exit_code() is not None:
                return self.process.exited()
            await asyncio.sleep(0.1)
        return None

    def _engine_died(self, reason: str) -> None:
        """Requests waiting for a resume go on (and raise EngineDied); calls under way stop
        waiting (:meth:`_guard`)."""
        self._gate.open()
        self._death.set()

    async def _guard(self, call: Awaitable[T]) -> T:
        """Awaits ``call`` unless the engine dies first (see unless_dead)."""
        return await unless_dead(self, self._death, call)

    # --------------------------------------------------------------------------- calls

    async def _post(self, path: str, payload: Any, attempts: int | None = None) -> Any:
        """POSTs with retries on transient failures; the JSON answer (or None). A launched
        server found gone is the engine's death; other HTTP errors are SGLangError."""
        self.check_alive()

        async def once() -> HTTPResponse:
            try:
                return await http_request(
                    self.url, "POST", path, payload, self.request_timeout_s, self._http
                )
            except TransientHTTPError as exc:
                reason = await self._exit_reason()
                if reason is not None:
                    raise self.died(reason) from exc
                raise

        async def with_retries() -> HTTPResponse:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(attempts or self.request_retries),
                wait=wait_exponential(multiplier=self.retry_wait_s, max=10.0),
                retry=retry_if_exception_type(TransientHTTPError),
                reraise=True,
            ):
                with attempt:
                    resp = await once()
            return resp

        resp = await self._guard(with_retries())
        if resp.status >= 400:
            raise SGLangError(f"{path}: HTTP {resp.status}: {resp.body[:300]!r}")
        body = resp.json() if resp.body.strip() else None
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"{path} failed: {body.get('message', body)}")
        return body

    def check_sampling(self, params: SamplingConfig, where: str = "sampling") -> None:
        """FieldError for sampling settings SGLang cannot keep."""
        if params.seed is not None:
            raise FieldError(
                f"{where}.seed",
                "the sglang engine takes no seed (SGLang honours seeds only in its deterministic "
                "mode, which its CPU attention backend does not offer)",
            )

    async def stream(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> AsyncGenerator[TokenEvent, None]:
        """One ``/generate`` call; see :meth:`InferenceEngine.stream` and the module doc.
        It holds no named adapters: any ``adapter`` is NOT_FOUND."""
        params.validate()
        self.check_sampling(params)
        self.check_prompt(input_ids, params)
        self.check_adapter(adapter)
        self.check_alive()
        await self._gate.enter()
        self.check_alive()
        # An adapter pins the weights a request runs on, so its tokens carry the version the
        # request was sent at; full-weight updates label each token through SGLang's spans.
        lora_path, sent_version = self._adapters.acquire()
        pauses = self._pauses
        self._running += 1
        try:
            body = await self._generate(input_ids, params, lora_path)
        finally:
            self._running -= 1
            self._adapters.release(lora_path)
            self._unload_idle()
        tokens, logprobs, kind = parse_generate_response(body)
        top = parse_top_logprobs(body, len(tokens)) if params.top_logprobs else []
        if self.adapters_only:
            versions = [sent_version] * len(tokens)
        else:
            versions = token_versions(body["meta_info"], len(tokens))
        if params.ignore_eos and params.stop_token_ids:
            cut = next((i for i, t in enumerate(tokens) if t in params.stop_token_ids), None)
            if cut is not None:
                end = cut + 1
                tokens, logprobs, versions, top = (
                    tokens[:end],
                    logprobs[:end],
                    versions[:end],
                    top[:end],
                )
                kind = "stop"
        self._generated_tokens += len(tokens)
        if tokens:
            yield TokenEvent(tokens, logprobs, versions, top=top)
        if kind == "abort":
            # Aborted by our pause (resumable); otherwise SGLang gave up on it.
            paused = self._gate.paused or self._pauses != pauses
            finish = FinishReason.INTERRUPTED if paused else FinishReason.CANCELLED
        elif kind in _FINISH:
            finish = _FINISH[kind]
        else:
            raise SGLangError(f"/generate finished with unknown reason {kind!r}")
        yield TokenEvent(finish=finish)

    async def _generate(self, input_ids: Sequence[int], params: SamplingConfig, lora: str) -> Any:
        """The ``/generate`` answer; each attempt has a request id of its own (a connection
        that broke may leave the last one running), aborted if the call is cancelled."""
        for attempt in range(1, self.request_retries + 1):
            rid = uuid.uuid4().hex
            payload = generate_payload(input_ids, params, rid, lora, sorted(self.end_token_ids))
            try:
                return await self._post("/generate", payload, attempts=1)
            except asyncio.CancelledError:
                self._later(self._abort(rid))
                raise
            except TransientHTTPError:
                self._later(self._abort(rid))
                if attempt == self.request_retries:
                    raise
                await asyncio.sleep(self.retry_wait_s * attempt)
        raise AssertionError("unreachable")

    async def _abort(self, rid: str) -> None:
        """``POST /abort_request {"rid"}``: SGLang frees the request's slot at once."""
        try:
            await self._post("/abort_request", {"rid": rid}, attempts=1)
        except (SGLangError, TransientHTTPError, EngineDied) as exc:
            log.debug("aborting request %s: %s", rid, exc)

    def _later(self, work: Awaitable[None]) -> None:
        """Runs ``work`` in the background (awaited at close)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def pause(self, wait: bool = True) -> int:
        """``POST /pause_generation``: in abort mode SGLang returns requests in flight with
        their partial output (counted); in retract mode it holds them (0)."""
        self.check_alive()
        self._gate.close()
        self._pauses += 1
        mode = self.settings.pause_mode
        interrupted = self._running if mode == "abort" else 0
        await self._post("/pause_generation", {"mode": mode})
        return interrupted

    async def resume(self) -> None:
        """``POST /continue_generation``, then lets waiting requests go."""
        self.check_alive()
        await self._post("/continue_generation", {})
        self._gate.open()

    async def wait_until_resumed(self) -> None:
        """Returns when generation is not paused."""
        await self._gate.wait_open()

    # --------------------------------------------------------------------------- weights

    @contextlib.asynccontextmanager
    async def _swapping(self, version: int) -> AsyncGenerator[None, None]:
        """Generation paused (unless the caller paused it) while the body has SGLang load
        ``version``, which is served from then on; a failure leaves the old one."""
        self.check_alive()
        if version <= self._version:
            raise PreconditionError(
                f"weights version {version} is not newer than the served version {self._version}"
            )
        paused_here = not self._gate.paused
        if paused_here:
            await self.pause()
        try:
            yield
            self._version = version
        finally:
            if paused_here and self.failure is None:
                await self.resume()

    async def load_weight_files(self, files: Sequence[Path], version: int) -> int:
        """Has SGLang load a version stored as safetensors files in one directory (a disk or
        shared-memory update), checked from their headers first (ValueError, nothing
        changed); the tensors loaded."""
        if self.adapters_only:
            raise PreconditionError(
                "this SGLang server serves LoRA adapters: a full checkpoint cannot replace them"
            )
        folders = {f.parent for f in files}
        if len(folders) != 1:
            raise ValueError(f"the update's files lie in {len(folders)} directories, not one")
        specs = await asyncio.to_thread(file_specs, files)
        check_specs(self._expected, self._without_tied_head(specs))
        async with self._swapping(version):
            await self._post(
                "/update_weights_from_disk",
                {
                    "model_path": str(folders.pop()),
                    "weight_version": str(version),
                    "flush_cache": True,
                    "abort_all_requests": False,
                },
            )
        return len(specs)

    def _without_tied_head(self, specs: Mapping[str, T]) -> dict[str, T]:
        """``specs`` but a tied output head (the embedding: SGLang loads none of its own)."""
        return {n: v for n, v in specs.items() if not (self._tied and n == "lm_head.weight")}

    async def load_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, owned: bool = False
    ) -> dict[str, torch.Tensor]:
        """Writes ``state_dict`` to a staged safetensors file (in shared memory when there is
        room) and has SGLang load it; SGLang reads its own copy, so nothing is handed back."""
        if self.adapters_only:
            self.check_alive()
            if version <= self._version:
                raise PreconditionError(
                    f"weights version {version} is not newer than the served version "
                    f"{self._version}"
                )
            await self._load_adapter(state_dict, version)
            return {}
        tensors = self._without_tied_head(state_dict)
        check_specs(self._expected, tensor_specs(tensors))
        folder = await asyncio.to_thread(self._stage, tensors, version)
        try:
            await self.load_weight_files([folder / "model.safetensors"], version)
        finally:
            old, self._staged = self._staged, folder
            if old is not None:
                self._owned.remove(old)
                await asyncio.to_thread(shutil.rmtree, old, True)
        return {}

    def _weights_root(self) -> Path:
        """Where SGLang reads what this engine writes for it (rollout.sglang.weights_dir, else
        this process's shared-memory directory, else a temporary one)."""
        if self.settings.weights_dir:
            root = Path(self.settings.weights_dir)
            root.mkdir(parents=True, exist_ok=True)
            return root
        own = own_root()
        if own is not None:
            return own[0]
        root = Path(tempfile.mkdtemp(prefix="areal-sglang-weights-"))
        self._owned.append(root)
        return root

    def _stage(self, tensors: Mapping[str, torch.Tensor], version: int) -> Path:
        folder = Path(tempfile.mkdtemp(prefix=f"staged-v{version}-", dir=self._weights_root()))
        self._owned.append(folder)
        data = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
        save_file(data, str(folder / "model.safetensors"))
        return folder

    async def receive_distributed(
        self,
        params: GroupParams,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        version: int,
    ) -> int:
        """Has SGLang take a DISTRIBUTED update: join the weight group ``params`` describes
        (unless in it already), then receive every tensor of ``specs`` (the sender broadcasts
        them in this order meanwhile) and load them as ``version``. Tensors that do not fit
        the model are refused (ValueError) after SGLang left the group, so that the sender's
        broadcast fails at once instead of waiting for a receiver."""
        self.check_alive()
        if self.adapters_only:
            raise PreconditionError("SGLang's distributed weight updates carry no LoRA adapters")
        if self.group != params:
            await self._post(
                "/init_weights_update_group",
                {
                    "master_address": params.master_address,
                    "master_port": params.master_port,
                    "rank_offset": params.rank,
                    "world_size": params.world_size,
                    "group_name": params.group_name,
                    "backend": params.backend,
                },
                attempts=1,
            )
            self.group = params
        sent = {n: (tuple(int(x) for x in s), d.is_floating_point, str(d)) for n, d, s in specs}
        try:
            check_specs(self._expected, self._without_tied_head(sent))
        except ValueError:
            await self._leave_group()
            raise
        body = {
            "names": [n for n, _, _ in specs],
            "dtypes": [str(d).removeprefix("torch.") for _, d, _ in specs],
            "shapes": [[int(x) for x in s] for _, _, s in specs],
            "group_name": params.group_name,
            "weight_version": str(version),
            "flush_cache": True,
            "abort_all_requests": False,
        }
        async with self._swapping(version):
            await self._post("/begin_weight_update", {}, attempts=1)
            try:
                await self._post("/update_weights_from_distributed", body, attempts=1)
            except BaseException:
                # The broadcast broke: the group is unusable; the next update forms a new one.
                self.group = None
                raise
            finally:
                if self.failure is None:
                    await self._post("/end_weight_update", {}, attempts=1)
        return len(specs)

    async def _leave_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(SGLangError, TransientHTTPError):
                await self._post(
                    "/destroy_weights_update_group", {"group_name": group.group_name}, attempts=1
                )

    async def _load_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Writes the adapters as a peft directory, has SGLang load it, and generates with it
        from then on; the adapter it replaces is unloaded once no request uses it."""
        check_adapter_update(state_dict.keys(), self._adapters.names)
        name = f"{self.lora_name}-v{version}"
        path = self._weights_root() / f"lora-v{version}"
        await asyncio.to_thread(write_adapter, self.model_name, self.lora, state_dict, path)
        try:
            await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        except BaseException:
            await asyncio.to_thread(remove_owned, path)
            raise
        self._adapters.install(name, path, version, state_dict.keys())
        self._version = version
        self._unload_idle()

    def _unload_idle(self) -> None:
        """Starts unloading every replaced adapter that no request uses any more."""
        for name, path in self._adapters.idle():
            self._later(self._unload(name, path))

    async def _unload(self, name: str, path: Path) -> None:
        try:
            await self._post("/unload_lora_adapter", {"lora_name": name})
        except (SGLangError, TransientHTTPError, EngineDied) as exc:
            # The new adapter serves either way; a leftover one costs SGLang memory only.
            log.warning("unloading LoRA adapter %s failed: %s", name, exc)
        await asyncio.to_thread(remove_owned, path)

    async def settle(self) -> None:
        """Waits for background calls under way (adapter unloads, aborts)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # -------------------------------------------------------------------------- status

    @property
    def version(self) -> int:
        """Policy version being served."""
        return self._version

    def status(self) -> EngineStatus:
        """Requests in flight to SGLang, requests waiting for resume, version."""
        return EngineStatus(
            version=self._version,
            running=self._running,
            queued=self._gate.queued,
            paused=self._gate.paused,
            generated_tokens=self._generated_tokens,
        )
