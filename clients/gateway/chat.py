"""Chat messages to token ids, and conversations kept token-exact across turns.

An OpenAI-style client sends text and gets text back; the trainer needs the tokens the model
sampled. Re-encoding the returned text does not give them back in general (a tokenizer may
split the same text differently, or not round-trip it at all). So the gateway keeps, per
conversation, the exact ids it generated from and the ids it sampled, and when a later
request continues that conversation (its messages are the earlier ones plus the reply as the
gateway returned it, plus new turns) it appends only the ids of the new turns: the sampled
ids are never re-encoded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arealgrpc.v1 import common_pb2, rollout_pb2
from transformers import PreTrainedTokenizerBase

from areal_grpc.errors import FieldError

# For models without a chat template of their own (the built-in ones): one line per turn,
# role-tagged, the reply opened by "<|assistant|>\n". Documented in the README.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
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
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise FieldError(
        where, f"must be a string or a list of text parts, got {type(content).__name__}"
    )


def normalize_messages(raw: Any, where: str = "messages") -> list[dict[str, str]]:
    """``raw`` checked and reduced to ``[{"role", "content"}]`` (what the template reads)."""
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
        out.append(
            {"role": str(role), "content": message_text(m.get("content"), f"{here}.content")}
        )
    return out


class ChatRenderer:
    """Renders messages with the model's chat template (or :data:`DEFAULT_CHAT_TEMPLATE`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE

    def text(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool = True) -> str:
        """The templated conversation, opening the assistant's reply by default."""
        return str(
            self.tokenizer.apply_chat_template(
                list(messages),
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
    messages: list[dict[str, str]]
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

    @classmethod
    def start(cls, messages: list[dict[str, str]], renderer: ChatRenderer) -> Conversation:
        """A new conversation about to generate its first reply."""
        text = renderer.text(messages)
        ids = renderer.encode(text)
        n = len(ids)
        return cls(list(messages), text, ids, [0.0] * n, [-1] * n, [False] * n, n)

    def continued_by(
        self, messages: list[dict[str, str]], renderer: ChatRenderer
    ) -> list[int] | None:
        """The ids to append when ``messages`` continues this conversation, else None.

        It continues it when its first messages are this conversation's and the templated
        text of all of them extends this one's text: the new ids are then those of that
        extension only (less a stop token the last reply already ended with).
        """
        if len(messages) <= len(self.messages) or messages[: len(self.messages)] != self.messages:
            return None
        full = renderer.text(messages)
        if not full.startswith(self.text):
            return None
        tail = full[len(self.text) :]
        if self.stopped:
            stop = renderer.stop_text(self.token_ids[-1])
            if stop and tail.startswith(stop):
                tail = tail[len(stop) :]
        return renderer.encode(tail)

    def extend_prompt(self, messages: list[dict[str, str]], ids: list[int], text: str) -> None:
        """Appends the ids of new turns (not trained on) and takes ``messages`` as its own."""
        n = len(ids)
        self.token_ids += ids
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.loss_mask += [False] * n
        self.messages = list(messages)
        self.text = text

    def add_reply(self, completion_id: str, completion: rollout_pb2.Completion, reply: str) -> None:
        """Appends a sampled reply (trained on) and the assistant message the client sees."""
        ids = list(completion.output_ids)
        self.token_ids += ids
        self.logprobs += list(completion.output_logprobs)
        self.versions += list(completion.output_versions)
        self.loss_mask += [True] * len(ids)
        self.messages.append({"role": "assistant", "content": reply})
        self.text += reply
        self.completion_ids.append(completion_id)
        self.finish_reason = int(completion.finish_reason)
        self.stopped = completion.finish_reason == common_pb2.FINISH_REASON_STOP

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
