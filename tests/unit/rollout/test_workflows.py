"""Workflows on a real engine: RLVR groups, multi-turn masks and discounts, filters, pauses."""

from __future__ import annotations

import asyncio

import pytest
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.workflows import (
    EpisodeContext,
    MultiTurnWorkflow,
    RLVRWorkflow,
    accept_nonuniform,
    build_workflow,
    get_accept_filter,
)
from arealgrpc.v1 import common_pb2

from areal_grpc.batch import groups_to_batch
from areal_grpc.config import ModelConfig
from areal_grpc.errors import FieldError
from areal_grpc.model import load_model, load_tokenizer
from areal_grpc.tasks import task_dataset

TOK = load_tokenizer("builtin:micro")


@pytest.fixture
def engine():
    eng = HFEngine(ModelConfig(source="builtin:micro", seed=0))
    yield eng
    asyncio.run(eng.close())


def ctx(engine, task_id="t0", group_size=4, **sampling):
    return EpisodeContext(
        engine=engine,
        tokenizer=TOK,
        task_id=task_id,
        group_size=group_size,
        sampling=SamplingConfig(**{"max_new_tokens": 3, **sampling}),
        trace_context=common_pb2.TraceContext(
            traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"
        ),
    )


async def test_rlvr_group_has_prompt_masked_and_generated_tokens_trained(engine):
    item = task_dataset("first3", "train", seed=0)[0]
    group = await RLVRWorkflow({}).run_episode(ctx(engine), item)
    assert group.task_id == group.group_id == "t0" and len(group.trajectories) == 4
    prompt_ids = TOK.encode(item["prompt"], add_special_tokens=False)
    p = len(prompt_ids)
    for traj in group.trajectories:
        assert list(traj.token_ids[:p]) == prompt_ids and traj.prompt_length == p
        n = len(traj.token_ids) - p
        assert 1 <= n <= 3
        assert list(traj.loss_mask) == [False] * p + [True] * n
        assert list(traj.versions) == [-1] * p + [0] * n
        assert all(lp == 0.0 for lp in traj.logprobs[:p])
        assert all(lp < 0.0 for lp in traj.logprobs[p:])
        completion = TOK.decode(traj.token_ids[p:], skip_special_tokens=True)
        assert traj.reward == (1.0 if completion.startswith(item["answer"]) else 0.0)
        assert traj.trace_context.traceparent.startswith("00-aaaa")
    batch = groups_to_batch([group], vocab_size=384)
    assert batch["input_ids"].shape[0] == 4


async def test_rlvr_reward_fn_gets_prompt_completion_ids_and_item(engine):
    seen = []

    def reward(prompt, completion, prompt_ids, completion_ids, item):
        seen.append((prompt, completion, list(prompt_ids), list(completion_ids), item["answer"]))
        return len(completion_ids)

    import sys
    import types

    mod = types.ModuleType("rollout_test_rewards")
    mod.reward = reward
    sys.modules["rollout_test_rewards"] = mod
    wf = build_workflow("rlvr", {"reward_fn": "rollout_test_rewards:reward"})
    group = await wf.run_episode(ctx(engine, group_size=2), {"prompt": "ab=", "answer": "a"})
    assert len(seen) == 2
    # The samples' rewards may be computed in any order: match each call by its ids.
    calls = {
        tuple(cids): (prompt, completion, pids, cids, answer)
        for prompt, completion, pids, cids, answer in seen
    }
    for traj in group.trajectories:
        prompt, completion, pids, cids, answer = calls[tuple(traj.token_ids[traj.prompt_length :])]
        assert prompt == "ab=" and answer == "a"
        assert pids == list(traj.token_ids[: traj.prompt_length])
        assert cids == list(traj.token_ids[traj.prompt_length :])
        assert completion == TOK.decode(cids, skip_special_tokens=True)
        assert traj.reward == len(cids)


async def test_eval_episodes_decode_greedily(engine):
    c = ctx(engine, group_size=3, max_new_tokens=5, ignore_eos=True)
    c.is_eval = True
    group = await RLVRWorkflow({}).run_episode(
        c, {"prompt": "xyz=", "answer": "x", "task": "first3"}
    )
    outs = {tuple(t.token_ids) for t in group.trajectories}
    assert len(outs) == 1


