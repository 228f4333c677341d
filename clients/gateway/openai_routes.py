"""The gateway's OpenAI routes: ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions`` (streamed or not), generated at a rollout server and, inside an RL
session, recorded token-exactly."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from arealgrpc.v1 import common_pb2, rollout_pb2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from areal_grpc.errors import FieldError

from .chat import ChatRenderer, Conversation, normalize_messages
from .openapi import (
    CHAT_BODY,
    CHAT_OK,
    COMPLETION_BODY,
    MODELS_OK,
    TEXT_OK,
    errors,
    request_body,
)
from .state import (
    FINISH_REASONS,
    MAX_N,
    SESSION_HEADER,
    Call,
    Gateway,
    HTTPError,
    gateway_of,
    int_field,
    json_body,
)
from .tools import ToolSettings, tool_settings

router = APIRouter()


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


async def prepare(
    gw: Gateway,
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
    n = int_field(body, "n", 1, 1, MAX_N)
    params, stop_strings = gw.sampling(body, n)
    gw.fit_context(params, len(base.token_ids), "messages" if kind == "chat" else "prompt")
    session_id = request.headers.get(SESSION_HEADER)
    session = gw.session(session_id) if session_id else None
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    address = await gw.session_rollout(session) if session else await gw.any_rollout()
    if session is not None:
        # The lease must outlive the generation: renewed now if it is running down, and
        # by the heartbeat while the request is in flight.
        await gw.keep_alive(session)
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
        gw.model_id,
        tools or ToolSettings(None, False),
        stop_strings,
        on_end=gw.keep_alive_later,
    )


def choice(
    gw: Gateway,
    call: Call,
    i: int,
    completion: rollout_pb2.Completion,
    text: str,
    cid: str,
    message: dict[str, Any] | None,
) -> dict[str, Any]:
    finish = FINISH_REASONS.get(completion.finish_reason, "stop")
    out: dict[str, Any] = {
        "index": i,
        "finish_reason": "tool_calls" if message and "tool_calls" in message else finish,
        "completion_id": cid,
    }
    if call.kind == "chat":
        out["message"] = message
        logprobs = call.body.get("logprobs")
        out["logprobs"] = _choice_logprobs(gw, completion) if logprobs else None
    else:
        out["text"] = text
        out["logprobs"] = None
    if call.body.get("return_token_ids"):
        out["token_ids"] = list(completion.output_ids)
    return out


async def complete(gw: Gateway, call: Call) -> dict[str, Any]:
    """Generates the ``n`` replies in one Generate call and records them."""
    prompt = list(call.base.token_ids)
    with call.traced() as trace_context:
        reply = await gw.generate(call.address, prompt, call.params, call.rid, trace_context)
    if len(reply.completions) != call.n:
        raise HTTPError(
            502,
            f"rollout server {call.address} returned {len(reply.completions)} completions "
            f"for n={call.n}",
        )
    choices, completion_tokens = [], 0
    for i, completion in enumerate(reply.completions):
        stopped = completion.finish_reason == common_pb2.FINISH_REASON_STOP
        text = gw.renderer.reply_text(completion.output_ids, stopped)
        cid, message = call.record(i, completion, text)
        completion_tokens += len(completion.output_ids)
        choices.append(choice(gw, call, i, completion, text, cid, message))
    obj = "chat.completion" if call.kind == "chat" else "text_completion"
    return call.envelope(obj) | {
        "system_fingerprint": f"policy-v{reply.policy_version}",
        "choices": choices,
        "usage": _usage(len(prompt), completion_tokens),
    }


async def updates(gw: Gateway, call: Call) -> AsyncIterator[tuple[int, _Streamed, bool]]:
    """(choice, its reply so far, whether it is complete) as tokens arrive, over one
    ``GenerateStream`` per choice; a choice cut at a stop string has its stream
    cancelled. Raises HTTPError when a stream fails."""
    prompt = list(call.base.token_ids)
    one = common_pb2.SamplingParams()
    one.CopyFrom(call.params)
    one.n_samples = 1
    # Choice i gets seed + i, as the engine gives sample i of a seeded request.
    seeds = [(one.seed + i) % 2**64 for i in range(call.n)]
    renderer = gw.renderer

    async def pump(i: int, queue: asyncio.Queue[tuple[int, Any]]) -> None:
        rid = call.rid if call.n == 1 else f"{call.rid}:{i}"
        params = common_pb2.SamplingParams()
        params.CopyFrom(one)
        if params.HasField("seed"):
            params.seed = seeds[i]
        try:
            with call.traced(i) as trace_context:
                async for msg in gw.rollout(call.address).generate_stream(
                    prompt,
                    params,
                    gw.settings.generate_timeout_s,
                    request_id=rid,
                    trace_context=trace_context,
                ):
                    await queue.put((i, msg))
            await queue.put((i, None))
        except grpc.RpcError as exc:
            await queue.put((i, gw.rollout_error(exc, call.address)))

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


async def complete_streamed(gw: Gateway, call: Call) -> dict[str, Any]:
    """Like :func:`complete`, over streams: the replies watched for stop strings."""
    done: dict[int, _Streamed] = {}
    async for i, reply, final in updates(gw, call):
        if final:
            done[i] = reply
    renderer = gw.renderer
    choices, completion_tokens = [], 0
    for i in range(call.n):
        reply = done[i]
        reply.delta(renderer, final=True)
        completion = reply.completion()
        cid, message = call.record(i, completion, reply.shown, reply.sampled)
        completion_tokens += len(reply.ids)
        choices.append(choice(gw, call, i, completion, reply.shown, cid, message))
    obj = "chat.completion" if call.kind == "chat" else "text_completion"
    return call.envelope(obj) | {
        "choices": choices,
        "usage": _usage(len(call.base.token_ids), completion_tokens),
    }


def stream(gw: Gateway, call: Call) -> StreamingResponse:
    """The replies as server-sent events in OpenAI's chunk format, one stream each."""
    obj = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
    prompt = list(call.base.token_ids)
    usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
    renderer = gw.renderer

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
            async for i, reply, final in updates(gw, call):
                if not final:
                    # With tools parsed, nothing is shown until the reply is complete:
                    # only then is it known to be content or tool calls.
                    delta = "" if call.tools.parse else reply.delta(renderer, final=False)
                    if delta:
                        yield chunk(i, delta)
                    continue
                delta = reply.delta(renderer, final=True)
                finish = FINISH_REASONS.get(reply.finish, "stop")
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


