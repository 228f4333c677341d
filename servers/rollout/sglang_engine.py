"""The ``sglang`` engine: drives an SGLang server over its HTTP API.

Payloads follow SGLang 0.5.10's HTTP protocol as AReaL uses it (AReaL's
``areal/engine/sglang_remote.py``): ``POST /generate`` with ``input_ids``, ``sampling_params``,
``return_logprob: true``, ``stream: false``; ``POST /pause_generation {}`` and ``POST
/continue_generation {}`` around a weight update; ``POST /update_weights_from_disk
{"model_path", "abort_all_requests": true}``; ``GET /health`` for readiness;
``/init_weights_update_group`` and ``/update_weights_from_distributed`` (one attempt each) for
the distributed data plane. With LoRA, a weight update is a peft adapter directory loaded with
``POST /load_lora_adapter {"lora_name": "<name>-v<version>", "lora_path"}``, generation names
it in ``lora_path``, and an adapter no request uses any more is dropped with ``POST
/unload_lora_adapter {"lora_name"}``. A request aborted by a pause comes back as
``FinishReason.INTERRUPTED`` with its partial output; :func:`generate_resumable` re-sends
prompt + partial output after resume (as AReaL's ``RemoteInfEngine.agenerate``). Each returned
token gets the policy version read when the response arrived.

Calls are retried with tenacity on transient failures (connection errors, timeouts, HTTP
5xx), ``request_retries`` attempts in all, as AReaL does for generate, pause, continue and disk
updates; other HTTP errors and malformed answers raise :class:`SGLangError` at once. The
engine either attaches to a running server (``url``) or launches
``python -m sglang.launch_server`` as a subprocess (GPU machines only).

HTTP goes through one pooled httpx client per engine: cancelling a request closes its
connection (httpx drops a connection interrupted mid-exchange), and SGLang aborts requests whose
client has disconnected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from areal_servers.rollout.adapters import (
    AdapterBook,
    check_adapter_update,
    write_adapter,
    write_checkpoint,
)
from areal_servers.rollout.engine import (
    EngineStatus,
    FinishReason,
    InferenceEngine,
    PauseGate,
    SamplingConfig,
    TokenEvent,
    TopLogprobs,
)
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
from areal_grpc.config import LoraSettings
from areal_grpc.errors import PreconditionError
from areal_grpc.model_source import builtin_spec, is_builtin
from areal_grpc.paths import remove_owned

log = logging.getLogger(__name__)

# SGLang's "no top-k limit" value, as AReaL sends it.
NO_TOP_K = 100_000_000


class TransientHTTPError(ConnectionError):
    """A failure worth retrying: no connection, a timeout, or an HTTP 5xx answer."""


class SGLangError(RuntimeError):
    """SGLang answered, but with an error or a malformed body."""


@dataclass
class SGLangEngineConfig:
    """Settings of the ``sglang`` engine."""

    # Local HF checkpoint directory served by SGLang (the tokenizer and limits come from it).
    model: str
    # Attach to this server ("http://host:port"); empty launches one (needs launch=True).
    url: str = ""
    seed: int = 0
    # Launch `python -m sglang.launch_server` when url is empty.
    launch: bool = False
    launch_host: str = "127.0.0.1"
    launch_port: int = 30000
    launch_args: list[str] = field(default_factory=list)
    # Seconds to wait for /health after a launch (AReaL: 300).
    setup_timeout_s: float = 300.0
    # Per-request timeout (AReaL: 3600) and attempts for idempotent calls (AReaL: 3).
    request_timeout_s: float = 3600.0
    request_retries: int = 3
    retry_wait_s: float = 0.5
    # Where load_weights writes a state dict for /update_weights_from_disk.
    weights_dir: str = ""
    # The trainer's LoRA adapters (rank 0: none). Updates then bring only the adapters.
    lora: LoraSettings = field(default_factory=LoraSettings)
    # Adapters are loaded as "<lora_name>-v<version>" (AReaL's naming).
    lora_name: str = "areal"


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
    input_ids: Sequence[int], params: SamplingConfig, lora_path: str = ""
) -> dict[str, Any]:
    """The ``/generate`` request body for one sample (SGLang's, exactly); ``lora_path``
    names a loaded adapter to generate with."""
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "image_data": [],
        "sampling_params": {
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else NO_TOP_K,
            "max_new_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.temperature == 0 else params.temperature,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
        },
        "return_logprob": True,
        "stream": False,
    }
    if params.seed is not None:
        payload["sampling_params"]["sampling_seed"] = params.seed
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


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class SGLangEngine(InferenceEngine):
    """An :class:`InferenceEngine` backed by an SGLang server's HTTP API."""

    kind = "sglang"

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self.model_name = config.model
        self._process: subprocess.Popen[bytes] | None = None
        self.url = config.url.rstrip("/")
        if not self.url:
            if not config.launch:
                raise ValueError("the sglang engine needs a url to attach to, or launch=True")
            self.url = f"http://{config.launch_host}:{config.launch_port}"
        self.vocab_size, self.max_context = _model_limits(config.model)
        self.eos_token_id, self.pad_token_id = _special_ids(config.model)
        self._version = 0
        self._gate = PauseGate()
        self._running = 0
        self._generated_tokens = 0
        self._weights_tmp: str | None = None
        self._http = http_client(config.request_timeout_s)
        self.adapters_only = config.lora.rank > 0
        self._adapters = AdapterBook()
        self._unloads: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------------ lifecycle

    def launch(self) -> None:
        """Starts ``python -m sglang.launch_server`` for the model (GPU machines only)."""
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.config.model,
            "--host",
            self.config.launch_host,
            "--port",
            str(self.config.launch_port),
            "--random-seed",
            str(self.config.seed),
            *self._lora_launch_args(),
            *self.config.launch_args,
        ]
        log.info("launching %s", " ".join(cmd))
        self._process = subprocess.Popen(cmd)

    def _lora_launch_args(self) -> list[str]:
        lora = self.config.lora
        if not lora.rank:
            return []
        targets = list(lora.target_modules)
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(lora.rank),
            "--lora-target-modules",
            *(["all"] if targets == ["all-linear"] else targets),
        ]

    async def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Polls ``GET /health`` every second until it answers 200 (TimeoutError otherwise)."""

        async def healthy() -> bool:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"sglang exited with code {self._process.returncode}")
            try:
                health = await http_request(self.url, "GET", "/health", None, 5.0, self._http)
            except TransientHTTPError:
                return False
            return health.status == 200

        poll = AsyncRetrying(
            retry=retry_if_result(lambda ok: not ok),
            stop=stop_after_delay(timeout_s or self.config.setup_timeout_s),
            wait=wait_fixed(1.0),
        )
        try:
            await poll(healthy)
        except RetryError:
            raise TimeoutError(f"sglang at {self.url} not healthy in time") from None

    async def start(self) -> None:
        """Launches the server when configured to, then waits for it to be healthy."""
        if self.config.launch and self._process is None and not self.config.url:
            self.launch()
        await self.wait_healthy()

    async def close(self) -> None:
        """Stops a launched server and removes temporary weight files."""
        for task in list(self._unloads):
            task.cancel()
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            await asyncio.to_thread(self._process.wait)
        if self._weights_tmp:
            shutil.rmtree(self._weights_tmp, ignore_errors=True)
        await self._http.aclose()
        self._gate.open()

    # --------------------------------------------------------------------------- calls

    async def _post(self, path: str, payload: Any, attempts: int | None = None) -> Any:
        """POSTs with retries on transient failures; the JSON answer (or None)."""
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(attempts or self.config.request_retries),
            wait=wait_exponential(multiplier=self.config.retry_wait_s, max=10.0),
            retry=retry_if_exception_type(TransientHTTPError),
            reraise=True,
        ):
            with attempt:
                resp = await http_request(
                    self.url, "POST", path, payload, self.config.request_timeout_s, self._http
                )
        if resp.status >= 400:
            raise SGLangError(f"{path}: HTTP {resp.status}: {resp.body[:200]!r}")
        return resp.json() if resp.body.strip() else None

    async def stream(
        self, input_ids: Sequence[int], params: SamplingConfig, adapter: str = ""
    ) -> AsyncGenerator[TokenEvent, None]:
        """One ``/generate`` call; an abort (a pause) ends INTERRUPTED with the partial output.
        It holds no named adapters: any ``adapter`` is NOT_FOUND."""
        params.validate()
        self.check_prompt(input_ids, params)
        self.check_adapter(adapter)
        await self._gate.enter()
        # An adapter pins the weights a request runs on, so its tokens carry the version the
        # request was sent at; full-weight updates abort requests in flight instead (their
        # partial output comes back before the new version is served).
        adapter, sent_version = self._adapters.acquire()
        self._running += 1
        try:
            body = await self._post("/generate", generate_payload(input_ids, params, adapter))
        finally:
            self._running -= 1
            self._adapters.release(adapter)
            self._unload_idle()
        tokens, logprobs, kind = parse_generate_response(body)
        top = parse_top_logprobs(body, len(tokens)) if params.top_logprobs else []
        version = sent_version if self.adapters_only else self._version
        self._generated_tokens += len(tokens)
        if tokens:
            yield TokenEvent(tokens, logprobs, [version] * len(tokens), top=top)
        if kind == "abort":
            finish = FinishReason.INTERRUPTED
        elif kind in _FINISH:
            finish = _FINISH[kind]
        else:
            raise SGLangError(f"/generate finished with unknown reason {kind!r}")
        yield TokenEvent(finish=finish)

    async def pause(self, wait: bool = True) -> int:
        """``POST /pause_generation {}``: SGLang aborts in-flight requests (always waited for:
        SGLang's reply is what says they ended)."""
        self._gate.close()
        interrupted = self._running
        await self._post("/pause_generation", {})
        return interrupted

    async def resume(self) -> None:
        """``POST /continue_generation {}``, then lets waiting requests go."""
        await self._post("/continue_generation", {})
        self._gate.open()

    async def wait_until_resumed(self) -> None:
        """Returns when generation is not paused."""
        await self._gate.wait_open()

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """``POST /update_weights_from_disk``; serves ``version`` once SGLang accepts."""
        if self.adapters_only:
            raise PreconditionError(
                "this SGLang server serves LoRA adapters: a full checkpoint cannot replace them"
            )
        if version <= self._version:
            raise PreconditionError(
                f"weights version {version} is not newer than the served version {self._version}"
            )
        body = await self._post(
            "/update_weights_from_disk", {"model_path": model_path, "abort_all_requests": True}
        )
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"update_weights_from_disk failed: {body.get('message', body)}")
        self._version = version

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        """``POST /init_weights_update_group`` (one attempt: joining a group is not idempotent)."""
        await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": str(master_port),
                "rank_offset": rank_offset,
                "world_size": world_size,
                "backend": backend,
                "group_name": group_name,
            },
            attempts=1,
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        version: int | None = None,
    ) -> None:
        """``POST /update_weights_from_distributed`` for one bucket (one attempt).

        The sender broadcasts the tensors over the group meanwhile; pass ``version`` with the
        last bucket to serve the new version from then on.
        """
        if self.adapters_only:
            raise PreconditionError("SGLang's distributed weight updates carry no LoRA adapters")
        if version is not None and version <= self._version:
            raise PreconditionError(
                f"weights version {version} is not newer than the served version {self._version}"
            )
        body = await self._post(
            "/update_weights_from_distributed",
            {
                "names": list(names),
                "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes],
                "group_name": group_name,
                "abort_all_requests": True,
            },
            attempts=1,
        )
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"update_weights_from_distributed failed: {body.get('message')}")
        if version is not None:
            self._version = version

    async def load_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, owned: bool = False
    ) -> dict[str, torch.Tensor]:
        """Writes ``state_dict`` as a safetensors checkpoint, then loads it from disk (SGLang
        reads its own copy, so nothing is handed back)."""
        if version <= self._version:
            raise PreconditionError(
                f"weights version {version} is not newer than the served version {self._version}"
            )
        root = self.config.weights_dir or self._tmp_root()
        if self.adapters_only:
            await self._load_adapter(state_dict, version, Path(root))
            return {}
        path = Path(root) / f"v{version}"
        await asyncio.to_thread(
            write_checkpoint, self.config.model, state_dict, path, "sglang-weights"
        )
        await self.update_weights_from_disk(str(path), version)
        return {}

    async def _load_adapter(
        self, state_dict: Mapping[str, torch.Tensor], version: int, root: Path
    ) -> None:
        """Writes the adapters as a peft directory, has SGLang load it, and generates with it
        from then on; the adapter it replaces is unloaded once no request uses it."""
        check_adapter_update(state_dict.keys(), self._adapters.names)
        name = f"{self.config.lora_name}-v{version}"
        path = root / f"lora-v{version}"
        await asyncio.to_thread(
            write_adapter, self.config.model, self.config.lora, state_dict, path
        )
        try:
            body = await self._post(
                "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
            )
        except BaseException:
            await asyncio.to_thread(remove_owned, path)
            raise
        if isinstance(body, dict) and body.get("success") is False:
            await asyncio.to_thread(remove_owned, path)
            raise SGLangError(f"load_lora_adapter failed: {body.get('message', body)}")
        self._adapters.install(name, path, version, state_dict.keys())
        self._version = version
        self._unload_idle()

    def _unload_idle(self) -> None:
        """Starts unloading every replaced adapter that no request uses any more."""
        for name, path in self._adapters.idle():
            task = asyncio.get_running_loop().create_task(self._unload(name, path))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload(self, name: str, path: Path) -> None:
        try:
            await self._post("/unload_lora_adapter", {"lora_name": name})
        except (SGLangError, TransientHTTPError) as exc:
            # The new adapter serves either way; a leftover one costs SGLang memory only.
            log.warning("unloading LoRA adapter %s failed: %s", name, exc)
        await asyncio.to_thread(remove_owned, path)

    async def settle(self) -> None:
        """Waits for adapter unloads under way (tests, shutdown)."""
        while self._unloads:
            await asyncio.gather(*list(self._unloads), return_exceptions=True)

    def _tmp_root(self) -> str:
        if self._weights_tmp is None:
            self._weights_tmp = tempfile.mkdtemp(prefix="areal-sglang-weights-")
        return self._weights_tmp

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


def _model_limits(model: str) -> tuple[int, int]:
    if is_builtin(model):
        spec = builtin_spec(model)
        return spec.vocab_size, spec.max_position_embeddings
    config = json.loads((Path(model) / "config.json").read_text())
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 0) or 0)


def _special_ids(model: str) -> tuple[int | None, int | None]:
    if is_builtin(model):
        # The built-in byte tokenizer: pad 0, eos 1.
        return 1, 0
    config = json.loads((Path(model) / "config.json").read_text())
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos, config.get("pad_token_id")


__all__ = [
    "NO_TOP_K",
    "HTTPResponse",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangError",
    "TransientHTTPError",
    "generate_payload",
    "http_request",
    "parse_generate_response",
]
