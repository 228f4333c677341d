"""The OpenAI-compatible gateway, driven by the official ``openai`` package.

Real parts on loopback: a rollout server process (builtin:micro), an in-process
CoordinatorService over a WorkPool with that server registered, and the gateway app served by
uvicorn. The tests check what an agent written against ``openai`` sees, and that what reaches
the coordinator's buffer is token-exact: the trained tokens are the sampled ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.pool import ThreadPool
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from areal_clients.gateway.chat import ChatRenderer, normalize_messages
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from areal_grpc import tracing
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from areal_grpc.model import load_tokenizer
from tests.support.gateway import (
    CHECK_TOOL,
    MODEL,
    Gateway,
    ServedCoordinator,
    client,
    gateway_run,
    rollout_process,
    serve_gateway,
    start_mesh,
)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    with rollout_process(tmp_path_factory.mktemp("rollout-logs")) as child:
        yield child


@pytest.fixture(scope="module")
def mesh(rollout: Child) -> Iterator[ServedCoordinator]:
    # Room for every session the module's tests take (nothing trains, so none is freed).
    m = start_mesh(rollout.address, batch=64)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def gateway(mesh: ServedCoordinator) -> Iterator[Gateway]:
    gw = serve_gateway(gateway_run(max_tokens=8), mesh.address)
    yield gw
    gw.stop()


def async_client(gw: Gateway, session_id: str) -> openai.AsyncOpenAI:
    """An async client whose requests belong to ``session_id``."""
    return openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Session-Id": session_id},
    )


def session(gw: Gateway, **body: object) -> str:
    reply = httpx.post(f"{gw.url}/rl/sessions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["session_id"])


def test_chat_completions_through_the_openai_client(gateway: Gateway) -> None:
    c = client(gateway)
    assert [m.id for m in c.models.list().data] == [MODEL]
    reply = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "2+2="}],
        max_tokens=6,
        temperature=1.0,
        n=3,
        logprobs=True,
    )
    assert [ch.index for ch in reply.choices] == [0, 1, 2]
    total = 0
    for ch in reply.choices:
        assert ch.message.role == "assistant" and isinstance(ch.message.content, str)
        assert ch.finish_reason in ("stop", "length")
        tokens = ch.logprobs.content
        assert 1 <= len(tokens) <= 6 and all(t.logprob <= 0.0 for t in tokens)
        total += len(tokens)
    renderer = ChatRenderer(load_tokenizer(MODEL))
    prompt = renderer.encode(renderer.text([{"role": "user", "content": "2+2="}]))
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == total
    assert reply.system_fingerprint == "policy-v0"
    # Text completions too.
    text = c.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    assert len(text.choices) == 1 and text.choices[0].finish_reason in ("stop", "length")


def test_a_multi_turn_session_trains_exactly_the_sampled_tokens(
    gateway: Gateway, mesh: ServedCoordinator
):
    """Two turns continuing each other become one trajectory whose loss covers exactly the
    ids the model sampled, in order; a conversation with rewritten history is a second one."""

    async def agent() -> tuple[str, list[list[int]], list[int]]:
        sid = session(gateway, group_size=2)
        c = async_client(gateway, sid)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
        ]
        sampled: list[list[int]] = []
        for turn in ("and again", "once more"):
            r = await c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=5, extra_body={"return_token_ids": True}
            )
            sampled.append(r.choices[0].token_ids)  # type: ignore[attr-defined]
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": turn},
            ]
        # A rewritten history (the first reply replaced): a conversation of its own.
        rewritten = [*messages[:2], {"role": "assistant", "content": "something else"}]
        other = await c.chat.completions.create(
            model=MODEL,
            messages=[*rewritten, {"role": "user", "content": "?"}],
            max_tokens=3,
            extra_body={"return_token_ids": True},
        )
        await c.close()
        return sid, sampled, other.choices[0].token_ids  # type: ignore[attr-defined]

    sid, sampled, other = asyncio.run(agent())
    reply = httpx.post(f"{gateway.url}/rl/sessions/{sid}/reward", json={"reward": 1.0}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"submitted": True, "accepted": True, "reason": "", "trajectories": 2}
    (group,) = [g for task, g in mesh.groups() if task == sid]
    first, second = group.trajectories
    for traj, turns in ((first, sampled), (second, [other])):
        trained = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
        assert trained == [t for turn in turns for t in turn]
        # Each turn's tokens sit in one run, with their log-probs and version 0.
        assert all(v == 0 for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m)
        assert all(v == -1 for v, m in zip(traj.versions, traj.loss_mask, strict=True) if not m)
        assert traj.reward == 1.0 and traj.task_id == sid
    renderer = ChatRenderer(load_tokenizer(MODEL))
    opening = renderer.encode(
        renderer.text(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        )
    )
    assert list(first.token_ids[: first.prompt_length]) == opening
    assert list(first.token_ids[len(opening) : len(opening) + len(sampled[0])]) == sampled[0]


def test_a_stop_string_of_several_tokens_cuts_the_reply_and_keeps_the_sampled_ids(
    gateway: Gateway, mesh: ServedCoordinator
) -> None:
    """A stop sequence longer than one token is watched for in the decoded text: the reply
    ends before it (finish_reason stop), streamed or not; the trajectory keeps the ids up to
    the token that completed it, and the next turn continues the conversation."""
    c = client(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    # Seeded: the same reply every time; a stop string taken from its middle.
    same = {"max_tokens": 40, "temperature": 1.0, "seed": 5}
    full = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        extra_body={"return_token_ids": True},
        **same,  # type: ignore[arg-type]
    )
    text = str(full.choices[0].message.content)
    sampled = full.choices[0].model_extra["token_ids"]  # type: ignore[index]
    k = next(
        i
        for i in range(3, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text[i : i + 2].strip()
    )
    stop = text[k : k + 2]
    at = text.index(stop)
    renderer = ChatRenderer(load_tokenizer(MODEL))
    keep = next(
        n
        for n in range(1, len(sampled) + 1)
        if len(renderer.reply_text(sampled[:n], False)) >= at + 2
    )
    sid = session(gateway)
    c_sid = client(gateway, default_headers={"X-Session-Id": sid})
    cut = c_sid.chat.completions.create(
        model=MODEL,
        messages=messages,
        stop=[stop, "zzzz"],
        **same,  # type: ignore[arg-type]
    )
    assert cut.choices[0].message.content == text[:at]
    assert cut.choices[0].finish_reason == "stop"
    streamed = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        stop=stop,
        stream=True,
        **same,  # type: ignore[arg-type]
    )
    pieces = [ch.choices[0].delta.content or "" for ch in streamed if ch.choices]
    assert "".join(pieces) == text[:at]
    # The next turn continues the conversation: one trajectory, trained ids = sampled ids.
    nxt = [
        *messages,
        {"role": "assistant", "content": text[:at]},
        {"role": "user", "content": "ok"},
    ]
    c_sid.chat.completions.create(model=MODEL, messages=nxt, max_tokens=3)  # type: ignore[arg-type]
    reply = httpx.post(f"{gateway.url}/rl/sessions/{sid}/reward", json={"reward": 1.0}, timeout=30)
    assert reply.json()["accepted"] is True, reply.text
    (group,) = [g for task, g in mesh.groups() if task == sid]
    (traj,) = group.trajectories
    p = len(renderer.encode(renderer.text(messages)))
    assert list(traj.token_ids[p : p + keep]) == sampled[:keep]
    assert all(traj.loss_mask[p : p + keep]) and not traj.loss_mask[p + keep]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=messages, stop=["a", "b", "c", "d", "e"])  # type: ignore[arg-type]
    assert err.value.body["param"] == "stop"  # type: ignore[index]


def test_top_logprobs_list_the_alternatives_of_each_token(gateway: Gateway) -> None:
    reply = client(gateway).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "2+2="}],
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    tokens = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert tokens and all(len(t.top_logprobs) == 2 for t in tokens)
    for t in tokens:  # greedy: the sampled token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_a_seed_repeats_a_sampled_reply(gateway: Gateway) -> None:
    c = client(gateway)

    def ask(seed: int) -> list[str]:
        reply = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "2+2="}],
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=seed,
        )
        return [str(ch.message.content) for ch in reply.choices]

    first = ask(11)
    assert ask(11) == first and ask(12) != first
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            seed="x",  # type: ignore[arg-type]
        )
    assert err.value.body["param"] == "seed"  # type: ignore[index]


def test_tools_reach_the_prompt_and_a_tool_call_history_is_accepted(gateway: Gateway) -> None:
    c = client(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2="}]
    reply = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[CHECK_TOOL],
        max_tokens=4,  # type: ignore[list-item]
    )
    renderer = ChatRenderer(load_tokenizer(MODEL))
    with_tools = renderer.encode(renderer.text(messages, tools=[CHECK_TOOL]))
    assert (
        reply.usage.prompt_tokens == len(with_tools) > len(renderer.encode(renderer.text(messages)))
    )
    # A history with an assistant's tool call and the tool's result renders and generates.
    history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "check", "arguments": '{"x": 4}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "correct"},
    ]
    again = c.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[CHECK_TOOL],
        max_tokens=4,  # type: ignore[arg-type, list-item]
    )
    rendered = renderer.text(normalize_messages(history), tools=[CHECK_TOOL])
    assert '<tool_call>{"name": "check", "arguments": {"x": 4}}</tool_call>' in rendered
    assert again.usage.prompt_tokens == len(renderer.encode(rendered))


def test_bad_requests_are_400_naming_the_field(gateway: Gateway) -> None:
    c = client(gateway)
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}, "stop[1]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]},
            "tools[0].function.name",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [CHECK_TOOL],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "check"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "a", "content": "y"},
                ],
                "tools": [{**CHECK_TOOL, "function": {"name": "c", "parameters": "nope"}}],
            },
            "tools[0].function.parameters",
        ),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=MODEL, **body)  # type: ignore[arg-type]
        assert err.value.status_code == 400
        assert err.value.body["param"] == param, body  # type: ignore[index]
    # A session id the gateway never gave: 404; the gateway still serves afterwards.
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Session-Id": "nope"},
        )
    reward = httpx.post(f"{gateway.url}/rl/sessions/nope/reward", json={"reward": 1}, timeout=10)
    assert reward.status_code == 404
    assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    # Found by schemathesis against a live gateway: a token id outside the vocabulary was a
    # 500 (the tokenizer raised); a tiny top_p reached the engine as 0; booleans were truthy.
    text_cases = [
        ({"prompt": [5, 10**12]}, "prompt[1]"),
        ({"prompt": "hi", "top_p": 5e-324}, "top_p"),
        ({"prompt": "hi", "temperature": 1e-9}, "temperature"),
        ({"prompt": "hi", "return_token_ids": {}}, "return_token_ids"),
        ({"prompt": "hi", "stream_options": "yes"}, "stream_options"),
    ]
    for body, param in text_cases:
        answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["param"] == param, body
    # One token id is a prompt too (a one-element list was taken for a list of strings).
    one = httpx.post(
        f"{gateway.url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=60
    )
    assert one.status_code == 200, one.text


def test_rewards_per_completion_and_a_released_session(
    gateway: Gateway, mesh: ServedCoordinator
) -> None:
    sid = session(gateway)
    c = client(gateway, default_headers={"X-Session-Id": sid})
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], n=2)
    ids = [ch.completion_id for ch in r.choices]  # type: ignore[attr-defined]
    assert ids == [f"{r.id}:0", f"{r.id}:1"]
    bad = httpx.post(
        f"{gateway.url}/rl/sessions/{sid}/reward", json={"rewards": {ids[0]: 1.0}}, timeout=10
    )
    # Well-formed, but not the session's completions: a conflict with its state.
    assert bad.status_code == 409 and bad.json()["error"]["param"] == f"rewards.{ids[1]}"
    ok = httpx.post(
        f"{gateway.url}/rl/sessions/{sid}/reward",
        json={"rewards": {ids[0]: 1.0, ids[1]: 0.0}},
        timeout=10,
    )
    assert ok.status_code == 200 and ok.json()["accepted"] is True
    (group,) = [g for task, g in mesh.groups() if task == sid]
    assert [t.reward for t in group.trajectories] == [1.0, 0.0]
    # The session ended with its reward; a released one is gone too and its lease freed.
    assert (
        httpx.post(f"{gateway.url}/rl/sessions/{sid}/reward", json={"reward": 1}).status_code == 404
    )
    other = session(gateway)
    assert httpx.delete(f"{gateway.url}/rl/sessions/{other}", timeout=10).status_code == 200
    assert httpx.delete(f"{gateway.url}/rl/sessions/{other}", timeout=10).status_code == 404


def test_a_rollout_server_killed_mid_stream_fails_that_request_and_the_session_retries(
    tmp_path: Path,
) -> None:
    """SIGKILL of a session's rollout server while its reply streams: the stream ends with an
    error event naming the server (the openai client raises); the session's retry goes to
    another serving server and its group is accepted; with no server left, completions are
    503 in OpenAI's error shape, and the gateway itself keeps serving."""
    argv = python_module_argv("areal_servers.rollout", "--port", "0", f"model.source={MODEL}")
    doomed = start_child("rollout-doomed", argv, log_dir=tmp_path)
    spare = start_child("rollout-spare", argv, log_dir=tmp_path)
    m = start_mesh(doomed.address)
    gw = serve_gateway(gateway_run(max_tokens=8), m.address)
    try:
        sid = session(gw)  # leased while the doomed server is the only one
        m.register_rollout(spare.address, worker_id="rollout-1")
        c = client(gw, default_headers={"X-Session-Id": sid})
        messages = [{"role": "user", "content": "a="}]
        # Greedy on the built-in model runs to max_tokens (about 0.5 s for 400 tokens).
        stream = c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=400, temperature=0.0, stream=True
        )  # type: ignore[call-overload]
        chunks = iter(stream)
        next(chunks)  # the opening chunk: the reply is being generated
        doomed.process.kill()
        doomed.process.wait(timeout=30)
        with pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
        assert f"rollout server {doomed.address}" in str(err.value)
        # The session retries: the other server answers, and the session's group is whole.
        again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        assert again.choices[0].message.role == "assistant"
        reply = httpx.post(f"{gw.url}/rl/sessions/{sid}/reward", json={"reward": 1.0}, timeout=30)
        assert reply.json()["accepted"] is True, reply.text
        stop_children([spare])
        with pytest.raises(openai.APIStatusError) as later:
            client(gw).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        assert later.value.status_code == 503
        assert "rollout server" in later.value.body["message"]  # type: ignore[index]
        assert [x.id for x in c.models.list().data] == [MODEL]
    finally:
        gw.stop()
        m.stop()
        stop_children([doomed, spare])


