"""Evaluation: greedy accuracy on the eval split, spread over the rollout servers in rotation.

A component of the coordinator: it owns the eval items and the eval episode settings, and
calls only the rollout clients it is given, so it can be tested against one rollout server
without a run around it. A server lost or stalled mid-eval costs only its unscored prompts
(the result says how many were scored); it never ends or holds the run.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from areal_clients.rollout import RolloutClient, item_struct
from arealgrpc.v1 import common_pb2, rollout_pb2
from google.protobuf import struct_pb2

__all__ = ["EvalResult", "Evaluator"]

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """Mean reward over the scored prompts (NaN when none), how many, and per item kind."""

    accuracy: float = math.nan
    prompts: int = 0
    # Items that name their ``kind`` (the arithmetic set's difficulty levels), scored per kind:
    # the mean alone hides which levels the model learned.
    by_kind: dict[str, float] = field(default_factory=dict)


class Evaluator:
    """Greedy (temperature 0) episodes of every eval item, one per item, scored by reward."""

    def __init__(
        self,
        items: Sequence[Mapping[str, Any]],
        *,
        workflow: str,
        workflow_params: struct_pb2.Struct,
        sampling: common_pb2.SamplingParams,
        episode_timeout_s: float,
    ) -> None:
        self.items = list(items)
        self.workflow = workflow
        self.workflow_params = workflow_params
        self.sampling = common_pb2.SamplingParams()
        self.sampling.CopyFrom(sampling)
        self.sampling.temperature = 0.0
        self.episode_timeout_s = episode_timeout_s

    async def evaluate(self, servers: Sequence[RolloutClient], step: int) -> EvalResult:
        """Splits the items evenly over ``servers`` and scores what comes back."""
        if not servers or not self.items:
            return EvalResult()
        share = math.ceil(len(self.items) / len(servers))
        parts = await asyncio.gather(
            *(
                self._bounded(client, step, i * share, self.items[i * share : (i + 1) * share])
                for i, client in enumerate(servers)
            )
        )
        scores = {i: r for part in parts for i, r in part.items()}
        kinds: dict[str, list[float]] = {}
        for i, r in scores.items():
            kind = self.items[i].get("kind")
            if isinstance(kind, str):
                kinds.setdefault(kind, []).append(r)
        return EvalResult(
            accuracy=sum(scores.values()) / len(scores) if scores else math.nan,
            prompts=len(scores),
            by_kind={k: sum(v) / len(v) for k, v in sorted(kinds.items())},
        )

    async def _bounded(
        self, client: RolloutClient, step: int, offset: int, items: list[Mapping[str, Any]]
    ) -> dict[int, float]:
        # A stalled server would hold the eval (and the run) forever: its share gets one
        # episode deadline, and what it scored by then counts.
        scores: dict[int, float] = {}
        try:
            await asyncio.wait_for(
                self._run_on(client, step, offset, items, scores), self.episode_timeout_s
            )
        except TimeoutError:
            log.warning(
                "eval on %s did not finish within fault_tolerance.rollout.episode_timeout_s=%g: "
                "%d of %d prompts scored",
                client.address,
                self.episode_timeout_s,
                len(scores),
                len(items),
            )
        return scores

    async def _run_on(
        self,
        client: RolloutClient,
        step: int,
        offset: int,
        items: list[Mapping[str, Any]],
        scores: dict[int, float],
    ) -> None:
        stream = client.episodes()
        for i, item in enumerate(items):
            stream.submit(
                rollout_pb2.EpisodeTask(
                    task_id=f"eval-{step}-{offset + i}",
                    data=item_struct(item),
                    workflow=self.workflow,
                    workflow_params=self.workflow_params,
                    group_size=1,
                    sampling=self.sampling,
                    eval=True,
                )
            )
        stream.close()
        try:
            async for res in stream:
                index = int(res.task_id.rsplit("-", 1)[1])
                rewards = [t.reward for t in res.group.trajectories]
                accepted = res.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED
                scores[index] = sum(rewards) / len(rewards) if accepted and rewards else 0.0
        except grpc.aio.AioRpcError as exc:
            # A server lost mid-eval must not end the run; its unscored prompts are left out.
            log.warning("eval on %s broke off: %s", client.address, exc.code().name)
        finally:
            stream.abort()
