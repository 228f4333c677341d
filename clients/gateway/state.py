"""The state behind the gateway's routes: its mesh clients, renderer and open sessions
(:class:`Gateway`), one request's bookkeeping (:class:`Call`), and HTTP errors in OpenAI's
shape.

Everything it does goes through the mesh's gRPC services: leases and submissions through the
CoordinatorService, generation through the RolloutService (token ids in, token ids out).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from arealgrpc.v1 import common_pb2, coordinator_pb2, rollout_pb2
from fastapi import Request
from fastapi.responses import JSONResponse

from areal_grpc import tracing
from areal_grpc.config import RunConfig, read_chat_template
from areal_grpc.errors import FieldError, retry_delay_s
from areal_grpc.model import load_tokenizer, resolve_source
from areal_grpc.model_source import builtin_spec, is_builtin
from areal_grpc.sampling import MIN_TEMPERATURE, MIN_TOP_P

from ..coordinator import CoordinatorClient
from ..rollout import RolloutClient
from .chat import ChatRenderer, Conversation
from .sessions import Session, SessionGone, SessionStore
from .tools import ToolSettings, assistant_message

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
# Most completions one request may ask for.
MAX_N = 64
# OpenAI accepts up to 4 stop sequences.
MAX_STOPS = 4
# OpenAI request fields this gateway refuses unless null or empty.
UNSUPPORTED = ("functions", "response_format")
# How long the list of serving rollout servers is reused for requests without a session.
_FLEET_TTL_S = 2.0
# How long a rollout server that did not answer is passed over.
_DOWN_S = 10.0
# A session's lease is renewed once less than this share of the lease time is left: at most
# one RenewRollout per tenth of the lease time per session.
_RENEW_BELOW = 0.9
_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}


# The producer name the gateway's leases are taken under.
PRODUCER_ID = "gateway"


def model_context(source: str) -> int:
    """The served model's context in tokens (``max_position_embeddings``; 0: not known)."""
    if is_builtin(source):
        return builtin_spec(source).max_position_embeddings
    config = Path(resolve_source(source)) / "config.json"
    if not config.is_file():
        return 0
    value = json.loads(config.read_text()).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else 0


