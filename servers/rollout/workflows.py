"""Rollout workflows: turn one dataset item into one ``arealgrpc.v1.TrajectoryGroup``.

A workflow is named in config by short name (``"rlvr"``, ``"multi_turn"``) or import path
(``"package.module:Class"``); it is built from a parameter dict (``EpisodeTask
.workflow_params`` over the server defaults) and run once per task with an
:class:`EpisodeContext`. Generations go through :func:`generate_resumable`, so a pause for a
weight update interrupts them and they continue after resume from prompt + partial output:
one trajectory can hold tokens of several policy versions.

Accept filters decide whether a finished group is kept (``"all"``, ``"nonuniform"``: drop
groups whose rewards are all equal, which carry no GRPO signal), also by import path.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from areal_servers.rollout.engine import (
    GenerationResult,
    InferenceEngine,
    SamplingConfig,
    generate_resumable,
)
from arealgrpc.v1 import common_pb2
from transformers import PreTrainedTokenizerBase

from areal_grpc import tracing
from areal_grpc.errors import FieldError
from areal_grpc.rewards import RewardFn, get_reward_fn, resolve
from areal_grpc.trajectory import validate_group

AcceptFn = Callable[[common_pb2.TrajectoryGroup], bool]


@dataclass
class EpisodeContext:
    """What a workflow needs to run one task."""

    engine: InferenceEngine
    tokenizer: PreTrainedTokenizerBase
    task_id: str
    group_size: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    is_eval: bool = False
    trace_context: common_pb2.TraceContext = field(default_factory=common_pb2.TraceContext)


class Workflow(Protocol):
    """Runs one episode: a dataset item in, a trajectory group (or None: rejected) out."""

    async def run_episode(
        self, ctx: EpisodeContext, item: Mapping[str, Any]
    ) -> common_pb2.TrajectoryGroup | None:
        """Produces the group of ``ctx.group_size`` samples for ``item``."""
        ...


# --- helpers ------------------------------------------------------------------------------

# Where prompt problems are reported in an EpisodeTask.
_PROMPT_FIELDS = ("task.data.input_ids", "task.sampling.max_new_tokens")


@dataclass(frozen=True)
class ChatSettings:
    """Whether prompts go through the model's chat template, and the system message."""

    # "auto": when the tokenizer has a template; "on": required; "off": raw text.
    mode: str = "auto"
    system_prompt: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ChatSettings:
        """From workflow params ``chat_template`` and ``system_prompt``."""
        mode = _param(params, "chat_template", str, "auto")
        if mode not in ("auto", "on", "off"):
            raise FieldError(
                "task.workflow_params.chat_template", f"must be auto, on or off, got {mode!r}"
            )
        system = params.get("system_prompt")
        if system is not None and not isinstance(system, str):
            raise FieldError("task.workflow_params.system_prompt", "must be a string")
        return cls(mode, system or None)

    def active(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        """True when prompts are chat-formatted for ``tokenizer``."""
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.mode == "on" and not has_template:
            raise FieldError(
                "task.workflow_params.chat_template", "the model's tokenizer has no chat template"
            )
        return self.mode != "off" and has_template

    def messages(self, item: Mapping[str, Any], text: str | None) -> list[dict[str, Any]]:
        """The conversation of an item: its ``messages``, or one user turn of ``text``."""
        if "messages" in item:
            raw = item["messages"]
            if not isinstance(raw, Sequence) or isinstance(raw, str):
                raise FieldError("task.data.messages", "must be a list of {role, content}")
            msgs = []
            for i, m in enumerate(raw):
                if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
                    raise FieldError(f"task.data.messages[{i}]", "needs role and content")
                msgs.append(dict(m))
        else:
            msgs = [{"role": "user", "content": text}]
        if self.system_prompt and msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs


def _prompt_text(item: Mapping[str, Any], prompt_key: str) -> str:
    value = item.get(prompt_key)
    if value is None and prompt_key == "prompt":
        # GSM8K's shape names the prompt "question".
        value = item.get("question")
    if not isinstance(value, str) or not value:
        raise FieldError(f"task.data.{prompt_key}", "missing or not a non-empty string")
    return value


def prompt_ids_of(
    ctx: EpisodeContext,
    item: Mapping[str, Any],
    prompt_key: str = "prompt",
    chat: ChatSettings | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and token ids of a dataset item (``input_ids`` wins when present).

    With the chat template active the text is the rendered conversation (system message,
    the item's ``messages`` or one user turn), ending in the assistant's generation prompt.
    """
    chat = chat or ChatSettings()
    if "input_ids" in item:
        raw = item["input_ids"]
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise FieldError("task.data.input_ids", "must be a list of token ids")
        ids: list[int] = []
        for i, t in enumerate(raw):
            if not isinstance(t, (int, float)) or int(t) != t:
                raise FieldError(f"task.data.input_ids[{i}]", f"not an integer: {t!r}")
            ids.append(int(t))
        # Checked before decoding: the tokenizer cannot decode ids outside its vocabulary.
        ctx.engine.check_prompt(ids, ctx.sampling, *_PROMPT_FIELDS)
        text = ctx.tokenizer.decode(ids, skip_special_tokens=True)
    elif chat.active(ctx.tokenizer):
        plain = None if "messages" in item else _prompt_text(item, prompt_key)
        text = ctx.tokenizer.apply_chat_template(
            chat.messages(item, plain), tokenize=False, add_generation_prompt=True
        )
        ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    else:
        text = _prompt_text(item, prompt_key)
        ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    ctx.engine.check_prompt(ids, ctx.sampling, *_PROMPT_FIELDS)
    return text, ids


_PLACEHOLDER = "\x00areal-reply\x00"


def chat_turn_ids(tokenizer: PreTrainedTokenizerBase, content: str, after_stop: bool) -> list[int]:
    """Token ids that close the assistant's turn, add a user turn and open the next reply.

    Rendered by the model's own template around a placeholder reply; ``after_stop``: the
    reply already ended with the end-of-turn token, which is then not repeated.
    """
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": _PLACEHOLDER},
        {"role": "user", "content": content},
    ]
    full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    tail = full[full.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
    eos = tokenizer.eos_token
    if after_stop and isinstance(eos, str) and eos and tail.startswith(eos):
        tail = tail[len(eos) :]
    return tokenizer.encode(tail, add_special_tokens=False)


async def call_reward(
    fn: RewardFn,
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    item: Mapping[str, Any],
) -> float:
    """Calls a reward function (awaiting it when it is async) inside a ``rollout.reward`` span."""
    with tracing.span("rollout.reward", attributes={tracing.TOKENS: len(completion_ids)}) as span:
        value = fn(prompt, completion, prompt_ids, completion_ids, item)
        if inspect.isawaitable(value):
            value = await value  # type: ignore[assignment]
        reward = float(value)  # type: ignore[arg-type]
        span.set_attribute("areal.reward", reward)
    return reward


def episode_sampling(ctx: EpisodeContext) -> SamplingConfig:
    """The sampling config of one sample: greedy for eval episodes, always one sample."""
    cfg = ctx.sampling.with_updates(n_samples=1)
    return cfg.with_updates(temperature=0.0) if ctx.is_eval else cfg


def make_trajectory(
    ctx: EpisodeContext,
    segments: Sequence[tuple[list[int], GenerationResult | None]],
    prompt_length: int,
    reward: float,
    finish_reason: int,
) -> common_pb2.Trajectory:
    """A trajectory from segments: (non-model tokens, None) or (_, a generation result)."""
    traj = common_pb2.Trajectory(
        reward=reward,
        prompt_length=prompt_length,
        task_id=ctx.task_id,
        group_id=ctx.task_id,
        finish_reason=finish_reason,  # type: ignore[arg-type]
    )
    traj.trace_context.CopyFrom(ctx.trace_context)
    for tokens, gen in segments:
        if gen is None:
            traj.token_ids.extend(tokens)
            traj.logprobs.extend([0.0] * len(tokens))
            traj.versions.extend([-1] * len(tokens))
            traj.loss_mask.extend([False] * len(tokens))
        else:
            traj.token_ids.extend(gen.output_ids)
            traj.logprobs.extend(gen.output_logprobs)
            traj.versions.extend(gen.output_versions)
            traj.loss_mask.extend([True] * len(gen.output_ids))
    return traj


def _param(params: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    value = params.get(name, default)
    if kind is int and isinstance(value, float) and value.is_integer():
        # Struct numbers arrive as floats.
        value = int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise FieldError(f"task.workflow_params.{name}", f"must be {kind.__name__}, got {value!r}")
    return value


# --- RLVR ---------------------------------------------------------------------------------


class RLVRWorkflow:
    """n samples of one prompt, generated concurrently, each scored by a reward function.

    Params: ``reward_fn`` (default ``"task"``: the reward of ``item["task"]``),
    ``prompt_key`` (default ``"prompt"``, falling back to ``"question"``), ``chat_template``
    (``auto`` / ``on`` / ``off``) and ``system_prompt``.
    """

    name: ClassVar[str] = "rlvr"

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.reward_name = _param(params, "reward_fn", str, "task")
        self.prompt_key = _param(params, "prompt_key", str, "prompt")
        self.chat = ChatSettings.from_params(params)
        try:
            self.reward_fn = get_reward_fn(self.reward_name)
        except ValueError as exc:
            raise FieldError("task.workflow_params.reward_fn", str(exc)) from exc

    async def run_episode(
        self, ctx: EpisodeContext, item: Mapping[str, Any]
    ) -> common_pb2.TrajectoryGroup | None:
        """Generates ``ctx.group_size`` samples and scores them."""
        text, ids = prompt_ids_of(ctx, item, self.prompt_key, self.chat)
        cfg = episode_sampling(ctx)

        async def one() -> common_pb2.Trajectory:
            gen = await generate_resumable(ctx.engine, ids, cfg)
            completion = ctx.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            reward = await call_reward(self.reward_fn, text, completion, ids, gen.output_ids, item)
            return make_trajectory(
                ctx, [(ids, None), ([], gen)], len(ids), reward, int(gen.finish_reason)
            )

        trajs = await asyncio.gather(*(one() for _ in range(ctx.group_size)))
        group = common_pb2.TrajectoryGroup(task_id=ctx.task_id, group_id=ctx.task_id)
        group.trajectories.extend(trajs)
        validate_group(group, "group", ctx.engine.vocab_size)
        return group


# --- multi-turn ---------------------------------------------------------------------------


class MultiTurnWorkflow:
    """Answer, and on a wrong answer get feedback and try again, up to ``max_turns`` turns.

    Each of the ``group_size`` samples is its own conversation. The loss mask covers the
    model's tokens only (prompt and feedback are masked out, version -1); the reward of a
    sample that is right at turn t (0-based) is ``reward * turn_discount ** t``.

    Params: ``reward_fn`` (default ``"task"``), ``max_turns`` (default 2), ``turn_discount``
    (default 0.9), ``feedback`` (default ``"\\nWrong, try again.\\n"``; with a chat template
    it is a user turn, default "Wrong, try again."), ``prompt_key``, ``chat_template``,
    ``system_prompt``.
    """

    name: ClassVar[str] = "multi_turn"

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.reward_name = _param(params, "reward_fn", str, "task")
        self.prompt_key = _param(params, "prompt_key", str, "prompt")
        self.max_turns = _param(params, "max_turns", int, 2)
        self.turn_discount = _param(params, "turn_discount", float, 0.9)
        self.feedback = _param(params, "feedback", str, "\nWrong, try again.\n")
        self.chat = ChatSettings.from_params(params)
        if self.max_turns < 1:
            raise FieldError(
                "task.workflow_params.max_turns", f"must be >= 1, got {self.max_turns}"
            )
        if not 0.0 <= self.turn_discount <= 1.0:
            raise FieldError(
                "task.workflow_params.turn_discount", f"must be in [0, 1], got {self.turn_discount}"
            )
        try:
            self.reward_fn = get_reward_fn(self.reward_name)
        except ValueError as exc:
            raise FieldError("task.workflow_params.reward_fn", str(exc)) from exc

    async def run_episode(
        self, ctx: EpisodeContext, item: Mapping[str, Any]
    ) -> common_pb2.TrajectoryGroup | None:
        """Runs ``ctx.group_size`` conversations concurrently."""
        text, ids = prompt_ids_of(ctx, item, self.prompt_key, self.chat)
        chat = self.chat.active(ctx.tokenizer)
        plain_feedback = ctx.tokenizer.encode(self.feedback, add_special_tokens=False)
        cfg = episode_sampling(ctx)
        engine = ctx.engine

        async def one() -> common_pb2.Trajectory:
            context = list(ids)
            segments: list[tuple[list[int], GenerationResult | None]] = [(list(ids), None)]
            reward = 0.0
            finish = 0
            for turn in range(self.max_turns):
                budget = cfg.max_new_tokens
                if engine.max_context:
                    budget = min(budget, engine.max_context - len(context))
                if budget < 1:
                    break
                gen = await generate_resumable(
                    engine, context, cfg.with_updates(max_new_tokens=budget)
                )
                segments.append(([], gen))
                context += gen.output_ids
                finish = int(gen.finish_reason)
                completion = ctx.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
                score = await call_reward(
                    self.reward_fn, text, completion, ids, gen.output_ids, item
                )
                reward = score * self.turn_discount**turn
                if score > 0 or turn == self.max_turns - 1:
                    break
                if chat:
                    # The reply's turn is closed and the feedback is a user turn, both as
                    # the model's own template writes them.
                    stopped = (
                        bool(gen.output_ids) and gen.output_ids[-1] == ctx.tokenizer.eos_token_id
                    )
                    feedback_ids = chat_turn_ids(ctx.tokenizer, self.feedback.strip(), stopped)
                else:
                    feedback_ids = plain_feedback
                # Feedback must leave room for at least one more model token.
                if engine.max_context and len(context) + len(feedback_ids) >= engine.max_context:
                    break
                segments.append((feedback_ids, None))
                context += feedback_ids
            return make_trajectory(ctx, segments, len(ids), reward, finish)

        trajs = await asyncio.gather(*(one() for _ in range(ctx.group_size)))
        group = common_pb2.TrajectoryGroup(task_id=ctx.task_id, group_id=ctx.task_id)
        group.trajectories.extend(trajs)
        validate_group(group, "group", ctx.engine.vocab_size)
        return group


# --- registries ---------------------------------------------------------------------------

WORKFLOWS: dict[str, Callable[[Mapping[str, Any]], Workflow]] = {
    RLVRWorkflow.name: RLVRWorkflow,
    MultiTurnWorkflow.name: MultiTurnWorkflow,
}


def accept_all(group: common_pb2.TrajectoryGroup) -> bool:
    """Keeps every group."""
    return True


def accept_nonuniform(group: common_pb2.TrajectoryGroup) -> bool:
    """Drops groups whose rewards are all equal (zero GRPO advantage: no learning signal)."""
    rewards = {t.reward for t in group.trajectories}
    return len(rewards) > 1


ACCEPT_FILTERS: dict[str, AcceptFn] = {"all": accept_all, "nonuniform": accept_nonuniform}


def build_workflow(name: str, params: Mapping[str, Any]) -> Workflow:
    """The workflow ``name`` (short name or import path) built from ``params``."""
    try:
        factory = resolve(name, WORKFLOWS, "workflow")
    except ValueError as exc:
        raise FieldError("task.workflow", str(exc)) from exc
    if not callable(factory):
        raise FieldError("task.workflow", f"{name!r} is not callable")
    workflow = factory(params)
    if not callable(getattr(workflow, "run_episode", None)):
        raise FieldError("task.workflow", f"{name!r} has no run_episode method")
    return workflow


def get_accept_filter(name: str) -> AcceptFn:
    """The accept filter ``name`` (short name or import path)."""
    try:
        fn = resolve(name, ACCEPT_FILTERS, "accept filter")
    except ValueError as exc:
        raise FieldError("task.workflow_params.accept", str(exc)) from exc
    return fn


async def maybe_await(value: bool | Awaitable[bool]) -> bool:
    """``value``, awaited when it is awaitable."""
    if inspect.isawaitable(value):
        return bool(await value)
    return bool(value)


__all__ = [
    "ACCEPT_FILTERS",
    "WORKFLOWS",
    "AcceptFn",
    "ChatSettings",
    "EpisodeContext",
    "MultiTurnWorkflow",
    "RLVRWorkflow",
    "Workflow",
    "accept_all",
    "accept_nonuniform",
    "build_workflow",
    "call_reward",
    "chat_turn_ids",
    "episode_sampling",
    "get_accept_filter",
    "make_trajectory",
    "maybe_await",
    "prompt_ids_of",
]