def test_a_slow_agent_keeps_its_session_and_an_abandoned_one_expires_with_a_409(
    tmp_path: Path,
) -> None:
    """Lease time 2 s. An agent that spends 3 lease times on one session (turns a little
    under a lease time apart, and one completion held up for 1.5 lease times by a stopped
    rollout server) keeps it: the gateway renews the lease while the session works, and its
    group is accepted. A session left alone for longer than the lease time expires: every
    later request of it is 409 ``session_expired`` saying what happened and what to do (the
    openai client raises ConflictError), and its lease's capacity is free again."""
    ttl = 2.0
    argv = python_module_argv("areal_servers.rollout", "--port", "0", f"model.source={MODEL}")
    server = start_child("rollout-slow", argv, log_dir=tmp_path)
    m = start_mesh(server.address, batch=2, lease_ttl_s=ttl)
    gw = serve_gateway(gateway_run(max_tokens=4), m.address)
    try:
        opened = httpx.post(f"{gw.url}/rl/sessions", json={"group_size": 2}, timeout=30).json()
        sid = opened["session_id"]
        assert opened["lease_ttl_s"] == pytest.approx(ttl, abs=0.5)
        c = client(gw, default_headers={"X-Session-Id": sid})
        started = time.monotonic()
        messages: list[Any] = [{"role": "user", "content": "a"}]
        for turn in range(4):
            reply = c.chat.completions.create(model=MODEL, messages=messages, n=2 - min(turn, 1))
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "b"},
            ]
            time.sleep(0.5 * ttl)  # the agent thinks (its tool runs) between turns
        # The rollout server stalls mid-session: the completion stays in flight for 1.5
        # lease times, and the heartbeat keeps the lease alive meanwhile.
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            pending = ThreadPool(1).apply_async(
                c.chat.completions.create, (), {"model": MODEL, "messages": messages}
            )
            time.sleep(1.5 * ttl)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        last = pending.get(timeout=60)
        assert time.monotonic() - started > 3 * ttl
        reward = httpx.post(f"{gw.url}/rl/sessions/{sid}/reward", json={"reward": 1}, timeout=30)
        assert reward.status_code == 200 and reward.json()["accepted"] is True, reward.text
        (group,) = [g for task, g in m.groups() if task == sid]
        assert len(group.trajectories) == 2 and last.choices[0].message is not None

        # Abandoned: nothing runs for longer than the lease time.
        idle = session(gw, group_size=2)
        idle_client = client(gw, default_headers={"X-Session-Id": idle})
        idle_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a"}]
        )
        time.sleep(ttl + 1.0)
        for _ in range(2):  # told why every time, not "unknown session" the second time
            with pytest.raises(openai.ConflictError) as err:
                idle_client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "a"}]
                )
            body = err.value.body
            assert isinstance(body, dict) and body["code"] == "session_expired"
            message = str(body["message"])
            assert "expired" in message and "staleness.lease_ttl_s" in message
            assert "POST /rl/sessions" in message
        late = httpx.post(f"{gw.url}/rl/sessions/{idle}/reward", json={"reward": 1}, timeout=30)
        assert late.status_code == 409 and late.json()["error"]["code"] == "session_expired"

        async def leased() -> list[str]:
            m.pool.expire_leases()
            return list(m.pool.leases)

        assert idle not in m.server.call(leased())
        # Its slot went back: the step's second session can be taken.
        session(gw, group_size=2)
    finally:
        gw.stop()
        m.stop()
        stop_children([server])