async def answer(gw: Gateway, call: Call) -> Any:
    if call.body.get("stream"):
        return stream(gw, call)  # releases its claim when the stream ends
    try:
        # A response, not a dict: FastAPI would walk the dict through jsonable_encoder
        # first (~50 us a completion here, on the one event loop every request shares).
        if call.stop_strings:
            return JSONResponse(await complete_streamed(gw, call))
        return JSONResponse(await complete(gw, call))
    finally:
        call.release()


@router.get("/v1/models", responses=MODELS_OK | errors(401, 403))
async def models(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    gw.check_auth(request)
    return {
        "object": "list",
        "data": [{"id": gw.model_id, "object": "model", "created": 0, "owned_by": "areal-grpc"}],
    }


@router.post(
    "/v1/chat/completions",
    openapi_extra=request_body(CHAT_BODY),
    responses=CHAT_OK | errors(400, 401, 403, 404, 409, 429, 502, 503, 504),
)
async def chat_completions(request: Request) -> Any:
    body = await json_body(request)
    gw = gateway_of(request)
    messages = normalize_messages(body.get("messages"))
    tools = tool_settings(body, gw.renderer)
    session_id = request.headers.get(SESSION_HEADER)
    if session_id:
        # No lock: matching and recording do not await. A conversation being continued
        # is claimed until its request ends, so concurrent requests with the same
        # messages (two choices with equal replies) continue different conversations,
        # and one more than there are becomes a conversation of its own.
        session = gw.session(session_id)
        conv, parent = session.conversation_for(messages, gw.renderer, tools.tools)
        try:
            call = await prepare(gw, request, body, conv, "chat", parent, tools)
        except BaseException:
            session.release(parent)
            raise
        return await answer(gw, call)
    fresh = Conversation.start(messages, gw.renderer, tools.tools)
    return await answer(gw, await prepare(gw, request, body, fresh, "chat", None, tools))


@router.post(
    "/v1/completions",
    openapi_extra=request_body(COMPLETION_BODY),
    responses=TEXT_OK | errors(400, 401, 403, 404, 409, 429, 502, 503, 504),
)
async def completions(request: Request) -> Any:
    body = await json_body(request)
    gw = gateway_of(request)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    # JSON has one number type: 3.0 is the token id 3 (as JSON Schema reads it).
    ints = isinstance(prompt, list) and all(
        not isinstance(t, bool)
        and (isinstance(t, int) or (isinstance(t, float) and t.is_integer()))
        for t in prompt
    )
    if isinstance(prompt, list) and prompt and ints:
        vocab = gw.vocab_size
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise FieldError(
                    f"prompt[{i}]", f"token id {t} is not in the vocabulary [0, {vocab})"
                )
        ids = [int(t) for t in prompt]
        text = gw.tokenizer.decode(ids)
    elif isinstance(prompt, str) and prompt:
        text, ids = prompt, gw.renderer.encode(prompt)
    else:
        raise FieldError("prompt", "must be a non-empty string or a list of token ids")
    n = len(ids)
    conv = Conversation([], text, ids, [0.0] * n, [-1] * n, [False] * n, n)
    return await answer(gw, await prepare(gw, request, body, conv, "text"))
