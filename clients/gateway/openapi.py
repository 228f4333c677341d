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
    "COMPLETION_BODY",
    "COMPLETION_OK",
    "REWARD_BODY",
    "SESSION_BODY",
    "errors",
    "request_body",
    "with_model_limits",
]

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

# A completion's 200: a JSON object, or with "stream": true server-sent events of chunks.
COMPLETION_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion (application/json), or with stream: true its chunks as "
        "server-sent events (text/event-stream).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # Open API 3.1 reads an event stream's schema as each event's (3.2's itemSchema).
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    }
}

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