def test_bearer_auth_when_an_api_key_is_set(mesh: ServedCoordinator) -> None:
    gw = serve_gateway(gateway_run(), mesh.address, api_key="s3cret")
    try:
        assert httpx.get(f"{gw.url}/v1/models", timeout=10).status_code == 401
        with pytest.raises(openai.PermissionDeniedError):
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in ok.models.list().data] == [MODEL]
    finally:
        gw.stop()


def test_streamed_replies_arrive_as_chunks_and_continue_their_conversation(
    gateway: Gateway, mesh: ServedCoordinator
) -> None:
    """stream=true: OpenAI chunks per choice, usage at the end; the text the client pieced
    together continues the conversation token-exact (one trajectory, all sampled ids)."""
    sid = session(gateway)
    c = client(gateway, default_headers={"X-Session-Id": sid})
    messages: list[dict[str, str]] = [{"role": "user", "content": "count"}]
    completion_tokens = 0
    for turn in range(2):
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        n = 2 if turn == 0 else 1
        for chunk in c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            n=n,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.usage is not None:
                completion_tokens += chunk.usage.completion_tokens if turn == 1 else 0
                continue
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
        assert sorted(texts) == list(range(n)) and set(finishes.values()) <= {"stop", "length"}
        # Continue with choice 0, as the client saw it.
        messages += [
            {"role": "assistant", "content": texts[0]},
            {"role": "user", "content": "more"},
        ]
    reply = httpx.post(f"{gateway.url}/rl/sessions/{sid}/reward", json={"reward": 0.5}, timeout=30)
    assert reply.status_code == 200 and reply.json()["trajectories"] == 2, reply.text
    (group,) = [g for task, g in mesh.groups() if task == sid]
    continued, other = group.trajectories
    # The continued conversation holds both turns' sampled tokens; the other only its first.
    trained = sum(continued.loss_mask)
    assert trained > sum(other.loss_mask) >= 1
    assert completion_tokens >= 1 and trained >= completion_tokens


