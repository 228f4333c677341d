"""Schemathesis hooks for the gateway's OpenAPI test (loaded by ``st`` through
``SCHEMATHESIS_HOOKS=tests.support.schemathesis_hooks``).

A completion whose prompt fills the model's context is refused with 400
``context_length_exceeded``: it is valid by the document, which cannot count a prompt's tokens.
Such bodies are left out of generation here, measured exactly as the gateway measures them
(its renderer and tokenizer for ``GATEWAY_TEST_MODEL``), so every other body still has to be
accepted. The gateway's 400 for them is asserted by the test itself.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import schemathesis
from areal_clients.gateway.chat import ChatRenderer, Conversation, normalize_messages
from areal_clients.gateway.state import model_context
from areal_clients.gateway.tools import tool_settings

from areal_grpc.errors import FieldError
from areal_grpc.model import load_tokenizer

MODEL_ENV = "GATEWAY_TEST_MODEL"


@functools.cache
def _renderer() -> tuple[ChatRenderer, int]:
    source = os.environ[MODEL_ENV]
    return ChatRenderer(load_tokenizer(source)), model_context(source)


def prompt_tokens(path: str, body: Any) -> int | None:
    """The prompt's length in tokens as the gateway counts it; None when the body is refused
    for another reason first (or is not a completion)."""
    if not isinstance(body, dict):
        return None
    renderer, _ = _renderer()
    try:
        if path == "/v1/chat/completions":
            messages = normalize_messages(body.get("messages"))
            tools = tool_settings(body, renderer)
            return len(Conversation.start(messages, renderer, tools.tools).token_ids)
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list):
                return len(prompt)
            if isinstance(prompt, str):
                return len(renderer.encode(prompt))
    except FieldError:
        return None
    except Exception:
        # The gateway would fail on it too: kept, for schemathesis to report the answer.
        return None
    return None


@schemathesis.hook
def filter_body(context: schemathesis.HookContext, body: Any) -> bool:
    """Keeps every body but a completion's whose prompt leaves no room in the context."""
    if context.operation is None:
        return True
    _, window = _renderer()
    tokens = prompt_tokens(context.operation.path, body)
    return tokens is None or not window or tokens < window
