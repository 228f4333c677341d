"""The gateway's parts without a server: chat rendering and tool calls token-exact, the
OpenAPI document, the example agent's calculator (tests/e2e/test_gateway.py drives the
served gateway)."""

from __future__ import annotations

from typing import Any

import pytest
from areal_clients.gateway import create_app
from areal_clients.gateway.chat import ChatRenderer, Conversation, normalize_messages
from areal_clients.gateway.state import MAX_N
from areal_clients.gateway.tools import (
    ToolSettings,
    assistant_message,
    parse_tool_calls,
    tool_settings,
)
from arealgrpc.v1 import common_pb2, rollout_pb2

from areal_grpc.errors import FieldError
from areal_grpc.model import load_tokenizer
from tests.support.gateway import (
    CHECK_TOOL,
    MODEL,
    gateway_run,
)
from tests.support.paths import ROOT


def test_a_tool_call_reply_is_parsed_and_its_next_turn_keeps_the_sampled_ids() -> None:
    """A reply holding a <tool_call> block comes back as tool_calls; when the client sends
    that message back with the tool's result, the conversation continues from the ids the
    model sampled, not from the template's rendering of the call."""
    renderer = ChatRenderer(load_tokenizer(MODEL))
    tools = [CHECK_TOOL]
    messages = normalize_messages([{"role": "user", "content": "2+2="}])
    conv = Conversation.start(messages, renderer, tools)
    assert conv.text.startswith("<|tools|>\n") and '"name": "check"' in conv.text
    # Spacing the template would not write: re-rendering the call would change the ids.
    text = 'sure <tool_call>{"name":"check",  "arguments":{"x":4}}</tool_call>'
    sampled = [b + 3 for b in text.encode()]  # the byte tokenizer's ids
    completion = rollout_pb2.Completion(
        output_ids=sampled,
        output_logprobs=[-0.1] * len(sampled),
        output_versions=[2] * len(sampled),
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
    )
    message, kept = assistant_message(text, "chatcmpl-1", ToolSettings(tools, parse=True))
    assert message["content"] == "sure"
    assert message["tool_calls"] == [
        {
            "id": "call_chatcmpl-1_0",
            "type": "function",
            "function": {"name": "check", "arguments": '{"x": 4}'},
        }
    ]
    conv.add_reply("chatcmpl-1", completion, text, kept)
    # What the openai package sends back: the message as it parsed it, extra fields and all.
    returned = {**message, "refusal": None, "function_call": None, "annotations": []}
    result = {"role": "tool", "tool_call_id": "call_chatcmpl-1_0", "content": "correct"}
    nxt = normalize_messages([*messages, returned, result])
    assert conv.continued_by(nxt, renderer, None) is None  # other tools: another conversation
    found = conv.continued_by(nxt, renderer, tools)
    assert found is not None
    ids, full = found
    conv.extend_prompt(nxt, ids, full)
    traj = conv.trajectory(1.0, "t", "g")
    trained = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert trained == sampled
    assert full.endswith("<|tool|>\ncorrect\n<|assistant|>\n")
    # tool_choice none leaves the block in the content; a malformed block is content too.
    plain, _ = assistant_message(text, "c", ToolSettings(tools, parse=False))
    assert plain == {"role": "assistant", "content": text}
    assert parse_tool_calls("<tool_call>{oops}</tool_call>") == (
        "<tool_call>{oops}</tool_call>",
        [],
    )


def test_tools_need_a_template_that_renders_them() -> None:
    tokenizer = load_tokenizer(MODEL)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(FieldError) as err:
        tool_settings({"tools": [CHECK_TOOL]}, ChatRenderer(tokenizer))
    assert err.value.field == "tools"


