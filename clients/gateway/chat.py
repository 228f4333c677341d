"""Chat messages to token ids, and conversations kept token-exact across turns.

An OpenAI-style client sends text and gets text back; the trainer needs the tokens the model
sampled. Re-encoding the returned text does not give them back in general (a tokenizer may
split the same text differently, or not round-trip it at all). So the gateway keeps, per
conversation, the exact ids it generated from and the ids it sampled, and when a later
request continues that conversation (its messages are the earlier ones plus the reply as the
gateway returned it, plus new turns) it appends only the ids of the new turns: the sampled
ids are never re-encoded.

Tool calls follow the same rule: a reply the gateway parsed into ``tool_calls`` is rendered,
when the conversation continues, as the text the model sampled, not as the template would
write the calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arealgrpc.v1 import common_pb2, rollout_pb2
from transformers import PreTrainedTokenizerBase

from areal_grpc.errors import FieldError

# For models without a chat template of their own (the built-in ones): one line per turn,
# role-tagged, the reply opened by "<|assistant|>\n"; tools, when given, as one JSON line
# first, and an assistant's tool calls as "<tool_call>{json}</tool_call>" after its content.
# Documented in the README.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>"
    # An expression: a newline right after a block tag would be trimmed (trim_blocks).
    "{% endfor %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise FieldError(f"{where}[{i}]", "only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise FieldError(f"{where}[{i}].text", "must be a string")
            parts.append(part["text"])
        return "".join(parts)
    raise FieldError(
        where, f"must be a string or a list of text parts, got {type(content).__name__}"
    )


def normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call as chat templates read it: arguments as an object, not a string."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise FieldError(where, "must be an object with a function")
    if call.get("type", "function") != "function":
        raise FieldError(f"{where}.type", f"must be function, got {call.get('type')!r}")
    fn = call["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise FieldError(f"{where}.function.name", "must be a non-empty string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        # OpenAI's form: a JSON object as a string, read as the object templates expect.
        # Anything else (a model's malformed call sent back) is rendered as the string it is,
        # as OpenAI takes any string here.
        try:
            decoded = json.loads(args) if args.strip() else {}
        except ValueError:
            decoded = args
        args = decoded if isinstance(decoded, Mapping) else args
    elif not isinstance(args, Mapping):
        raise FieldError(f"{where}.function.arguments", "must be a JSON object or a string")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise FieldError(f"{where}.id", "must be a string")
    if call.get("id"):
        out["id"] = call["id"]
    return out


def normalize_messages(raw: Any, where: str = "messages") -> list[dict[str, Any]]:
    """``raw`` checked and reduced to what the template reads: role, content, and an
    assistant's ``tool_calls`` or a tool result's ``tool_call_id``."""
    if not isinstance(raw, list) or not raw:
        raise FieldError(where, "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        here = f"{where}[{i}]"
        if not isinstance(m, Mapping):
            raise FieldError(here, "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise FieldError(f"{here}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        msg: dict[str, Any] = {
            "role": str(role),
            "content": message_text(m.get("content"), f"{here}.content"),
        }
        # Checked on every message (the OpenAPI document describes them so), used where a
        # template reads them: an assistant's calls, a tool result's call id.
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise FieldError(f"{here}.tool_calls", "must be a list")
        checked = [
            normalize_tool_call(c, f"{here}.tool_calls[{j}]") for j, c in enumerate(calls or [])
        ]
        if role == "assistant" and checked:
            msg["tool_calls"] = checked
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise FieldError(f"{here}.tool_call_id", "must be a string")
        if role == "tool" and call_id:
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


class ChatRenderer:
    """Renders messages with ``template``, else the model's chat template, else
    :data:`DEFAULT_CHAT_TEMPLATE`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = (
            template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        )

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders a ``tools`` list (else tools cannot reach the model)."""
        return "tools" in self.template

    def text(
        self,
        messages: Sequence[Mapping[str, Any]],
        generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The templated conversation, opening the assistant's reply by default."""
        return str(
            self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        )

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as it stands (the template wrote any special tokens itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def reply_text(self, output_ids: Sequence[int], stopped: bool) -> str:
        """What the client is shown of a completion: its text without the stop token."""
        ids = list(output_ids[:-1] if stopped and output_ids else output_ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def stop_text(self, token_id: int) -> str:
        """The text of a stop token as a template writes it (e.g. ``<|im_end|>``)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))


@dataclass(eq=False)
class Conversation:
    """One trajectory in the making: every token so far, and which of them were sampled."""

    # The messages as the client will send them back (the replies as the gateway gave them).
    messages: list[dict[str, Any]]
    # The templated text those messages stand for, up to the end of the last reply's text.
    text: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[bool]
    prompt_length: int
    # The completion ids (one per turn generated here), in order.
    completion_ids: list[str] = field(default_factory=list)
    # The last turn ended with a stop token (kept in token_ids, not in text).
    stopped: bool = False
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    # The tools the template renders (the same in every turn of one conversation).
    tools: list[dict[str, Any]] | None = None
    # Replies by message index, as sampled: rendered in place of the message the client got
    # back (whose tool calls the template would write its own way).
    sampled: dict[int, str] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        messages: list[dict[str, Any]],
        renderer: ChatRenderer,
        tools: list[dict[str, Any]] | None = None,
    ) -> Conversation:
        """A new conversation about to generate its first reply."""
        text = renderer.text(messages, tools=tools)
        ids = renderer.encode(text)
        n = len(ids)
        conv = cls(list(messages), text, ids, [0.0] * n, [-1] * n, [False] * n, n)
        conv.tools = tools
        return conv

    def continued_by(
        self,
        messages: list[dict[str, Any]],
        renderer: ChatRenderer,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], str] | None:
        """(the ids to append, the new text) when ``messages`` continues this conversation.

        It continues it when the tools are the same, its first messages are this
        conversation's and the templated text of all of them (each reply as sampled) extends
        this one's text: the new ids are then those of that extension only (less a stop token
        the last reply already ended with).
        """
        if tools != self.tools or len(messages) <= len(self.messages):
            return None
        if messages[: len(self.messages)] != self.messages:
            return None
        as_sampled = [
            {"role": "assistant", "content": self.sampled[i]} if i in self.sampled else m
            for i, m in enumerate(messages)
        ]
        full = renderer.text(as_sampled, tools=tools)
        if not full.startswith(self.text):
            return None
        tail = full[len(self.text) :]
        if self.stopped:
            stop = renderer.stop_text(self.token_ids[-1])
            if stop and tail.startswith(stop):
                tail = tail[len(stop) :]
        return renderer.encode(tail), full

    def extend_prompt(self, messages: list[dict[str, Any]], ids: list[int], text: str) -> None:
        """Appends the ids of new turns (not trained on) and takes ``messages`` as its own."""
        n = len(ids)
        self.token_ids += ids
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.loss_mask += [False] * n
        self.messages = list(messages)
        self.text = text

    def add_reply(
        self,
        completion_id: str,
        completion: rollout_pb2.Completion,
        reply: str,
        message: dict[str, Any] | None = None,
        stop_token: bool | None = None,
    ) -> None:
        """Appends a sampled reply (trained on; ``reply`` its text) and the assistant message
        the client got (``message``, normalized; default: ``reply`` as its content).
        ``stop_token``: whether the last id is a stop token (default: a STOP finish)."""
        ids = list(completion.output_ids)
        self.token_ids += ids
        self.logprobs += list(completion.output_logprobs)
        self.versions += list(completion.output_versions)
        self.loss_mask += [True] * len(ids)
        self.sampled[len(self.messages)] = reply
        self.messages.append(message or {"role": "assistant", "content": reply})
        self.text += reply
        self.completion_ids.append(completion_id)
        self.finish_reason = int(completion.finish_reason)
        self.stopped = (
            completion.finish_reason == common_pb2.FINISH_REASON_STOP
            if stop_token is None
            else stop_token
        )

    def branch(self) -> Conversation:
        """A copy that can take another reply to the same prompt (``n`` > 1)."""
        return Conversation(
            list(self.messages),
            self.text,
            list(self.token_ids),
            list(self.logprobs),
            list(self.versions),
            list(self.loss_mask),
            self.prompt_length,
            list(self.completion_ids),
            self.stopped,
            self.finish_reason,
            self.tools,
            dict(self.sampled),
        )

    def trajectory(self, reward: float, task_id: str, group_id: str) -> common_pb2.Trajectory:
        """The conversation as one trajectory: only sampled tokens carry loss."""
        return common_pb2.Trajectory(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            loss_mask=self.loss_mask,
            reward=float(reward),
            prompt_length=self.prompt_length,
            task_id=task_id,
            group_id=group_id,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
        )