async def test_multi_turn_masks_feedback_and_discounts_reward(engine):
    """A reward that is right only on turn 2: the trajectory holds turn 1, feedback (masked,
    version -1), turn 2; its reward is discounted once."""
    calls = {"n": 0}

    import sys
    import types

    def second_time_lucky(prompt, completion, prompt_ids, completion_ids, item):
        calls["n"] += 1
        return 1.0 if calls["n"] == 2 else 0.0

    mod = types.ModuleType("rollout_test_multiturn")
    mod.fn = second_time_lucky
    sys.modules["rollout_test_multiturn"] = mod
    wf = MultiTurnWorkflow(
        {
            "reward_fn": "rollout_test_multiturn:fn",
            "max_turns": 3,
            "turn_discount": 0.5,
            "feedback": "no!",
        }
    )
    group = await wf.run_episode(
        ctx(engine, group_size=1, max_new_tokens=4, ignore_eos=True),
        {"prompt": "q=", "answer": "z"},
    )
    traj = group.trajectories[0]
    fb = TOK.encode("no!", add_special_tokens=False)
    p = traj.prompt_length
    mask = list(traj.loss_mask)
    assert mask == [False] * p + [True] * 4 + [False] * len(fb) + [True] * 4
    assert list(traj.token_ids[p + 4 : p + 4 + len(fb)]) == fb
    assert list(traj.versions[p + 4 : p + 4 + len(fb)]) == [-1] * len(fb)
    assert traj.reward == pytest.approx(0.5)
    assert calls["n"] == 2


async def test_multi_turn_stops_after_max_turns_with_zero_reward(engine):
    wf = MultiTurnWorkflow({"reward_fn": "exact_match", "max_turns": 2})
    group = await wf.run_episode(
        ctx(engine, group_size=2, max_new_tokens=2, ignore_eos=True),
        {"prompt": "q=", "answer": "impossible answer"},
    )
    for traj in group.trajectories:
        assert sum(traj.loss_mask) == 4 and traj.reward == 0.0


async def test_trajectories_mix_versions_across_a_pause(engine):
    """Pause during an episode, load version 1, resume: the group completes, each sample holds
    version-0 then version-1 tokens, none lost (every sample has its full budget)."""
    wf = RLVRWorkflow({"reward_fn": "first_char"})
    task = asyncio.create_task(
        wf.run_episode(
            ctx(engine, group_size=4, max_new_tokens=150, ignore_eos=True),
            {"prompt": "abc=", "answer": "a"},
        )
    )
    while engine.status().generated_tokens < 4 * 10:
        await asyncio.sleep(0.001)
    assert await engine.pause() == 4
    await engine.load_weights(load_model("builtin:micro", seed=7).state_dict(), version=1)
    await engine.resume()
    group = await task
    for traj in group.trajectories:
        gen_versions = list(traj.versions[traj.prompt_length :])
        assert len(gen_versions) == 150
        assert gen_versions == sorted(gen_versions) and {0, 1} == set(gen_versions)


def test_accept_filters_and_registry_errors():
    same = common_pb2.TrajectoryGroup(trajectories=[common_pb2.Trajectory(reward=1.0)] * 3)
    mixed = common_pb2.TrajectoryGroup(
        trajectories=[common_pb2.Trajectory(reward=1.0), common_pb2.Trajectory(reward=0.0)]
    )
    assert not accept_nonuniform(same) and accept_nonuniform(mixed)
    assert get_accept_filter("all")(same)
    assert get_accept_filter("areal_servers.rollout.workflows:accept_nonuniform")(mixed)
    with pytest.raises(FieldError) as info:
        build_workflow("nope", {})
    assert info.value.field == "task.workflow"
    with pytest.raises(FieldError) as info:
        build_workflow("rlvr", {"reward_fn": "nope"})
    assert info.value.field == "task.workflow_params.reward_fn"
    with pytest.raises(FieldError) as info:
        build_workflow("multi_turn", {"max_turns": 0})
    assert info.value.field == "task.workflow_params.max_turns"


async def test_bad_items_name_the_field(engine):
    wf = RLVRWorkflow({})
    with pytest.raises(FieldError) as info:
        await wf.run_episode(ctx(engine), {"answer": "a"})
    assert info.value.field == "task.data.prompt"
    with pytest.raises(FieldError) as info:
        await wf.run_episode(ctx(engine), {"input_ids": [5, 999]})
    assert info.value.field == "task.data.input_ids[1]"