def test_sampled_ids_that_do_not_round_trip_stay_exact_in_the_next_turn() -> None:
    """A reply whose ids do not survive decode -> encode (a lone UTF-8 lead byte in the byte
    tokenizer) is continued with the sampled ids, not with a re-encoding of its text."""
    renderer = ChatRenderer(load_tokenizer(MODEL))
    messages = [{"role": "user", "content": "hi"}]
    conv = Conversation.start(messages, renderer)
    sampled = [0xC3 + 3, ord("a") + 3]  # byte 0xC3 then "a": not valid UTF-8
    completion = rollout_pb2.Completion(
        output_ids=sampled,
        output_logprobs=[-0.5, -0.25],
        output_versions=[3, 3],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
    )
    text = renderer.reply_text(sampled, stopped=False)
    assert renderer.encode(text) != sampled  # the text alone would not give them back
    conv.add_reply("c1", completion, text)
    nxt = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
    # History the client changed (another reply in its place) does not continue it.
    changed = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "ok"}]
    assert conv.continued_by(changed, renderer) is None
    found = conv.continued_by(nxt, renderer)
    assert found is not None
    new_ids, new_text = found
    assert new_text.startswith(conv.text)
    conv.extend_prompt(nxt, new_ids, new_text)
    traj = conv.trajectory(1.0, "t", "g")
    trained = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert trained == sampled
    assert list(traj.token_ids[conv.prompt_length : conv.prompt_length + 2]) == sampled
    assert list(traj.logprobs)[conv.prompt_length : conv.prompt_length + 2] == [-0.5, -0.25]
    # The rendered continuation ends with the opened reply of the next turn.
    assert renderer.text(nxt).endswith("<|assistant|>\n")


def _example_agent() -> Any:
    """``examples/gateway_agent.py`` as a module (it is a script, not a package)."""
    import importlib.util

    path = ROOT / "examples" / "gateway_agent.py"
    spec = importlib.util.spec_from_file_location("gateway_agent", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_agents_calculator_evaluates_arithmetic_only() -> None:
    """The example evaluates what a model wrote: numbers and + - * / only, anything else an
    error string (never evaluated). (Its episodes need a model with a longer context than
    the built-in ones: tests/system/realmodel/test_example_agent.py runs it on the real model.)"""
    agent = _example_agent()
    assert agent.calculate("347 + 589") == "936"
    assert agent.calculate("(2 + 3) * 4 - 1 / 2") == "19.5"
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 99999", "1 / 0", "1 +"):
        assert agent.calculate(bad).startswith("error:"), bad
    assert agent.answered("so it is 936.", 936) and not agent.answered("935", 936)


def test_the_openapi_document_describes_every_body_and_every_error_answer():
    """The routes read their bodies themselves; the document still says what they take and
    answers every error status with OpenAI's error object."""
    doc = create_app(gateway_run(), "127.0.0.1:1").openapi()
    paths = doc["paths"]

    def schema(path: str, method: str = "post") -> dict:
        return paths[path][method]["requestBody"]["content"]["application/json"]["schema"]

    chat = schema("/v1/chat/completions")
    assert chat["required"] == ["messages"]
    assert chat["properties"]["n"]["maximum"] == MAX_N
    assert schema("/v1/completions")["required"] == ["prompt"]
    assert {tuple(o["required"]) for o in schema("/rl/sessions/{session_id}/reward")["oneOf"]} == {
        ("reward",),
        ("rewards",),
    }
    assert not paths["/rl/sessions"]["post"]["requestBody"]["required"]
    for path, method, statuses in (
        ("/v1/chat/completions", "post", {"400", "401", "404", "409", "429", "503", "504"}),
        ("/v1/completions", "post", {"400", "401", "429", "503", "504"}),
        ("/rl/sessions", "post", {"400", "401", "429"}),
        ("/rl/sessions/{session_id}/reward", "post", {"400", "404", "409"}),
        ("/rl/sessions/{session_id}", "delete", {"401", "404"}),
    ):
        answers = paths[path][method]["responses"]
        assert statuses <= set(answers), (path, sorted(answers))
        for status in statuses:
            error = answers[status]["content"]["application/json"]["schema"]
            assert error["required"] == ["error"], (path, status)