def test_a_run_trains_on_gateway_sessions_alone_and_restarts_a_killed_gateway(
    tmp_path: Path, coordinator_command
) -> None:
    """``data.task=external gateway.enabled=true``: the run prints GATEWAY beside COORDINATOR,
    has no prompts of its own, and each step trains exactly the sessions an agent sent through
    the gateway. A gateway killed with SIGKILL between steps is restarted at the same URL (a
    session of the dead one is 404 there); the gateway stops with the run."""
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out,
        *coordinator_command.SMALL_RUN,
        "data.task=external",
        "total_steps=2",
        "gateway.enabled=true",
    )
    coordinator_command.address(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and not line.startswith("GATEWAY"):  # log lines share the output
        line = proc.stdout.readline()
    assert line.startswith("GATEWAY http://127.0.0.1:") and line.rstrip().endswith("/v1"), line
    base = line.split()[1].removesuffix("/v1")
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    drain.start()

    def one_step() -> list[str]:
        sessions = []
        for _ in range(2):  # staleness.batch_size=2: one step's worth
            sid = new_session(base)
            c = openai.OpenAI(
                base_url=f"{base}/v1",
                api_key="x",
                max_retries=0,
                default_headers={"X-Session-Id": sid},
            )
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a="}], n=2
            )
            reply = httpx.post(f"{base}/rl/sessions/{sid}/reward", json={"reward": 1.0}, timeout=30)
            assert reply.json()["accepted"] is True, reply.text
            sessions.append(sid)
        return sessions

    sessions = one_step()
    orphan = new_session(base)
    (gw,) = [
        c for c in json.loads((out / "mesh.json").read_text())["children"] if c["name"] == "gateway"
    ]
    os.kill(gw["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not any(r.startswith("gateway exited") for r in rest):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(rest)
        time.sleep(0.2)
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 200
    lost = httpx.post(f"{base}/rl/sessions/{orphan}/reward", json={"reward": 1.0}, timeout=30)
    assert lost.status_code == 404, lost.text
    sessions += one_step()
    assert proc.wait(timeout=120) == 0, "".join(rest)
    drain.join(timeout=10)
    trained = [g["task_id"] for b in read_jsonl(out / "batches.jsonl") for g in b["groups"]]
    assert sorted(trained) == sorted(sessions)
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/v1/models", timeout=5)


def new_session(base: str) -> str:
    """A session id from ``POST /rl/sessions`` (group size 2)."""
    reply = httpx.post(f"{base}/rl/sessions", json={"group_size": 2}, timeout=30)
    return str(reply.json()["session_id"])


def test_concurrent_turns_with_equal_replies_continue_different_conversations(
    gateway: Gateway, mesh: ServedCoordinator
) -> None:
    """n=3 greedy replies are equal; three concurrent second turns with the same messages
    each continue one of the three conversations (none is left at its first turn)."""

    async def agent() -> str:
        sid = session(gateway, group_size=3)
        c = async_client(gateway, sid)
        q = {"role": "user", "content": "k="}
        first = await c.chat.completions.create(
            model=MODEL, messages=[q], n=3, max_tokens=2, temperature=0.0
        )
        replies = {ch.message.content for ch in first.choices}
        assert len(replies) == 1  # greedy: all equal
        turn = [q, {"role": "assistant", "content": replies.pop() or ""}, q]
        seconds = await asyncio.gather(
            *(c.chat.completions.create(model=MODEL, messages=turn, max_tokens=2) for _ in range(3))
        )
        rewards = {r.choices[0].completion_id: 1.0 for r in seconds}  # type: ignore[attr-defined]
        reply = httpx.post(f"{gateway.url}/rl/sessions/{sid}/reward", json={"rewards": rewards})
        assert reply.status_code == 200, reply.text
        assert reply.json()["trajectories"] == 3
        await c.close()
        return sid

    sid = asyncio.run(agent())
    (group,) = [g for task, g in mesh.groups() if task == sid]
    # Every trajectory holds two sampled turns: two runs of loss-masked tokens.
    for t in group.trajectories:
        mask = list(t.loss_mask)
        runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert runs == 2, mask


def test_a_sessions_completions_join_its_lease_trace(
    gateway: Gateway, mesh: ServedCoordinator
) -> None:
    """Each completion of a session is a ``gateway.completion`` span, a child of the
    coordinator's lease span, so generation and submission are one trace with the lease."""
    spans = InMemorySpanExporter()
    tracing.init_tracing("areal-test", SimpleSpanProcessor(spans))
    try:
        sid = session(gateway)
        c = client(gateway, default_headers={"X-Session-Id": sid})
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t"}])
        list(
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "u"}], stream=True
            )
        )
        reply = httpx.post(f"{gateway.url}/rl/sessions/{sid}/reward", json={"reward": 1.0})
        assert reply.json()["accepted"] is True
    finally:
        tracing.shutdown_tracing()
    finished = spans.get_finished_spans()
    (lease,) = [
        s
        for s in finished
        if s.name == "coordinator.lease" and s.attributes[tracing.TASK_ID] == sid
    ]
    completions = [s for s in finished if s.name == "gateway.completion"]
    assert len(completions) == 2
    for s in completions:
        assert s.attributes[tracing.TASK_ID] == sid
        assert s.context.trace_id == lease.context.trace_id
        assert s.parent is not None and s.parent.span_id == lease.context.span_id
