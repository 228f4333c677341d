"""What the gateway's OpenAPI document says of its request bodies and error answers.

The routes read their JSON bodies themselves (to answer in OpenAI's error shape, naming the
field), so FastAPI cannot derive the bodies: they are described here, with the constraints the
handlers check, and every route lists the error statuses it can answer with OpenAI's error
object.
"""

from __future__ import annotations

from typing import Any

from areal_grpc.sampling import MIN_TEMPERATURE, MIN_TOP_P

from .state import MAX_N, MAX_STOPS, UNSUPPORTED

__all__ = [
    "CHAT_BODY",
    "CHAT_OK",
    "COMPLETION_BODY",
    "MODELS_OK",
    "RELEASE_OK",
    "REWARD_BODY",
    "REWARD_OK",
    "SESSION_BODY",
    "SESSION_OK",
    "TEXT_OK",
    "errors",
    "request_body",
    "with_model_limits",
]

_USAGE: dict[str, Any] = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0}
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}


def _completion(obj: str, reply: dict[str, Any]) -> dict[str, Any]:
    """A completion object (``obj``) whose choices carry ``reply``'s properties."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {
                "type": "string",
                "description": "policy-v<the policy version that generated the replies>",
            },
            "choices": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", "finish_reason", "completion_id", *reply],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                        "completion_id": {
                            "type": "string",
                            "description": "What a reward names this reply by.",
                        },
                        "token_ids": {
                            "type": "array",
                            "items": {"type": "integer", "minimum": 0},
                            "description": "The sampled ids (with return_token_ids: true).",
                        },
                        **reply,
                    },
                },
            },
            "usage": _USAGE,
        },
    }


_CHAT_REPLY: dict[str, Any] = {
    "message": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"]},
            "tool_calls": {"type": "array", "items": {"type": "object"}},
        },
    },
    "logprobs": {
        "type": ["object", "null"],
        "properties": {"content": {"type": "array", "items": {"type": "object"}}},
    },
}
_TEXT_REPLY: dict[str, Any] = {"text": {"type": "string"}, "logprobs": {"type": "null"}}

# One server-sent event of a streamed completion: a chunk object as JSON, and "[DONE]" last.
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": 'A chunk (a JSON object), or "[DONE]" after the last one.',
        },
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _ok(description: str, schema: dict[str, Any], stream: bool = False) -> dict[int | str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if stream:
        # Open API 3.1 reads an event stream's schema as each event's (3.2's itemSchema).
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    return {200: {"description": description, "content": content}}


_STREAMED = "; with stream: true its chunks as server-sent events"
CHAT_OK = _ok("The chat completion" + _STREAMED, _completion("chat.completion", _CHAT_REPLY), True)
TEXT_OK = _ok("The completion" + _STREAMED, _completion("text_completion", _TEXT_REPLY), True)
MODELS_OK = _ok(
    "The served model (one policy).",
    {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by"],
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "model"},
                        "created": {"type": "integer"},
                        "owned_by": {"type": "string"},
                    },
                },
            },
        },
    },
)
SESSION_OK = _ok(
    "The session: one trajectory group, leased from the coordinator.",
    {
        "type": "object",
        "required": ["session_id", "policy_version", "expires_at", "lease_ttl_s", "group_size"],
        "properties": {
            "session_id": {"type": "string", "description": "Send it as X-Session-Id."},
            "policy_version": {"type": "integer", "minimum": 0},
            "expires_at": {"type": "number"},
            "lease_ttl_s": {"type": "number", "minimum": 0},
            "group_size": {"type": "integer", "minimum": 1},
        },
    },
)
REWARD_OK = _ok(
    "The group went to the coordinator (accepted, or rejected for `reason`); the session ended.",
    {
        "type": "object",
        "required": ["submitted", "accepted", "reason", "trajectories"],
        "properties": {
            "submitted": {"const": True},
            "accepted": {"type": "boolean"},
            "reason": {"type": "string"},
            "trajectories": {"type": "integer", "minimum": 1},
        },
    },
)
RELEASE_OK = _ok(
    "The session ended and its lease was freed.",
    {"type": "object", "required": ["released"], "properties": {"released": {"const": True}}},
)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_WHY = {
    400: "A field is missing or out of range (`param` names it), the body is not JSON, or "
    "the prompt leaves no room in the model's context (`code` context_length_exceeded).",
    401: "The bearer token is missing.",
    403: "The bearer token is wrong.",
    404: "No such session (ended, expired or never opened).",
    409: "The session expired (`code` session_expired), or the request conflicts with its "
    "state (a reward for completions it does not have, or before it has any).",
    429: "No capacity now; retry after the Retry-After header's seconds.",
    502: "A rollout server answered something the gateway cannot use.",
    503: "No rollout server or coordinator is reachable now.",
    504: "Generation did not finish within gateway.generate_timeout_s.",
}

_MAX_TOKENS = (
    "At most this many tokens are generated, and no more than the model's context leaves "
    "after the prompt (a reply cut there has finish_reason length); null: the gateway's "
    "max_tokens."
)

# OpenAI fields the gateway refuses unless empty.
_UNSUPPORTED: dict[str, Any] = {
    "description": "Not supported by this gateway yet: null or empty only.",
    "anyOf": [
        {"type": "null"},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
    ],
}

_SAMPLING: dict[str, Any] = {
    # Any name: the gateway serves one policy, whatever the request calls it.
    "model": {"type": ["string", "null"]},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N, "default": 1},
    "temperature": {
        "description": f"0 (greedy) or at least {MIN_TEMPERATURE}",
        "anyOf": [
            {"const": 0},
            {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": 2},
            {"type": "null"},
        ],
    },
    "top_p": {"type": ["number", "null"], "minimum": MIN_TOP_P, "maximum": 1},
    "max_tokens": {
        "type": ["integer", "null"],
        "minimum": 1,
        "maximum": 1 << 20,
        "description": _MAX_TOKENS,
    },
    "max_completion_tokens": {
        "type": ["integer", "null"],
        "minimum": 1,
        "maximum": 1 << 20,
        "description": _MAX_TOKENS,
    },
    "stop": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "maxItems": MAX_STOPS,
            },
            {"type": "null"},
        ]
    },
    "seed": {"type": ["integer", "null"], "description": "Any integer, taken modulo 2**64."},
    "logprobs": {"type": ["boolean", "null"]},
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "return_token_ids": {"type": ["boolean", "null"]},
    **{key: _UNSUPPORTED for key in UNSUPPORTED},
}

# top_logprobs > 0 needs logprobs: true.
_TOP_NEEDS_LOGPROBS: dict[str, Any] = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}

CHAT_BODY: dict[str, Any] = {
    **_TOP_NEEDS_LOGPROBS,
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "null"},
                            {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["type", "text"],
                                    "properties": {
                                        "type": {"const": "text"},
                                        "text": {"type": "string"},
                                    },
                                },
                            },
                        ]
                    },
                    "tool_calls": {
                        "type": ["array", "null"],
                        "items": {
                            "type": "object",
                            "required": ["function"],
                            "properties": {
                                "id": {"type": ["string", "null"]},
                                "type": {"const": "function"},
                                "function": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {
                                        "name": {"type": "string", "minLength": 1},
                                        "arguments": {
                                            "description": "A JSON object, or a string (a "
                                            "JSON object's text is read as the object)",
                                            "type": ["object", "string"],
                                        },
                                    },
                                },
                            },
                        },
                    },
                    "tool_call_id": {"type": ["string", "null"]},
                },
            },
        },
        "tools": {
            "type": ["array", "null"],
            "items": {
                "type": "object",
                "required": ["function"],
                "properties": {
                    "type": {"const": "function", "default": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "parameters": {"type": "object"},
                        },
                    },
                },
            },
        },
        "tool_choice": {
            "description": "Sampling is not constrained: auto (tool calls are parsed from the "
            "reply) or none.",
            "enum": ["auto", "none", None],
        },
        **_SAMPLING,
    },
}

COMPLETION_BODY: dict[str, Any] = {
    **_TOP_NEEDS_LOGPROBS,
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0},
                    "minItems": 1,
                    "description": "token ids of the served model's vocabulary",
                },
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": 1,
                },
            ]
        },
        **_SAMPLING,
    },
}

SESSION_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "group_size": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": 1 << 16,
            "default": 1,
        },
        "metadata": {"type": ["object", "null"]},
    },
}

REWARD_BODY: dict[str, Any] = {
    "type": "object",
    "description": "Exactly one of reward (every conversation) or rewards (by the completion "
    "id of each conversation's last completion).",
    "oneOf": [
        {"required": ["reward"], "properties": {"reward": {"type": "number"}}},
        {
            "required": ["rewards"],
            "properties": {
                "rewards": {"type": "object", "additionalProperties": {"type": "number"}}
            },
        },
    ],
}


def request_body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    """The ``openapi_extra`` that documents a route's JSON request body."""
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": schema}},
        }
    }


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses`` for ``statuses``, each with OpenAI's error object."""
    return {
        s: {"description": _WHY[s], "content": {"application/json": {"schema": _ERROR}}}
        for s in statuses
    }


def with_model_limits(doc: dict[str, Any], vocab_size: int, context: int) -> dict[str, Any]:
    """``doc`` (FastAPI's document of the app) with the served model's limits on a prompt of
    token ids: each id below ``vocab_size``, and fewer ids than ``context`` (0: not known),
    which must leave room for one generated token."""
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    ids = body["schema"]["properties"]["prompt"]["oneOf"][1]
    ids["items"]["maximum"] = vocab_size - 1
    if context:
        ids["maxItems"] = context - 1
    return doc
