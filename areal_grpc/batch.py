"""Typed trajectories (``arealgrpc.v1.Trajectory``) to and from padded torch batches.

A batch is a dict with AReaL's keys, right-padded to the longest sequence S:

=================  =========  ======  =================================================
key                dtype      shape   content
=================  =========  ======  =================================================
input_ids          int64      [B, S]  prompt + generated tokens (pad: ``pad_token_id``)
attention_mask     bool       [B, S]  True on real tokens
loss_mask          bool       [B, S]  True on trained (generated) tokens
logprobs           float32    [B, S]  behaviour log-prob of token t at t (0 elsewhere)
versions           int64      [B, S]  policy version of token t (-1 prompt and padding)
rewards            float32    [B]     sequence reward
prompt_lengths     int64      [B]     leading prompt tokens
group_index        int64      [B]     position of the row's group (groups_to_batch only)
=================  =========  ======  =================================================

Every trajectory is validated first; errors name the field, e.g.
``groups[1].trajectories[0].logprobs[7]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from arealgrpc.v1 import common_pb2

from areal_grpc.errors import FieldError
from areal_grpc.trajectory import validate_group, validate_trajectory

__all__ = ["Batch", "batch_to_trajectories", "groups_to_batch", "trajectories_to_batch"]

Batch = dict[str, torch.Tensor]


def trajectories_to_batch(
    trajs: Sequence[common_pb2.Trajectory],
    *,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    where: str = "trajectories",
) -> Batch:
    """Validates ``trajs`` and pads them into one batch (see the module docstring)."""
    if not trajs:
        raise FieldError(where, "no trajectories")
    for i, traj in enumerate(trajs):
        validate_trajectory(traj, f"{where}[{i}]", vocab_size)
    b = len(trajs)
    s = max(len(t.token_ids) for t in trajs)
    input_ids = np.full((b, s), pad_token_id, dtype=np.int64)
    attention = np.zeros((b, s), dtype=bool)
    loss = np.zeros((b, s), dtype=bool)
    logprobs = np.zeros((b, s), dtype=np.float32)
    versions = np.full((b, s), -1, dtype=np.int64)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        input_ids[i, :n] = t.token_ids
        attention[i, :n] = True
        loss[i, :n] = t.loss_mask
        logprobs[i, :n] = t.logprobs
        versions[i, :n] = t.versions
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "loss_mask": torch.from_numpy(loss),
        "logprobs": torch.from_numpy(logprobs),
        "versions": torch.from_numpy(versions),
        "rewards": torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        "prompt_lengths": torch.tensor([t.prompt_length for t in trajs], dtype=torch.int64),
    }


def groups_to_batch(
    groups: Sequence[common_pb2.TrajectoryGroup],
    *,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
) -> Batch:
    """One batch of every group's trajectories in order, with ``group_index`` per row."""
    if not groups:
        raise FieldError("groups", "no groups")
    trajs: list[common_pb2.Trajectory] = []
    index: list[int] = []
    for g, group in enumerate(groups):
        validate_group(group, f"groups[{g}]", vocab_size)
        trajs.extend(group.trajectories)
        index.extend([g] * len(group.trajectories))
    batch = trajectories_to_batch(trajs, pad_token_id=pad_token_id, vocab_size=vocab_size)
    batch["group_index"] = torch.tensor(index, dtype=torch.int64)
    return batch


def batch_to_trajectories(
    batch: Batch,
    *,
    task_ids: Sequence[str] | None = None,
    group_ids: Sequence[str] | None = None,
) -> list[common_pb2.Trajectory]:
    """The inverse of :func:`trajectories_to_batch`: one trajectory per row, padding dropped."""
    attention = batch["attention_mask"].to(torch.bool)
    b = attention.shape[0]
    lengths = attention.sum(dim=1).tolist()
    prompt_lengths = batch.get("prompt_lengths")
    out: list[common_pb2.Trajectory] = []
    for i in range(b):
        n = int(lengths[i])
        loss_mask = batch["loss_mask"][i, :n].to(torch.bool)
        if prompt_lengths is not None:
            prompt_length = int(prompt_lengths[i])
        else:
            trained = torch.nonzero(loss_mask)
            prompt_length = int(trained[0]) if trained.numel() else n
        out.append(
            common_pb2.Trajectory(
                token_ids=batch["input_ids"][i, :n].tolist(),
                logprobs=batch["logprobs"][i, :n].tolist(),
                versions=batch["versions"][i, :n].tolist(),
                loss_mask=loss_mask.tolist(),
                reward=float(batch["rewards"][i]),
                prompt_length=prompt_length,
                task_id=task_ids[i] if task_ids is not None else "",
                group_id=group_ids[i] if group_ids is not None else "",
            )
        )
    return out
