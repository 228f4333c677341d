"""The gateway's HTTP surface: OpenAI chat/text completions and RL sessions, on FastAPI.

Everything it does goes through the mesh's gRPC services: leases and submissions through the
CoordinatorService, generation through the RolloutService (token ids in, token ids out). See
the package docstring for the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from arealgrpc.v1 import common_pb2, coordinator_pb2, rollout_pb2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from areal_grpc import tracing
from areal_grpc.config import RunConfig, read_chat_template
from areal_grpc.errors import FieldError, PreconditionError, retry_delay_s
from areal_grpc.model import load_tokenizer

from ..coordinator import CoordinatorClient
from ..rollout import RolloutClient
from .chat import ChatRenderer, Conversation, normalize_messages
from .sessions import Session, SessionGone, SessionStore
from .tools import ToolSettings, assistant_message, tool_settings

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
# Most completions one request may ask for.
MAX_N = 64
# OpenAI accepts up to 4 stop sequences.
MAX_STOPS = 4
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
_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}


# The producer name the gateway's leases are taken under.
PRODUCER_ID = "gateway"


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


def _from_rpc(exc: grpc.RpcError, what: str) -> HTTPError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    status = _HTTP_OF_GRPC.get(code, 500)
    headers = {}
    if status == 429:
        delay = retry_delay_s(exc)
        headers["Retry-After"] = str(max(1, round(delay if delay is not None else 1.0)))
    return HTTPError(status, f"{what}: {details}", code=code.name.lower(), headers=headers)


def _int(body: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FieldError(key, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


def _float(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
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
        return _from_rpc(exc, f"rollout server {address}")

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
                raise _from_rpc(exc, "coordinator") from exc
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
        for key in ("functions", "response_format"):
            if body.get(key) not in (None, [], {}):
                raise FieldError(key, "is not supported by this gateway yet")
        # The newer name wins; a null one falls back to max_tokens.
        key = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        limit = _int(body, key, self.settings.max_tokens, 1, 1 << 20)
        stop_ids, stop_strings = self.stops(body.get("stop"))
        params = common_pb2.SamplingParams(
            max_new_tokens=limit, n_samples=n, stop_token_ids=stop_ids
        )
        top = _int(body, "top_logprobs", 0, 0, 20)
        if top and not body.get("logprobs"):
            raise FieldError("top_logprobs", "needs logprobs: true")
        params.top_logprobs = top
        if body.get("seed") is not None:
            # OpenAI's seed is a signed 64-bit integer; the contract's an unsigned one.
            params.seed = _int(body, "seed", 0, -(2**63), 2**63 - 1) % 2**64
        temperature = _float(body, "temperature", 0.0, 2.0)
        if temperature is not None:
            params.temperature = temperature
        top_p = _float(body, "top_p", 0.0, 1.0)
        if top_p is not None:
            if top_p == 0.0:
                raise FieldError("top_p", "must be > 0")
            params.top_p = top_p
        return params, stop_strings

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


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Streamed:
    """One completion arriving token by token, and the text shown of it so far."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.top: list[rollout_pb2.TopLogprobs] = []
        self.finish = common_pb2.FINISH_REASON_UNSPECIFIED
        self.shown = ""
        self.stops = list(stops)
        # Set when a stop string ended the reply: the text before it (what the client gets)
        # and the text of the ids kept (up to the token that completed the stop string).
        self.cut: str | None = None
        self.sampled: str | None = None

    def take(self, msg: rollout_pb2.GenerateStreamResponse, renderer: ChatRenderer) -> bool:
        """Adds a message's tokens; True when the reply is complete (by the engine, or by a
        stop string: the ids after the token that completed it are dropped)."""
        self.ids += msg.output_ids
        self.logprobs += msg.output_logprobs
        self.versions += msg.output_versions
        self.top += msg.output_top_logprobs
        if msg.finish_reason:
            self.finish = msg.finish_reason
        if self.stops and self.cut is None:
            self._find_stop(renderer)
        return self.cut is not None or bool(msg.finish_reason)

    def _find_stop(self, renderer: ChatRenderer) -> None:
        text = renderer.reply_text(self.ids, False)
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if not hits:
            return
        at, stop = min(hits)
        # The fewest ids whose text holds the whole stop string.
        keep = len(self.ids)
        while keep > 1 and len(renderer.reply_text(self.ids[: keep - 1], False)) >= at + len(stop):
            keep -= 1
        del self.ids[keep:], self.logprobs[keep:], self.versions[keep:], self.top[keep:]
        self.cut = text[:at]
        self.sampled = renderer.reply_text(self.ids, False)
        self.finish = common_pb2.FINISH_REASON_STOP

    def delta(self, renderer: ChatRenderer, final: bool) -> str:
        """The text not shown yet. Until the end the newest token is held back (it may be
        the stop token) and so is a trailing partial character, and so is as much text as
        could be the start of a stop string."""
        if final and self.cut is not None:
            text = self.cut
        elif final:
            text = renderer.reply_text(self.ids, self.finish == common_pb2.FINISH_REASON_STOP)
        else:
            text = renderer.reply_text(self.ids[:-1], False).rstrip("\ufffd")
            longest = max((len(s) for s in self.stops), default=1)
            text = text[: max(0, len(text) - (longest - 1))]
        if not text.startswith(self.shown):
            return ""  # what was shown stays what the conversation records
        out, self.shown = text[len(self.shown) :], text
        return out

    def completion(self) -> rollout_pb2.Completion:
        return rollout_pb2.Completion(
            output_ids=self.ids,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason=self.finish,  # type: ignore[arg-type]
            output_top_logprobs=self.top,
        )


