"""What the gateway's OpenAPI document says of its request bodies and error answers.

The routes read their JSON bodies themselves (to answer in OpenAI's error shape, naming the
field), so FastAPI cannot derive the bodies: they are described here, with the constraints the
handlers check, and every route lists the error statuses it can answer with OpenAI's error
object.
"""

from __future__ import annotations

from typing import Any

from areal_grpc.sampling import MIN_TEMPERATURE, MIN_TOP_P

from .state import MAX_N, MAX_STOPS

__all__ = [
    "CHAT_BODY",
    "COMPLETION_BODY",
    "COMPLETION_OK",
    "REWARD_BODY",
    "SESSION_BODY",
    "errors",
    "request_body",
]

# A completion's 200: a JSON object, or with "stream": true server-sent events of chunks.
COMPLETION_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion (application/json), or with stream: true its chunks as "
        "server-sent events (text/event-stream).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
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
    400: "A field is missing or out of range (`param` names it), or the body is not JSON.",
    401: "The bearer token is missing or wrong.",
    404: "No such session (ended, expired or never opened).",
    409: "The session expired (`code` session_expired), or the request conflicts with its state.",
    429: "No capacity now; retry after the Retry-After header's seconds.",
    502: "A rollout server answered something the gateway cannot use.",
    503: "No rollout server or coordinator is reachable now.",
    504: "Generation did not finish within gateway.generate_timeout_s.",
}

_SAMPLING: dict[str, Any] = {
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "default": 1},
    "temperature": {
        "description": f"0 (greedy) or at least {MIN_TEMPERATURE}",
        "anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": 2}],
    },
    "top_p": {"type": "number", "minimum": MIN_TOP_P, "maximum": 1},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 1 << 20},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 1 << 20},
    "stop": {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOPS},
            {"type": "null"},
        ]
    },
    "seed": {"type": ["integer", "null"]},
    "logprobs": {"type": ["boolean", "null"]},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "return_token_ids": {"type": "boolean"},
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
        "model": {"type": "string"},
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
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["function"],
                            "properties": {
                                "id": {"type": "string"},
                                "type": {"const": "function"},
                                "function": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {"name": {"type": "string"}},
                                },
                            },
                        },
                    },
                    "tool_call_id": {"type": "string"},
                },
            },
        },
        "tools": {
            "type": ["array", "null"],
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string", "minLength": 1}},
                    },
                },
            },
        },
        "tool_choice": {"type": ["string", "object", "null"]},
        **_SAMPLING,
    },
}

COMPLETION_BODY: dict[str, Any] = {
    **_TOP_NEEDS_LOGPROBS,
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "model": {"type": "string"},
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
