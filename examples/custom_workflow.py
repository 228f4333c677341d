"""A rollout workflow of your own, named in config by import path.

A workflow turns one dataset item into one group of ``ctx.group_size`` scored samples. This
one puts an instruction in front of every prompt (``"echo x="`` instead of ``"x="``) and
scores each sample with the run's reward (``rollout.reward``, sent to the workflow as the
``reward_fn`` parameter)::

    python -m areal_grpc.coordinator data.task=echo \
        rollout.workflow=examples.custom_workflow:InstructionWorkflow \
        rollout.workflow_params.instruction=repeat

The rollout servers build it once per episode from the parameters (``rollout.workflow_params``
under a request's own) and call :meth:`InstructionWorkflow.run_episode`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from areal_servers.rollout.engine import generate_resumable
from areal_servers.rollout.workflows import (
    EpisodeContext,
    call_reward,
    episode_sampling,
    make_trajectory,
)
from arealgrpc.v1 import common_pb2

from areal_grpc.errors import FieldError
from areal_grpc.rewards import get_reward_fn


class InstructionWorkflow:
    """n samples of ``"<instruction> <prompt>"``, each scored by the run's reward function.

    Params: ``instruction`` (default ``"echo"``) and ``reward_fn`` (the run's
    ``rollout.reward``; default ``"task"``, the reward of the item's task).
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.instruction = str(params.get("instruction", "echo"))
        # A bad parameter is a FieldError naming it: the server refuses to start with it.
        try:
            self.reward_fn = get_reward_fn(str(params.get("reward_fn", "task")))
        except ValueError as exc:
            raise FieldError("task.workflow_params.reward_fn", str(exc)) from exc

    async def run_episode(
        self, ctx: EpisodeContext, item: Mapping[str, Any]
    ) -> common_pb2.TrajectoryGroup | None:
        """Generates and scores ``ctx.group_size`` samples of the item's prompt; returning
        None instead would reject the item (nothing is trained on it)."""
        prompt = f"{self.instruction} {item['prompt']}"
        prompt_ids = ctx.tokenizer.encode(prompt, add_special_tokens=False)
        # Greedy for eval episodes, one sample per call.
        sampling = episode_sampling(ctx)

        async def sample() -> common_pb2.Trajectory:
            # Survives a pause for a weight update: the tokens after it come from the new
            # policy, and each token records its version.
            gen = await generate_resumable(ctx.engine, prompt_ids, sampling)
            completion = ctx.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            reward = await call_reward(
                self.reward_fn, prompt, completion, prompt_ids, gen.output_ids, item
            )
            # Segments: the prompt (not trained on), then the model's tokens (trained on).
            return make_trajectory(
                ctx,
                [(prompt_ids, None), ([], gen)],
                prompt_length=len(prompt_ids),
                reward=reward,
                finish_reason=int(gen.finish_reason),
            )

        group = common_pb2.TrajectoryGroup(task_id=ctx.task_id, group_id=ctx.task_id)
        group.trajectories.extend(await asyncio.gather(*(sample() for _ in range(ctx.group_size))))
        return group
