"""RL sessions: a coordinator lease, the conversations generated under it, and their rewards.

A session is one lease (``AcquireRollout``): its completions are generated at the lease's
rollout server, each conversation becomes one trajectory, and the reward call submits them as
the lease's trajectory group (``SubmitTrajectories``). A session ends with its reward, its
release, or its lease's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from arealgrpc.v1 import common_pb2, coordinator_pb2

from areal_grpc.errors import FieldError, PreconditionError

from .chat import ChatRenderer, Conversation


class SessionGone(PreconditionError):
    """The session's lease expired (or it ended): HTTP 409."""


@dataclass
class Session:
    """One lease and what was generated under it."""

    lease: coordinator_pb2.RolloutLease
    metadata: dict[str, Any] = field(default_factory=dict)
    conversations: list[Conversation] = field(default_factory=list)
    # Completion id -> the conversation it is the latest reply of, or was a reply of.
    by_completion: dict[str, Conversation] = field(default_factory=dict)
    # id() of conversations a request in flight continues.
    claimed: set[int] = field(default_factory=set)
    # The rollout server its completions go to: the lease's, until that one fails.
    address: str = ""

    def __post_init__(self) -> None:
        self.address = self.address or self.lease.rollout_address

    @property
    def session_id(self) -> str:
        """The lease id (so the lease's trace and the coordinator's logs name it too)."""
        return self.lease.lease_id

    @property
    def expires_at(self) -> float:
        """Wall-clock seconds when the lease runs out."""
        return self.lease.deadline.seconds + self.lease.deadline.nanos / 1e9

    def expired(self) -> bool:
        """Whether the lease's deadline has passed."""
        return time.time() >= self.expires_at

    def conversation_for(
        self,
        messages: list[dict[str, Any]],
        renderer: ChatRenderer,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[Conversation, Conversation | None]:
        """(the conversation to generate from, the session's conversation it continues).

        When ``messages`` continues one of the session's conversations, the first is a copy
        of it extended by the new turns; else a new conversation and None. Nothing in the
        session changes until :meth:`add`.
        """
        for conv in reversed(self.conversations):
            if id(conv) in self.claimed:
                continue
            found = conv.continued_by(messages, renderer, tools)
            if found is not None:
                ids, text = found
                longer = conv.branch()
                longer.extend_prompt(messages, ids, text)
                # Claimed until its request ends (:meth:`release`): a concurrent request with
                # the same messages (two choices with equal replies) continues the other one.
                self.claimed.add(id(conv))
                return longer, conv
        return Conversation.start(messages, renderer, tools), None

    def release(self, parent: Conversation | None) -> None:
        """Ends the claim :meth:`conversation_for` put on ``parent``."""
        if parent is not None:
            self.claimed.discard(id(parent))

    def add(self, conv: Conversation, replaces: Conversation | None = None) -> None:
        """Records a conversation that took a reply, in place of the one it continues."""
        if replaces is not None and replaces in self.conversations:
            self.conversations[self.conversations.index(replaces)] = conv
            for cid in conv.completion_ids[:-1]:
                self.by_completion[cid] = conv
        else:
            self.conversations.append(conv)
        self.by_completion[conv.completion_ids[-1]] = conv

    def group(self, body: Mapping[str, Any]) -> common_pb2.TrajectoryGroup:
        """The session's trajectory group with the rewards of a reward call's ``body``.

        ``{"reward": r}`` gives every conversation r; ``{"rewards": {completion id: r}}``
        gives each conversation the reward of its last completion.
        """
        if not self.conversations:
            raise FieldError("session", "has no completions to reward")
        single, per = body.get("reward"), body.get("rewards")
        if (single is None) == (per is None):
            raise FieldError("reward", "give exactly one of reward or rewards")
        rewards: list[float] = []
        if single is not None:
            rewards = [_number(single, "reward")] * len(self.conversations)
        else:
            if not isinstance(per, Mapping):
                raise FieldError("rewards", "must map completion ids to numbers")
            unknown = sorted(set(per) - set(self.by_completion))
            if unknown:
                raise FieldError(f"rewards.{unknown[0]}", "is not a completion of this session")
            for conv in self.conversations:
                last = conv.completion_ids[-1]
                if last not in per:
                    raise FieldError(
                        f"rewards.{last}",
                        "missing: every conversation's last completion needs a reward",
                    )
                rewards.append(_number(per[last], f"rewards.{last}"))
        group = common_pb2.TrajectoryGroup(task_id=self.session_id, group_id=self.session_id)
        for conv, r in zip(self.conversations, rewards, strict=True):
            group.trajectories.append(conv.trajectory(r, self.session_id, self.session_id))
        return group


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(where, f"must be a number, got {value!r}")
    out = float(value)
    if out != out or out in (float("inf"), float("-inf")):
        raise FieldError(where, f"must be finite, got {value!r}")
    return out


class SessionStore:
    """The open sessions, dropped when they end or expire."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def add(self, session: Session) -> None:
        """Opens a session."""
        self._sessions[session.session_id] = session

    def get(self, session_id: str) -> Session:
        """The open session; NOT_FOUND-style KeyError unknown, SessionGone when it expired."""
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(session_id)
        if session.expired():
            del self._sessions[session_id]
            raise SessionGone(f"session {session_id!r}: its lease expired")
        return session

    def pop(self, session_id: str) -> Session:
        """Ends a session (see :meth:`get` for the errors)."""
        session = self.get(session_id)
        del self._sessions[session_id]
        return session

    def __len__(self) -> int:
        return len(self._sessions)
