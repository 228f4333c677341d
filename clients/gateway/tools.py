"""Tools in chat completions: the request's ``tools`` checked, and tool calls parsed out of a
reply.

The tools reach the model only through its chat template, so a template that does not render
``tools`` gets none (400 naming ``tools``). A reply calls tools when its text holds one or more
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the format of the
Hermes-style templates (Qwen2.5, SmolLM3, the built-in default); anything that does not parse
as such stays plain content. Sampling is not constrained, so ``tool_choice`` takes ``auto``
(the default) or ``none`` (the calls are left in the content, unparsed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from areal_grpc.errors import FieldError

from .chat import ChatRenderer, normalize_messages

__all__ = ["ToolSettings", "assistant_message", "parse_tool_calls", "tool_settings"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolSettings:
    """The request's tools (as the template reads them) and whether to parse calls."""

    def __init__(self, tools: list[dict[str, Any]] | None, parse: bool) -> None:
        self.tools = tools
        self.parse = parse


def tool_settings(body: Mapping[str, Any], renderer: ChatRenderer) -> ToolSettings:
    """``tools`` and ``tool_choice`` checked (FieldError naming the field)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw in (None, []):
        if choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "names a tool, but the request has no tools")
        return ToolSettings(None, False)
    if not isinstance(raw, list):
        raise FieldError("tools", "must be a list of function tools")
    if not renderer.takes_tools:
        raise FieldError("tools", "this model's chat template does not render tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise FieldError(f"{where}.type", "must be function")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise FieldError(f"{where}.function", "must be an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"{where}.function.name", "must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
            raise FieldError(f"{where}.function.parameters", "must be a JSON schema object")
        tools.append({"type": "function", "function": dict(fn)})
    if choice not in (None, "auto", "none"):
        raise FieldError(
            "tool_choice",
            "only auto and none are supported: the gateway does not constrain sampling",
        )
    return ToolSettings(tools, choice != "none")


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the call blocks, the calls as {"name", "arguments"}); no calls when
    any block is not a JSON object with a string name and object arguments."""
    calls = []
    for block in _CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        args = call.get("arguments", {})
        if not isinstance(args, dict):
            return text, []
        calls.append({"name": call["name"], "arguments": args})
    if not calls:
        return text, []
    return _CALL.sub("", text).strip(), calls


def assistant_message(
    text: str, completion_id: str, tools: ToolSettings
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the OpenAI message for a reply, that message as the conversation keeps it)."""
    content, calls = parse_tool_calls(text) if tools.parse else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content or None
        message["tool_calls"] = [
            {
                "id": f"call_{completion_id.replace(':', '_')}_{j}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for j, c in enumerate(calls)
        ]
    return message, normalize_messages([message])[0]
