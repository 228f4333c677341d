"""RolloutService on a real gRPC server on loopback with the built-in micro model."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from areal_servers.rollout.service import item_to_struct
from arealgrpc.v1 import common_pb2, rollout_pb2

from areal_grpc.batch import groups_to_batch
from areal_grpc.errors import field_violations
from areal_grpc.model import load_model
from areal_grpc.rewards import first_char_reward
from areal_grpc.tasks import task_dataset
from areal_grpc.trajectory import validate_group
from tests.support.rollout import TOK, rollout_server, task_msg


class MalformedWorkflow:
    """A custom workflow (named by import path) whose group breaks the trajectory rules."""

    def __init__(self, params):
        self.params = params

    async def run_episode(self, ctx, item):
        traj = common_pb2.Trajectory(
            token_ids=[5, 6],
            logprobs=[0.0],
            versions=[-1, 0],
            loss_mask=[False, True],
            prompt_length=1,
        )
        return common_pb2.TrajectoryGroup(task_id=ctx.task_id, trajectories=[traj])


class NothingWorkflow:
    """A custom workflow that returns no group."""

    def __init__(self, params):
        pass

    async def run_episode(self, ctx, item):
        return None


async def wait_status(stub, predicate):
    while True:
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        if predicate(st):
            return st
        await asyncio.sleep(0.005)


async def test_run_episodes_64_prompts_x4_out_of_order_each_task_once():
    items = task_dataset("first3", "train", seed=0)[:64]
    # Early tasks get longer budgets, so results come back in a different order.
    budgets = {f"t{i}": 2 + (63 - i) // 4 for i in range(64)}
    async with rollout_server() as (stub, _):
        call = stub.RunEpisodes(
            iter(
                [
                    task_msg(f"t{i}", item, max_new_tokens=budgets[f"t{i}"])
                    for i, item in enumerate(items)
                ]
            )
        )
        results = [r async for r in call]
    order = [r.task_id for r in results]
    assert sorted(order) == sorted(budgets) and len(order) == 64
    assert order != [f"t{i}" for i in range(64)]
    by_id = {f"t{i}": item for i, item in enumerate(items)}
    for r in results:
        assert r.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED, r.reason
        validate_group(r.group, vocab_size=384)
        assert r.group.task_id == r.group.group_id == r.task_id
        assert len(r.group.trajectories) == 4
        item = by_id[r.task_id]
        prompt = TOK.encode(item["prompt"], add_special_tokens=False)
        n = budgets[r.task_id]
        for traj in r.group.trajectories:
            assert list(traj.token_ids[: len(prompt)]) == prompt
            assert list(traj.loss_mask) == [False] * len(prompt) + [True] * n
            assert list(traj.versions) == [-1] * len(prompt) + [0] * n
            completion = TOK.decode(traj.token_ids[len(prompt) :], skip_special_tokens=True)
            assert traj.reward == first_char_reward("", completion, [], [], item)
            assert traj.trace_context.traceparent.startswith("00-111")
    batch = groups_to_batch([r.group for r in results], vocab_size=384)
    assert batch["input_ids"].shape[0] == 256


@pytest.mark.parametrize("return_immediately", [False, True])
async def test_pause_version_change_resume_mixes_versions_without_loss(return_immediately):
    """Either pause (waited, or returning at once as the fleet's does) ends the 12 running
    requests before the new weights serve; the episodes resume on them and lose nothing."""
    async with rollout_server() as (stub, servicer):
        queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            for i in range(3):
                yield task_msg(f"p{i}", {"prompt": f"ab{i}=", "answer": "a"}, max_new_tokens=200)
            await queue.get()  # keep the stream open until the test is done

        call = stub.RunEpisodes(requests())
        await wait_status(stub, lambda st: st.generated_tokens >= 12 * 8)
        paused = await stub.PauseGeneration(
            rollout_pb2.PauseGenerationRequest(return_immediately=return_immediately)
        )
        assert paused.interrupted_requests == 12
        assert (await wait_status(stub, lambda st: True)).paused
        await servicer.engine.load_weights(load_model("builtin:micro", seed=5).state_dict(), 1)
        resumed = await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        assert resumed.policy_version == 1
        results = [await call.read() for _ in range(3)]
        queue.put_nowait(None)
        assert await call.read() == grpc.aio.EOF
    assert sorted(r.task_id for r in results) == ["p0", "p1", "p2"]
    for r in results:
        assert r.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED and r.start_version == 0
        for traj in r.group.trajectories:
            gen = list(traj.versions[traj.prompt_length :])
            assert len(gen) == 200 and len(traj.token_ids) == traj.prompt_length + 200
            assert gen == sorted(gen) and set(gen) == {0, 1}


async def test_cancel_episode_frees_slots_and_other_tasks_finish():
    async with rollout_server() as (stub, _):
        call = stub.RunEpisodes()
        await call.write(task_msg("long", {"prompt": "abc=", "answer": "a"}, max_new_tokens=480))
        await wait_status(stub, lambda st: st.generated_tokens >= 4 * 3)
        await call.write(
            rollout_pb2.RunEpisodesRequest(cancel=rollout_pb2.CancelEpisode(task_id="long"))
        )
        first = await call.read()
        assert first.task_id == "long"
        assert first.outcome == rollout_pb2.EPISODE_OUTCOME_CANCELLED
        st = await wait_status(stub, lambda st: st.running_requests == 0)
        assert st.running_episodes == 0 and st.generated_tokens < 4 * 480
        await call.write(task_msg("short", {"prompt": "xyz=", "answer": "x"}))
        await call.done_writing()
        rest = []
        while (r := await call.read()) != grpc.aio.EOF:
            rest.append(r)
    assert [r.task_id for r in rest] == ["short"]
    assert rest[0].outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED


async def test_cancelling_the_run_episodes_call_cancels_its_generations():
    async with rollout_server() as (stub, _):
        call = stub.RunEpisodes()
        for i in range(3):
            await call.write(task_msg(f"t{i}", {"prompt": "abc="}, max_new_tokens=480))
        busy = await wait_status(stub, lambda st: st.generated_tokens >= 12 * 3)
        assert busy.running_episodes == 3
        call.cancel()
        st = await wait_status(
            stub, lambda st: st.running_requests == 0 and st.running_episodes == 0
        )
        assert st.generated_tokens < 12 * 480


async def test_bad_tasks_fail_alone_and_the_stream_and_server_go_on():
    async with rollout_server() as (stub, _):
        good = task_msg("good", {"prompt": "abc=", "answer": "a"})
        other_stream = stub.RunEpisodes(iter([task_msg("other", {"prompt": "q=", "answer": "q"})]))
        msgs = [
            task_msg("wf", {"prompt": "abc="}, workflow="no_such_workflow"),
            task_msg("noprompt", {"answer": "a"}),
            task_msg("vocab", {"input_ids": [5, 400]}),
            task_msg("neg", {"prompt": "abc="}, group_size=-1),
            task_msg(
                "reward", {"prompt": "abc="}, workflow_params=item_to_struct({"reward_fn": "nope"})
            ),
            rollout_pb2.RunEpisodesRequest(),
            task_msg("malformed", {"prompt": "abc="}, workflow=f"{__name__}:MalformedWorkflow"),
            task_msg("nothing", {"prompt": "abc="}, workflow=f"{__name__}:NothingWorkflow"),
            good,
        ]
        results = {r.task_id: r async for r in stub.RunEpisodes(iter(msgs))}
        others = [r async for r in other_stream]
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
    expected_fields = {
        "wf": "task.workflow",
        "noprompt": "task.data.prompt",
        "vocab": "task.data.input_ids[1]",
        "neg": "task.group_size",
        "reward": "task.workflow_params.reward_fn",
        "": "kind",
        "malformed": "group.trajectories[0].logprobs",
    }
    for task_id, fieldname in expected_fields.items():
        r = results[task_id]
        assert r.outcome == rollout_pb2.EPISODE_OUTCOME_FAILED
        assert r.reason.startswith(f"INVALID_ARGUMENT: {fieldname}:"), r.reason
    assert results["nothing"].outcome == rollout_pb2.EPISODE_OUTCOME_REJECTED
    assert results["good"].outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED
    assert [r.outcome for r in others] == [rollout_pb2.EPISODE_OUTCOME_ACCEPTED]
    assert st.running_episodes == 0


async def test_accept_filter_rejects_uniform_groups_and_multi_turn_runs():
    async with rollout_server() as (stub, _):
        msgs = [
            task_msg(
                "uniform",
                {"prompt": "abc=", "answer": "this never matches"},
                workflow_params=item_to_struct(
                    {"accept": "nonuniform", "reward_fn": "exact_match"}
                ),
            ),
            task_msg(
                "mt",
                {"prompt": "abc=", "answer": "this never matches"},
                workflow="multi_turn",
                group_size=2,
                workflow_params=item_to_struct({"reward_fn": "exact_match", "max_turns": 3}),
            ),
        ]
        results = {r.task_id: r async for r in stub.RunEpisodes(iter(msgs))}
    assert results["uniform"].outcome == rollout_pb2.EPISODE_OUTCOME_REJECTED
    assert "nonuniform" in results["uniform"].reason
    mt = results["mt"]
    assert mt.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED
    for traj in mt.group.trajectories:
        assert sum(traj.loss_mask) == 3 * 2 and traj.reward == 0.0


async def test_generate_and_generate_stream():
    async with rollout_server() as (stub, _):
        resp = await stub.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=[10, 11, 12],
                sampling=common_pb2.SamplingParams(n_samples=3, max_new_tokens=5, ignore_eos=True),
            )
        )
        assert len(resp.completions) == 3 and resp.policy_version == 0
        for c in resp.completions:
            assert len(c.output_ids) == len(c.output_logprobs) == 5
            assert list(c.output_versions) == [0] * 5
            assert c.finish_reason == common_pb2.FINISH_REASON_LENGTH
        greedy = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        whole = await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[7, 8], sampling=greedy))
        msgs = [
            m
            async for m in stub.GenerateStream(
                rollout_pb2.GenerateStreamRequest(input_ids=[7, 8], sampling=greedy)
            )
        ]
    streamed = [t for m in msgs for t in m.output_ids]
    assert streamed == list(whole.completions[0].output_ids)
    assert [len(m.output_ids) for m in msgs[:-1]] == [1] * 6
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    ("ids", "sampling", "fieldname"),
    [
        ([], {}, "input_ids"),
        ([5, 384], {}, "input_ids[1]"),
        ([5], {"n_samples": -1}, "sampling.n_samples"),
        ([5], {"max_new_tokens": -3}, "sampling.max_new_tokens"),
        ([5], {"max_new_tokens": 10_000}, "sampling.max_new_tokens"),
        ([5], {"top_p": 1.5}, "sampling.top_p"),
    ],
)
async def test_bad_generate_requests_are_invalid_argument_naming_the_field(
    ids, sampling, fieldname
):
    async with rollout_server() as (stub, _):
        for rpc, req in [
            (stub.Generate, rollout_pb2.GenerateRequest),
            (stub.GenerateStream, rollout_pb2.GenerateStreamRequest),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                call = rpc(req(input_ids=ids, sampling=common_pb2.SamplingParams(**sampling)))
                if rpc is stub.GenerateStream:
                    [m async for m in call]
                else:
                    await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [f for f, _ in field_violations(info.value)] == [fieldname]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [
                m
                async for m in stub.GenerateStream(
                    rollout_pb2.GenerateStreamRequest(
                        input_ids=[5], sampling=common_pb2.SamplingParams(n_samples=2)
                    )
                )
            ]
        assert [f for f, _ in field_violations(info.value)] == ["sampling.n_samples"]
        ok = await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[5]))
        assert ok.completions


async def test_expired_deadline_and_cancelled_stream_free_the_slot():
    """One decoding slot: each follow-up request completes only because the abandoned one gave
    its slot back (it would otherwise decode its 480 tokens first)."""
    async with rollout_server(max_running_requests=1) as (stub, _):
        long = common_pb2.SamplingParams(max_new_tokens=480, ignore_eos=True)
        short = rollout_pb2.GenerateRequest(
            input_ids=[5], sampling=common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(
                rollout_pb2.GenerateRequest(input_ids=[5, 6], sampling=long), timeout=0.2
            )
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len((await stub.Generate(short)).completions[0].output_ids) == 2
        st = await wait_status(stub, lambda st: st.running_requests == 0)
        assert st.generated_tokens < 480

        stream = stub.GenerateStream(
            rollout_pb2.GenerateStreamRequest(input_ids=[5, 6], sampling=long)
        )
        for _ in range(3):
            await stream.read()
        stream.cancel()
        assert len((await stub.Generate(short)).completions[0].output_ids) == 2
        st = await wait_status(stub, lambda st: st.running_requests == 0)
        assert st.generated_tokens < 2 * 480
        assert st.engine == rollout_pb2.ROLLOUT_ENGINE_HF
        assert st.model == "builtin:micro" and st.vocab_size == 384