def _choice_logprobs(gw: Gateway, completion: rollout_pb2.Completion) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        token = gw.tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    content = []
    tops = list(completion.output_top_logprobs)
    for j, (tid, lp) in enumerate(
        zip(completion.output_ids, completion.output_logprobs, strict=True)
    ):
        top = tops[j] if j < len(tops) else None
        alternatives = (
            [entry(t, p) for t, p in zip(top.token_ids, top.logprobs, strict=True)] if top else []
        )
        content.append(entry(tid, lp) | {"top_logprobs": alternatives})
    return {"content": content}


def create_app(run: RunConfig, coordinator: str, api_key: str | None = None) -> FastAPI:
    """The gateway of ``run`` (see :class:`Gateway`) as a FastAPI application (serve it with
    uvicorn)."""
    holder: list[Gateway] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Made on the server's event loop: gRPC aio channels belong to the loop they start on.
        holder.append(Gateway(run, coordinator, api_key))
        holder[0].start()
        app.state.gateway = holder[0]
        try:
            yield
        finally:
            await holder.pop().close()

    app = FastAPI(title="areal-grpc gateway", lifespan=lifespan)

    def gateway() -> Gateway:
        return holder[0]

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(FieldError)
    async def _field_error(_: Request, exc: FieldError) -> JSONResponse:
        return HTTPError(400, str(exc), param=exc.field).response()

    @app.exception_handler(SessionGone)
    async def _gone(_: Request, exc: SessionGone) -> JSONResponse:
        return HTTPError(409, str(exc), param=SESSION_HEADER, code="session_expired").response()

    @app.exception_handler(PreconditionError)
    async def _precondition(_: Request, exc: PreconditionError) -> JSONResponse:
        return HTTPError(409, str(exc)).response()

    async def json_body(request: Request) -> dict[str, Any]:
        gateway().check_auth(request)
        try:
            body = await request.json()
        except ValueError:
            raise HTTPError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway().check_auth(request)
        return {
            "object": "list",
            "data": [
                {"id": run.model.source, "object": "model", "created": 0, "owned_by": "areal-grpc"}
            ],
        }

    async def prepare(
        request: Request,
        body: dict[str, Any],
        base: Conversation,
        kind: str,
        parent: Conversation | None = None,
        tools: ToolSettings | None = None,
    ) -> Call:
        """Checks the request's fields and picks the rollout server (nothing generated yet).

        ``parent``: the session's conversation ``base`` continues; it is replaced by ``base``
        only once a reply exists (a failed request leaves the session as it was).
        """
        n = _int(body, "n", 1, 1, MAX_N)
        params, stop_strings = gateway().sampling(body, n)
        session_id = request.headers.get(SESSION_HEADER)
        session = gateway().session(session_id) if session_id else None
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        address = (
            await gateway().session_rollout(session) if session else await gateway().any_rollout()
        )
        if session is not None:
            # The lease must outlive the generation: renewed now if it is running down, and
            # by the heartbeat while the request is in flight.
            await gateway().keep_alive(session)
            session.begin()
        return Call(
            body,
            kind,
            base,
            parent,
            session,
            n,
            params,
            rid,
            address,
            run.model.source,
            tools or ToolSettings(None, False),
            stop_strings,
            on_end=gateway().keep_alive_later,
        )

    def choice(
        call: Call,
        i: int,
        completion: rollout_pb2.Completion,
        text: str,
        cid: str,
        message: dict[str, Any] | None,
    ) -> dict[str, Any]:
        finish = _FINISH.get(completion.finish_reason, "stop")
        out: dict[str, Any] = {
            "index": i,
            "finish_reason": "tool_calls" if message and "tool_calls" in message else finish,
            "completion_id": cid,
        }
        if call.kind == "chat":
            out["message"] = message
            logprobs = call.body.get("logprobs")
            out["logprobs"] = _choice_logprobs(gateway(), completion) if logprobs else None
        else:
            out["text"] = text
            out["logprobs"] = None
        if call.body.get("return_token_ids"):
            out["token_ids"] = list(completion.output_ids)
        return out

    async def complete(call: Call) -> dict[str, Any]:
        """Generates the ``n`` replies in one Generate call and records them."""
        prompt = list(call.base.token_ids)
        with call.traced() as trace_context:
            reply = await gateway().generate(
                call.address, prompt, call.params, call.rid, trace_context
            )
        if len(reply.completions) != call.n:
            raise HTTPError(
                502,
                f"rollout server {call.address} returned {len(reply.completions)} completions "
                f"for n={call.n}",
            )
        choices, completion_tokens = [], 0
        for i, completion in enumerate(reply.completions):
            stopped = completion.finish_reason == common_pb2.FINISH_REASON_STOP
            text = gateway().renderer.reply_text(completion.output_ids, stopped)
            cid, message = call.record(i, completion, text)
            completion_tokens += len(completion.output_ids)
            choices.append(choice(call, i, completion, text, cid, message))
        obj = "chat.completion" if call.kind == "chat" else "text_completion"
        return call.envelope(obj) | {
            "system_fingerprint": f"policy-v{reply.policy_version}",
            "choices": choices,
            "usage": _usage(len(prompt), completion_tokens),
        }

    async def updates(call: Call) -> AsyncIterator[tuple[int, _Streamed, bool]]:
        """(choice, its reply so far, whether it is complete) as tokens arrive, over one
        ``GenerateStream`` per choice; a choice cut at a stop string has its stream
        cancelled. Raises HTTPError when a stream fails."""
        prompt = list(call.base.token_ids)
        one = common_pb2.SamplingParams()
        one.CopyFrom(call.params)
        one.n_samples = 1
        # Choice i gets seed + i, as the engine gives sample i of a seeded request.
        seeds = [(one.seed + i) % 2**64 for i in range(call.n)]
        renderer = gateway().renderer

        async def pump(i: int, queue: asyncio.Queue[tuple[int, Any]]) -> None:
            rid = call.rid if call.n == 1 else f"{call.rid}:{i}"
            params = common_pb2.SamplingParams()
            params.CopyFrom(one)
            if params.HasField("seed"):
                params.seed = seeds[i]
            try:
                with call.traced(i) as trace_context:
                    async for msg in (
                        gateway()
                        .rollout(call.address)
                        .generate_stream(
                            prompt,
                            params,
                            gateway().settings.generate_timeout_s,
                            request_id=rid,
                            trace_context=trace_context,
                        )
                    ):
                        await queue.put((i, msg))
                await queue.put((i, None))
            except grpc.RpcError as exc:
                await queue.put((i, gateway().rollout_error(exc, call.address)))

        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        tasks = [asyncio.create_task(pump(i, queue)) for i in range(call.n)]
        replies = [_Streamed(call.stop_strings) for _ in range(call.n)]
        finished: set[int] = set()
        try:
            while len(finished) < call.n:
                i, msg = await queue.get()
                if i in finished:
                    continue  # the end of a stream cut short, or of one already complete
                if isinstance(msg, HTTPError):
                    raise msg
                reply = replies[i]
                if msg is not None and not reply.take(msg, renderer):
                    yield i, reply, False
                    continue
                finished.add(i)
                if reply.cut is not None:
                    tasks[i].cancel()  # a stop string ended it: nothing more is wanted
                yield i, reply, True
        finally:
            for t in tasks:
                t.cancel()

    async def complete_streamed(call: Call) -> dict[str, Any]:
        """Like :func:`complete`, over streams: the replies watched for stop strings."""
        done: dict[int, _Streamed] = {}
        async for i, reply, final in updates(call):
            if final:
                done[i] = reply
        renderer = gateway().renderer
        choices, completion_tokens = [], 0
        for i in range(call.n):
            reply = done[i]
            reply.delta(renderer, final=True)
            completion = reply.completion()
            cid, message = call.record(i, completion, reply.shown, reply.sampled)
            completion_tokens += len(reply.ids)
            choices.append(choice(call, i, completion, reply.shown, cid, message))
        obj = "chat.completion" if call.kind == "chat" else "text_completion"
        return call.envelope(obj) | {
            "choices": choices,
            "usage": _usage(len(call.base.token_ids), completion_tokens),
        }

    def stream(call: Call) -> StreamingResponse:
        """The replies as server-sent events in OpenAI's chunk format, one stream each."""
        obj = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
        prompt = list(call.base.token_ids)
        usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
        renderer = gateway().renderer

        def chunk(
            i: int,
            delta: str | None,
            finish: str | None = None,
            calls: list[dict[str, Any]] | None = None,
        ) -> str:
            if call.kind == "chat":
                part: dict[str, Any] = {"index": i, "delta": {}, "finish_reason": finish}
                if delta is not None:
                    part["delta"] = {"content": delta}
                if calls:
                    part["delta"]["tool_calls"] = [{"index": j} | c for j, c in enumerate(calls)]
            else:
                part = {"index": i, "text": delta or "", "finish_reason": finish}
            return _sse(call.envelope(obj) | {"choices": [part]})

        async def events() -> AsyncIterator[str]:
            if call.kind == "chat":
                for i in range(call.n):
                    opening = call.envelope(obj) | {
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ]
                    }
                    yield _sse(opening)
            tokens = 0
            try:
                async for i, reply, final in updates(call):
                    if not final:
                        # With tools parsed, nothing is shown until the reply is complete:
                        # only then is it known to be content or tool calls.
                        delta = "" if call.tools.parse else reply.delta(renderer, final=False)
                        if delta:
                            yield chunk(i, delta)
                        continue
                    delta = reply.delta(renderer, final=True)
                    finish = _FINISH.get(reply.finish, "stop")
                    tokens += len(reply.ids)
                    _, message = call.record(i, reply.completion(), reply.shown, reply.sampled)
                    if message and "tool_calls" in message:
                        yield chunk(i, message["content"], "tool_calls", message["tool_calls"])
                    else:
                        yield chunk(i, delta or None, finish)
                if usage:
                    yield _sse(
                        call.envelope(obj) | {"choices": [], "usage": _usage(len(prompt), tokens)}
                    )
                yield "data: [DONE]\n\n"
            except HTTPError as exc:
                yield _sse({"error": exc.body()})
            finally:
                call.release()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def answer(call: Call) -> Any:
        if call.body.get("stream"):
            return stream(call)  # releases its claim when the stream ends
        try:
            # A response, not a dict: FastAPI would walk the dict through jsonable_encoder
            # first (~50 us a completion here, on the one event loop every request shares).
            if call.stop_strings:
                return JSONResponse(await complete_streamed(call))
            return JSONResponse(await complete(call))
        finally:
            call.release()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await json_body(request)
        messages = normalize_messages(body.get("messages"))
        tools = tool_settings(body, gateway().renderer)
        session_id = request.headers.get(SESSION_HEADER)
        if session_id:
            # No lock: matching and recording do not await. A conversation being continued
            # is claimed until its request ends, so concurrent requests with the same
            # messages (two choices with equal replies) continue different conversations,
            # and one more than there are becomes a conversation of its own.
            session = gateway().session(session_id)
            conv, parent = session.conversation_for(messages, gateway().renderer, tools.tools)
            try:
                call = await prepare(request, body, conv, "chat", parent, tools)
            except BaseException:
                session.release(parent)
                raise
            return await answer(call)
        fresh = Conversation.start(messages, gateway().renderer, tools.tools)
        return await answer(await prepare(request, body, fresh, "chat", None, tools))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
            text = gateway().tokenizer.decode(ids)
        elif isinstance(prompt, str) and prompt:
            text, ids = prompt, gateway().renderer.encode(prompt)
        else:
            raise FieldError("prompt", "must be a non-empty string or a list of token ids")
        n = len(ids)
        conv = Conversation([], text, ids, [0.0] * n, [-1] * n, [False] * n, n)
        return await answer(await prepare(request, body, conv, "text"))

    @app.post("/rl/sessions")
    async def open_session(request: Request) -> Any:
        body = await json_body(request) if await request.body() else {}
        group_size = _int(body, "group_size", 1, 1, 1 << 16)
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise FieldError("metadata", "must be an object")
        try:
            lease = await gateway().coordinator.acquire(PRODUCER_ID, group_size, timeout_s=30.0)
        except grpc.RpcError as exc:
            raise _from_rpc(exc, "coordinator") from exc
        session = Session(lease, metadata)
        gateway().sessions.add(session)
        return {
            "session_id": session.session_id,
            "policy_version": int(lease.policy_version),
            "expires_at": session.expires_at,
            # Renewed while the session works: it expires this long after its last
            # completion ended.
            "lease_ttl_s": round(session.ttl_s, 3),
            "group_size": int(lease.group_size),
        }

    @app.post("/rl/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> Any:
        body = await json_body(request)
        session = gateway().session(session_id)
        group = session.group(body)
        # A lease about to run out would expire on its way to the coordinator.
        await gateway().keep_alive(session)
        # Ended before the submission awaits: later completions of it are 404 (as is this
        # call when another one ended it meanwhile).
        gateway().session(session_id)
        gateway().sessions.pop(session_id)
        try:
            reply = await gateway().coordinator.submit([(session_id, group)])
        except grpc.RpcError as exc:
            raise _from_rpc(exc, "coordinator") from exc
        reasons = [r.reason for r in reply.rejections]
        return {
            "submitted": True,
            "accepted": reply.accepted_groups == 1,
            "reason": "; ".join(reasons),
            "trajectories": len(group.trajectories),
        }

    @app.delete("/rl/sessions/{session_id}")
    async def release(session_id: str, request: Request) -> Any:
        gateway().check_auth(request)
        gateway().session(session_id)
        gateway().sessions.pop(session_id)
        try:
            await gateway().coordinator.release(session_id)
        except grpc.RpcError as exc:
            raise _from_rpc(exc, "coordinator") from exc
        return {"released": True}

    return app