class HTTPError(Exception):
    """An error answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The error object of OpenAI's error shape."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status in (401, 403):
            kind = "authentication_error" if self.status == 401 else "permission_error"
        elif self.status == 429:
            kind = "rate_limit_error"
        return {"message": self.message, "type": kind, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)


def from_rpc(exc: grpc.RpcError, what: str) -> HTTPError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    status = _HTTP_OF_GRPC.get(code, 500)
    headers = {}
    if status == 429:
        delay = retry_delay_s(exc)
        headers["Retry-After"] = str(max(1, round(delay if delay is not None else 1.0)))
    return HTTPError(status, f"{what}: {details}", code=code.name.lower(), headers=headers)


def int_field(body: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    # JSON has one number type: 3.0 is the integer 3 (as JSON Schema reads it).
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FieldError(key, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


def float_field(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise FieldError(key, f"must be a number in [{low}, {high}], got {value!r}")
    return float(value)


class Gateway:
    """The state behind the endpoints: mesh clients, the renderer and the open sessions."""

    def __init__(self, run: RunConfig, coordinator: str, api_key: str | None = None) -> None:
        """Serves ``run``'s policy (its tokenizer and chat template) under its ``gateway``
        settings; per process: the coordinator's address and the bearer token clients must
        send (None: no auth)."""
        self.settings, self.model_id, self.api_key = run.gateway, run.model.source, api_key
        self.tokenizer = load_tokenizer(run.model.source)
        # Token ids a prompt may hold: [0, vocab_size).
        self.vocab_size = len(self.tokenizer)
        # Known here so that max_tokens is cut to the room a prompt leaves (see fit_context).
        self.context = model_context(run.model.source)
        path = run.gateway.chat_template
        self.renderer = ChatRenderer(self.tokenizer, read_chat_template(path) if path else None)
        self.coordinator = CoordinatorClient(coordinator)
        self.sessions = SessionStore()
        self._rollouts: dict[str, RolloutClient] = {}
        self._fleet: list[str] = []
        self._fleet_at = 0.0
        # Rollout servers whose last call failed UNAVAILABLE: address -> when to try again.
        self._down: dict[str, float] = {}
        self._turn = itertools.count()
        self._heartbeat: asyncio.Task[None] | None = None
        # Renewals started in the background, held so that none is garbage-collected midway.
        self._renewing: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Starts the heartbeat that keeps working sessions' leases alive."""
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def close(self) -> None:
        """Stops the heartbeat, closes every channel."""
        for task in [self._heartbeat, *self._renewing]:
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in [self._heartbeat, *self._renewing] if t is not None),
            return_exceptions=True,
        )
        for client in self._rollouts.values():
            await client.close()
        await self.coordinator.close()

    # -- leases --------------------------------------------------------------------------------

    async def keep_alive(self, session: Session) -> None:
        """Renews the session's lease unless it was renewed a moment ago (a heartbeat);
        SessionGone (409) when the coordinator no longer holds it."""
        if session.remaining_s() > _RENEW_BELOW * session.ttl_s:
            return
        if session.renewal is None or session.renewal.done():
            session.renewal = asyncio.ensure_future(self._renew(session))
        # Shielded: one caller giving up (its request cancelled) leaves the renewal to the
        # others that wait for it.
        await asyncio.shield(session.renewal)
        if session.lost:
            raise SessionGone(session.expiry_message())

    def keep_alive_later(self, session: Session) -> None:
        """:meth:`keep_alive` in the background (a completion just ended)."""

        async def renew() -> None:
            with contextlib.suppress(SessionGone):
                await self.keep_alive(session)

        task = asyncio.get_running_loop().create_task(renew())
        self._renewing.add(task)
        task.add_done_callback(self._renewing.discard)

    async def _renew(self, session: Session) -> None:
        """One RenewRollout; a lease the coordinator no longer holds ends the session."""
        try:
            session.deadline = await self.coordinator.renew(session.session_id, timeout_s=10.0)
        except grpc.RpcError as exc:
            if callable(getattr(exc, "code", None)) and exc.code() == grpc.StatusCode.NOT_FOUND:
                session.lost = True
                self.sessions.lose(session.session_id, session.expiry_message())
                return
            # Transient (the coordinator restarting, a slow call): the lease keeps its
            # deadline and the next heartbeat tries again.
            log.warning("renewing the lease of session %s failed: %s", session.session_id, exc)

    async def _beat(self) -> None:
        """Renews the leases of sessions with a completion in flight (one can take longer
        than the lease time on a busy machine)."""
        limit = self.settings.generate_timeout_s
        while True:
            working = [s for s in self.sessions if s.busy > 0]
            # A tenth of the shortest lease time, so a renewal comes well before the end.
            ttl = min((s.ttl_s for s in working), default=10.0)
            await asyncio.sleep(min(1.0, max(0.02, ttl / 10)))
            now = time.monotonic()
            for session in working:
                # A request that never ended (a stream nobody read) does not keep its
                # session forever: no completion runs longer than generate_timeout_s.
                if session.busy > 0 and now - session.active_at < limit + session.ttl_s:
                    self.keep_alive_later(session)

    def rollout(self, address: str) -> RolloutClient:
        """A client of the rollout server at ``address`` (one channel each)."""
        if address not in self._rollouts:
            self._rollouts[address] = RolloutClient(address)
        return self._rollouts[address]

    def mark_down(self, address: str) -> None:
        """Keeps requests off ``address`` for a while (it did not answer)."""
        self._down[address] = time.monotonic() + _DOWN_S

    def is_down(self, address: str) -> bool:
        """Whether ``address`` failed recently."""
        return self._down.get(address, 0.0) > time.monotonic()

    def rollout_error(self, exc: grpc.RpcError, address: str) -> HTTPError:
        """A rollout server's failure as an HTTP error; a server that did not answer is
        passed over for a while (a session's next request goes to another one)."""
        if callable(getattr(exc, "code", None)) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.mark_down(address)
        return from_rpc(exc, f"rollout server {address}")

    async def session_rollout(self, session: Session) -> str:
        """The session's rollout server: its lease's, or another once that one is down (the
        conversations are kept here, so any server with the policy can continue them)."""
        if self.is_down(session.address):
            session.address = await self.any_rollout()
        return session.address

    async def any_rollout(self) -> str:
        """A serving rollout server, in turn (requests without a session)."""
        now = time.monotonic()
        if now - self._fleet_at > _FLEET_TTL_S or not self._fleet:
            try:
                status = await self.coordinator.status(timeout_s=10.0)
            except grpc.RpcError as exc:
                raise from_rpc(exc, "coordinator") from exc
            # "healthy" is the coordinator's own test for a server in rotation.
            self._fleet = [
                w.address
                for w in status.workers
                if w.role == coordinator_pb2.WORKER_ROLE_ROLLOUT and w.healthy
            ]
            self._fleet_at = now
        up = [a for a in self._fleet if not self.is_down(a)]
        if not up:
            raise HTTPError(503, "no rollout server is serving", code="no_rollout_server")
        return up[next(self._turn) % len(up)]

    def check_auth(self, request: Request) -> None:
        """401 without a bearer token, 403 with a wrong one (when an API key is set)."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HTTPError(401, "missing bearer token (Authorization: Bearer <key>)")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise HTTPError(403, "the bearer token is not valid")

    def session(self, session_id: str) -> Session:
        """The open session; 404 when unknown, 409 when its lease expired."""
        try:
            return self.sessions.get(session_id)
        except KeyError:
            raise HTTPError(404, f"no session {session_id!r}", param=SESSION_HEADER) from None

    def sampling(
        self, body: Mapping[str, Any], n: int
    ) -> tuple[common_pb2.SamplingParams, list[str]]:
        """The request's sampling settings as the contract's SamplingParams, and the stop
        strings the engine cannot stop at (watched for here)."""
        for key in UNSUPPORTED:
            if body.get(key) not in (None, [], {}):
                raise FieldError(key, "is not supported by this gateway yet")
        if not isinstance(body.get("model"), (str, type(None))):
            # Any name is served (one policy), but a name is a string.
            raise FieldError("model", f"must be a string, got {body['model']!r}")
        for key in ("logprobs", "stream", "return_token_ids"):
            if not isinstance(body.get(key), (bool, type(None))):
                raise FieldError(key, f"must be true, false or null, got {body[key]!r}")
        options = body.get("stream_options")
        if options is not None and (
            not isinstance(options, dict)
            or not isinstance(options.get("include_usage", False), bool)
        ):
            raise FieldError("stream_options", 'must be null or {"include_usage": true|false}')
        # Both names are checked; the newer wins, a null one falls back to max_tokens.
        limit = int_field(body, "max_tokens", self.settings.max_tokens, 1, 1 << 20)
        limit = int_field(body, "max_completion_tokens", limit, 1, 1 << 20)
        stop_ids, stop_strings = self.stops(body.get("stop"))
        params = common_pb2.SamplingParams(
            max_new_tokens=limit, n_samples=n, stop_token_ids=stop_ids
        )
        top = int_field(body, "top_logprobs", 0, 0, 20)
        if top and not body.get("logprobs"):
            raise FieldError("top_logprobs", "needs logprobs: true")
        params.top_logprobs = top
        if body.get("seed") is not None:
            # OpenAI's seed is a signed 64-bit integer, the contract's an unsigned one: any
            # integer is taken modulo 2**64 (a bound would be a number JSON readers round).
            seed = body["seed"]
            if isinstance(seed, float) and seed.is_integer():
                seed = int(seed)
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise FieldError("seed", f"must be an integer, got {seed!r}")
            params.seed = seed % 2**64
        temperature = float_field(body, "temperature", 0.0, 2.0)
        if temperature is not None:
            # The contract's rule, checked here so a stream never starts on a bad value.
            if 0.0 < temperature < MIN_TEMPERATURE:
                raise FieldError(
                    "temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}"
                )
            params.temperature = temperature
        top_p = float_field(body, "top_p", 0.0, 1.0)
        if top_p is not None:
            if top_p < MIN_TOP_P:
                raise FieldError("top_p", f"must be in [{MIN_TOP_P}, 1], got {top_p}")
            params.top_p = top_p
        return params, stop_strings

    def fit_context(self, params: common_pb2.SamplingParams, prompt: int, name: str) -> None:
        """Cuts ``params.max_new_tokens`` to the room a prompt of ``prompt`` tokens leaves in
        the model's context: max_tokens is a bound, so a reply that fills the context ends
        with finish_reason "length" (as one that reaches max_tokens does) instead of failing.
        A prompt with no room left is a 400 naming ``name`` (OpenAI's
        context_length_exceeded)."""
        if not self.context:
            return
        room = self.context - prompt
        if room < 1:
            raise HTTPError(
                400,
                f"{name}: the prompt is {prompt} tokens, which leaves no room in the model's "
                f"context of {self.context} tokens",
                param=name,
                code="context_length_exceeded",
            )
        params.max_new_tokens = min(params.max_new_tokens, room)

    def stops(self, stop: Any) -> tuple[list[int], list[str]]:
        """(stop token ids, stop strings): a stop that is one token of the vocabulary ends
        generation in the engine; a longer one is watched for here, in the decoded text."""
        if stop is None:
            return [], []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise FieldError("stop", "must be a string or a list of strings")
        if len(items) > MAX_STOPS:
            raise FieldError("stop", f"at most {MAX_STOPS} stop sequences, got {len(items)}")
        ids, strings = [], []
        for i, s in enumerate(items):
            if not s:
                raise FieldError(f"stop[{i}]", "must not be empty")
            encoded = self.renderer.encode(s)
            if len(encoded) == 1:
                ids.append(encoded[0])
            else:
                strings.append(s)
        return ids, strings

    async def generate(
        self,
        address: str,
        prompt: list[int],
        params: common_pb2.SamplingParams,
        rid: str,
        trace_context: common_pb2.TraceContext | None = None,
    ) -> rollout_pb2.GenerateResponse:
        """Generate at ``address``, its errors as HTTP errors."""
        try:
            return await self.rollout(address).generate(
                prompt,
                params,
                timeout_s=self.settings.generate_timeout_s,
                request_id=rid,
                trace_context=trace_context,
            )
        except grpc.RpcError as exc:
            raise self.rollout_error(exc, address) from exc


@dataclass
class Call:
    """One completion request, checked: what to generate, where, for whom."""

    body: dict[str, Any]
    kind: str  # "chat" or "text"
    base: Conversation
    parent: Conversation | None
    session: Session | None
    n: int
    params: common_pb2.SamplingParams
    rid: str
    address: str
    model: str
    tools: ToolSettings
    # Stop sequences of several tokens, watched for in the decoded text.
    stop_strings: list[str] = field(default_factory=list)
    # Called with the session when the request ends (the gateway renews its lease).
    on_end: Callable[[Session], None] | None = None
    branches: list[Conversation] = field(init=False)
    ended: bool = field(init=False, default=False)

    def record(
        self,
        i: int,
        completion: rollout_pb2.Completion,
        text: str,
        sampled: str | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Adds choice ``i``'s reply to its conversation (and the session); its id and, for
        chat, the assistant message (with any tool calls parsed out of ``text``).

        ``sampled``: the text of the sampled ids when the client is shown less (a reply cut
        at a stop string); the conversation renders that text when it continues.
        """
        conv = self.base if i == 0 else self.branches[i - 1]
        cid = self.rid if self.n == 1 else f"{self.rid}:{i}"
        message, kept = None, None
        if self.kind == "chat":
            message, kept = assistant_message(text, cid, self.tools)
        if sampled is None:
            conv.add_reply(cid, completion, text, kept)
        else:
            # Stopped by a string, not a stop token: no stop token text to skip later.
            conv.add_reply(cid, completion, sampled, kept, stop_token=False)
        if self.session is not None:
            self.session.add(conv, self.parent if i == 0 else None)
        return cid, message

    def __post_init__(self) -> None:
        # Every choice continues the same prompt: the first takes the conversation
        # itself, the others copies of it as it was before any reply.
        self.branches = [self.base.branch() for _ in range(self.n - 1)]

    @contextlib.contextmanager
    def traced(self, index: int | None = None) -> Iterator[common_pb2.TraceContext | None]:
        """A ``gateway.completion`` span, a child of the session's lease (so the lease's
        generation, submission and training are one trace); yields the context Generate
        calls carry: the span's when this process traces, else the lease's."""
        lease = self.session.lease.trace_context if self.session is not None else None
        attributes: dict[str, Any] = {
            tracing.TASK_ID: self.session.session_id if self.session is not None else self.rid,
            tracing.ROLLOUT_SERVER: self.address,
        }
        if index is not None:
            attributes["areal.choice"] = index
        with tracing.span("gateway.completion", parent=lease, attributes=attributes):
            yield tracing.to_proto() if tracing.enabled() else lease

    def release(self) -> None:
        """Ends the request's claim on the conversation it continues (once)."""
        if self.session is not None and not self.ended:
            self.ended = True
            self.session.release(self.parent)
            self.session.end()
            if self.on_end is not None:
                self.on_end(self.session)

    def envelope(self, obj: str) -> dict[str, Any]:
        """The fields every response object and chunk starts with."""
        return {"id": self.rid, "object": obj, "created": int(time.time()), "model": self.model}


def gateway_of(request: Request) -> Gateway:
    """The app's gateway state (made by create_app's lifespan)."""
    return request.app.state.gateway  # type: ignore[no-any-return]


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object body, after the bearer check."""
    gateway_of(request).check_auth(request)
    try:
        body = await request.json()
    except ValueError:
        raise HTTPError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return body
