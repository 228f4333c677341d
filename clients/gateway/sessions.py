"""RL sessions: a coordinator lease, the conversations generated under it, and their rewards.

A session is one lease (``AcquireRollout``): its completions are generated at the lease's
rollout server, each conversation becomes one trajectory, and the reward call submits them as
the lease's trajectory group (``SubmitTrajectories``). A session ends with its reward, its
release, or its lease's deadline. The gateway renews the lease (``RenewRollout``) while the
session works: when a completion starts or ends, and now and then while one is in flight, so
a slow agent keeps its session, and an abandoned one expires one lease time after its last
completion.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
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
    # The lease's deadline (wall-clock seconds), moved on by each renewal.
    deadline: float = 0.0
    # The run's lease time, as the first deadline showed it (renewals give this much again).
    ttl_s: float = 0.0
    # Completion requests of the session in flight, and when one last started or ended.
    busy: int = 0
    active_at: float = field(default_factory=time.monotonic)
    # The renewal in flight, shared by whoever wants the lease renewed meanwhile.
    renewal: asyncio.Future[None] | None = None
    # Set when the coordinator no longer holds the lease (a renewal found it expired).
    lost: bool = False

    def __post_init__(self) -> None:
        self.address = self.address or self.lease.rollout_address
        d = self.lease.deadline
        self.deadline = self.deadline or d.seconds + d.nanos / 1e9
        self.ttl_s = self.ttl_s or max(self.deadline - time.time(), 0.0)

    @property
    def session_id(self) -> str:
        """The lease id (so the lease's trace and the coordinator's logs name it too)."""
        return self.lease.lease_id

    @property
    def expires_at(self) -> float:
        """Wall-clock seconds when the lease runs out (unless renewed before)."""
        return self.deadline

    def expired(self) -> bool:
        """Whether the lease's deadline has passed."""
        return time.time() >= self.deadline

    def remaining_s(self) -> float:
        """Seconds until the lease runs out."""
        return self.deadline - time.time()

    def begin(self) -> None:
        """A completion request of the session starts."""
        self.busy += 1
        self.active_at = time.monotonic()

    def end(self) -> None:
        """A completion request of the session ended (each :meth:`begin` ends once)."""
        self.busy -= 1
        self.active_at = time.monotonic()

    def expiry_message(self) -> str:
        """What the agent is told when it uses the session after its lease ran out."""
        return (
            f"session {self.session_id!r} expired: no completion of it ran for "
            f"{self.ttl_s:.0f} s (the run's lease time, staleness.lease_ttl_s), so its lease "
            "ran out and its capacity went to other rollouts; its replies can no longer be "
            "trained on. Open a new session (POST /rl/sessions) and start the episode again "
            "(a session lives while its completions run and for the lease time after each)"
        )

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
            # A well-formed body the session's state cannot take yet: a conflict (409), as
            # the OpenAPI document says, not a malformed request.
            raise SessionConflict(None, "the session has no completions to reward yet")
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
                raise SessionConflict(
                    f"rewards.{unknown[0]}", "is not a completion of this session"
                )
            for conv in self.conversations:
                last = conv.completion_ids[-1]
                if last not in per:
                    raise SessionConflict(
                        f"rewards.{last}",
                        "missing: every conversation's last completion needs a reward",
                    )
                rewards.append(_number(per[last], f"rewards.{last}"))
        group = common_pb2.TrajectoryGroup(task_id=self.session_id, group_id=self.session_id)
        for conv, r in zip(self.conversations, rewards, strict=True):
            group.trajectories.append(conv.trajectory(r, self.session_id, self.session_id))
        return group


class SessionConflict(PreconditionError):
    """A well-formed reward body that does not fit the session's completions (a 409 naming
    the field: the OpenAPI document cannot say which completion ids a session has)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(where, f"must be a number, got {value!r}")
    out = float(value)
    if out != out or out in (float("inf"), float("-inf")):
        raise FieldError(where, f"must be finite, got {value!r}")
    return out


# Expired sessions remembered (so their late requests are told why, not "unknown").
_MAX_GONE = 4096


class SessionStore:
    """The open sessions, dropped when they end or expire."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        # session id -> why it ended (its lease expired), oldest first.
        self._gone: OrderedDict[str, str] = OrderedDict()

    def add(self, session: Session) -> None:
        """Opens a session."""
        self._sessions[session.session_id] = session

    def get(self, session_id: str) -> Session:
        """The open session; NOT_FOUND-style KeyError unknown, SessionGone when it expired."""
        session = self._sessions.get(session_id)
        if session is None:
            if session_id in self._gone:
                raise SessionGone(self._gone[session_id])
            raise KeyError(session_id)
        if session.expired():
            self.lose(session_id, session.expiry_message())
            raise SessionGone(self._gone[session_id])
        return session

    def lose(self, session_id: str, reason: str) -> None:
        """Ends a session whose lease is gone; its later requests get ``reason`` (409)."""
        self._sessions.pop(session_id, None)
        self._gone[session_id] = reason
        while len(self._gone) > _MAX_GONE:
            self._gone.popitem(last=False)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def pop(self, session_id: str) -> Session:
        """Ends a session (see :meth:`get` for the errors)."""
        session = self.get(session_id)
        del self._sessions[session_id]
        return session

    def __len__(self) -> int:
        return len(self._sessions)
