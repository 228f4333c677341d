"""Typed trajectories to padded batches and back, with validation naming the field."""

from __future__ import annotations

import math

import pytest
import torch
from arealgrpc.v1 import common_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_grpc.batch import batch_to_trajectories, groups_to_batch, trajectories_to_batch
from areal_grpc.errors import FieldError
from areal_grpc.trajectory import validate_trajectory


def make_traj(prompt: list[int], completion: list[int], reward: float = 1.0, version: int = 3):
    n_p, n_c = len(prompt), len(completion)
    return common_pb2.Trajectory(
        token_ids=prompt + completion,
        logprobs=[0.0] * n_p + [-0.5 - 0.1 * i for i in range(n_c)],
        versions=[-1] * n_p + [version] * n_c,
        loss_mask=[False] * n_p + [True] * n_c,
        reward=reward,
        prompt_length=n_p,
        task_id="t",
        group_id="g",
    )


def test_batch_has_areal_keys_dtypes_and_padding():
    a = make_traj([5, 6, 7], [8, 1], reward=1.0)
    b = make_traj([9], [10, 11, 12, 1], reward=-0.5, version=4)
    batch = trajectories_to_batch([a, b], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 1], [9, 10, 11, 12, 1]]
    assert batch["input_ids"].dtype == torch.int64
    assert batch["attention_mask"].tolist() == [[True] * 5, [True] * 5]
    assert batch["loss_mask"].tolist() == [
        [False, False, False, True, True],
        [False, True, True, True, True],
    ]
    assert batch["versions"].tolist() == [[-1, -1, -1, 3, 3], [-1, 4, 4, 4, 4]]
    assert batch["rewards"].tolist() == [1.0, -0.5]
    assert batch["prompt_lengths"].tolist() == [3, 1]
    short = trajectories_to_batch([make_traj([1, 2], [3]), a])
    assert short["attention_mask"][0].tolist() == [True, True, True, False, False]
    assert short["input_ids"][0, 3:].tolist() == [0, 0]
    assert short["versions"][0, 3:].tolist() == [-1, -1]
    assert short["logprobs"][0, 3:].tolist() == [0.0, 0.0]


def test_groups_to_batch_records_group_index():
    g0 = common_pb2.TrajectoryGroup(group_id="g", trajectories=[make_traj([1], [2])] * 3)
    g1 = common_pb2.TrajectoryGroup(group_id="g", trajectories=[make_traj([1], [2, 3])] * 2)
    batch = groups_to_batch([g0, g1])
    assert batch["group_index"].tolist() == [0, 0, 0, 1, 1]
    assert batch["input_ids"].shape == (5, 3)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda t: t.ClearField("token_ids"), "trajectory.token_ids"),
        (lambda t: t.logprobs.append(-1.0), "trajectory.logprobs"),
        (lambda t: t.versions.pop(), "trajectory.versions"),
        (lambda t: t.loss_mask.append(True), "trajectory.loss_mask"),
        (lambda t: t.token_ids.__setitem__(1, -4), "trajectory.token_ids[1]"),
        (lambda t: t.token_ids.__setitem__(2, 384), "trajectory.token_ids[2]"),
        (lambda t: t.logprobs.__setitem__(3, math.nan), "trajectory.logprobs[3]"),
        (lambda t: t.logprobs.__setitem__(3, math.inf), "trajectory.logprobs[3]"),
        (lambda t: t.logprobs.__setitem__(4, 0.5), "trajectory.logprobs[4]"),
        (lambda t: setattr(t, "reward", math.nan), "trajectory.reward"),
        (lambda t: setattr(t, "reward", -math.inf), "trajectory.reward"),
        (lambda t: setattr(t, "prompt_length", 9), "trajectory.prompt_length"),
        (lambda t: setattr(t, "prompt_length", -1), "trajectory.prompt_length"),
        (lambda t: t.loss_mask.__setitem__(0, True), "trajectory.loss_mask[0]"),
        (lambda t: t.versions.__setitem__(0, -2), "trajectory.versions[0]"),
        (lambda t: t.versions.__setitem__(4, -1), "trajectory.versions[4]"),
    ],
)
def test_validation_names_the_field(mutate, field):
    traj = make_traj([5, 6, 7], [8, 9])
    mutate(traj)
    with pytest.raises(FieldError) as err:
        validate_trajectory(traj, vocab_size=384)
    assert err.value.field == field


def test_batch_error_names_the_row():
    bad = make_traj([1], [2])
    bad.reward = math.nan
    with pytest.raises(FieldError) as err:
        trajectories_to_batch([make_traj([1], [2]), bad])
    assert err.value.field == "trajectories[1].reward"
    group = common_pb2.TrajectoryGroup(trajectories=[make_traj([1], [2]), bad])
    with pytest.raises(FieldError) as err:
        groups_to_batch([common_pb2.TrajectoryGroup(trajectories=[make_traj([1], [2])]), group])
    assert err.value.field == "groups[1].trajectories[1].reward"
    with pytest.raises(FieldError):
        groups_to_batch([common_pb2.TrajectoryGroup()])


token = st.integers(min_value=0, max_value=383)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(token, min_size=0, max_size=6),
            st.lists(token, min_size=1, max_size=6),
            st.floats(min_value=-10, max_value=10, width=32),
            st.integers(min_value=0, max_value=1000),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_batch_round_trip(rows):
    trajs = [make_traj(p, c, reward=r, version=v) for p, c, r, v in rows]
    back = batch_to_trajectories(
        trajectories_to_batch(trajs), task_ids=["t"] * len(trajs), group_ids=["g"] * len(trajs)
    )
    for want, got in zip(trajs, back, strict=True):
        assert list(got.token_ids) == list(want.token_ids)
        assert list(got.versions) == list(want.versions)
        assert list(got.loss_mask) == list(want.loss_mask)
        assert got.prompt_length == want.prompt_length
        assert got.reward == pytest.approx(want.reward)
        assert [round(x, 5) for x in got.logprobs] == [round(x, 5) for x in want.logprobs]
