"""Typed trajectories (``arealgrpc.v1.Trajectory``): validation and a builder for tests and
external producers. Errors name the field, e.g. ``groups[1].trajectories[0].logprobs[7]``.
Padded torch batches of them are :mod:`areal_grpc.batch`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from arealgrpc.v1 import common_pb2

from areal_grpc.errors import FieldError


def validate_trajectory(
    traj: common_pb2.Trajectory, where: str = "trajectory", vocab_size: int | None = None
) -> None:
    """Raises :class:`FieldError` unless ``traj`` is well formed."""
    n = len(traj.token_ids)
    if n == 0:
        raise FieldError(f"{where}.token_ids", "must not be empty")
    for name in ("logprobs", "versions", "loss_mask"):
        got = len(getattr(traj, name))
        if got != n:
            raise FieldError(f"{where}.{name}", f"has {got} entries, token_ids has {n}")
    ids = np.asarray(traj.token_ids, dtype=np.int64)
    bad = np.flatnonzero(ids < 0)
    if bad.size:
        raise FieldError(f"{where}.token_ids[{bad[0]}]", f"negative token id {ids[bad[0]]}")
    if vocab_size is not None:
        bad = np.flatnonzero(ids >= vocab_size)
        if bad.size:
            raise FieldError(
                f"{where}.token_ids[{bad[0]}]",
                f"token id {ids[bad[0]]} is outside the vocabulary (size {vocab_size})",
            )
    logprobs = np.asarray(traj.logprobs, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(logprobs))
    if bad.size:
        raise FieldError(f"{where}.logprobs[{bad[0]}]", f"not finite ({logprobs[bad[0]]})")
    # Log-probs are <= 0; a little slack absorbs float rounding of log_softmax.
    bad = np.flatnonzero(logprobs > 1e-4)
    if bad.size:
        raise FieldError(f"{where}.logprobs[{bad[0]}]", f"log-prob {logprobs[bad[0]]} > 0")
    if not math.isfinite(traj.reward):
        raise FieldError(f"{where}.reward", f"not finite ({traj.reward})")
    if not 0 <= traj.prompt_length <= n:
        raise FieldError(f"{where}.prompt_length", f"{traj.prompt_length} is not in [0, {n}]")
    mask = np.asarray(traj.loss_mask, dtype=bool)
    bad = np.flatnonzero(mask[: traj.prompt_length])
    if bad.size:
        raise FieldError(f"{where}.loss_mask[{bad[0]}]", "prompt tokens cannot be trained on")
    versions = np.asarray(traj.versions, dtype=np.int64)
    bad = np.flatnonzero(versions < -1)
    if bad.size:
        raise FieldError(f"{where}.versions[{bad[0]}]", f"version {versions[bad[0]]} < -1")
    bad = np.flatnonzero(mask & (versions < 0))
    if bad.size:
        raise FieldError(
            f"{where}.versions[{bad[0]}]", "a trained (generated) token needs a version >= 0"
        )


def validate_group(
    group: common_pb2.TrajectoryGroup, where: str = "group", vocab_size: int | None = None
) -> None:
    """Raises :class:`FieldError` unless every member is valid and ids agree."""
    if not group.trajectories:
        raise FieldError(f"{where}.trajectories", "a group needs at least one trajectory")
    for i, traj in enumerate(group.trajectories):
        here = f"{where}.trajectories[{i}]"
        validate_trajectory(traj, here, vocab_size)
        if group.group_id and traj.group_id and traj.group_id != group.group_id:
            raise FieldError(
                f"{here}.group_id", f"{traj.group_id!r} differs from the group's {group.group_id!r}"
            )


def make_group(
    task_id: str,
    rewards: Sequence[float],
    *,
    prompt_ids: Sequence[int] = (5, 6),
    completion_ids: Sequence[int] = (7, 8),
    versions: int | Sequence[int] = 0,
    logprobs: Sequence[float] | None = None,
) -> common_pb2.TrajectoryGroup:
    """A group of ``len(rewards)`` samples of one prompt, each ``prompt_ids + completion_ids``.

    ``versions`` and ``logprobs`` describe the completion tokens (one version for all, or one
    per token; log-probs default to -1.0 each); prompt tokens carry version -1 and no loss. For
    external producers and tests that need a valid group without a model.
    """
    n = len(completion_ids)
    token_versions = [versions] * n if isinstance(versions, int) else list(versions)
    token_logprobs = [-1.0] * n if logprobs is None else list(logprobs)
    group = common_pb2.TrajectoryGroup(task_id=task_id, group_id=task_id)
    for reward in rewards:
        group.trajectories.add(
            token_ids=[*prompt_ids, *completion_ids],
            logprobs=[0.0] * len(prompt_ids) + token_logprobs,
            versions=[-1] * len(prompt_ids) + token_versions,
            loss_mask=[False] * len(prompt_ids) + [True] * n,
            reward=float(reward),
            prompt_length=len(prompt_ids),
            task_id=task_id,
            group_id=task_id,
        )
    return group
