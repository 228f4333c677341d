"""What every engine with a server of its own (vLLM, SGLang) is checked against, shared by
their system tests: the hf engine's answer on the same model and seed, the trainer's initial
weights, and the senders and long episodes of the update tests."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest
import torch
from areal_clients.rollout import item_struct
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine
from arealgrpc.v1 import common_pb2, rollout_pb2, weight_sync_pb2

from areal_grpc import tensor_codec as tc
from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.errors import field_violations
from areal_grpc.model import load_model
from areal_grpc.ports import free_port
from areal_grpc.weight_transfer import GroupParams
from tests.support.weightsync import distributed_offer

RPC_TIMEOUT = 120.0
TINY = "builtin:tiny"

PROMPT = [5, 17, 42, 99, 7, 64, 128, 3, 250, 11]
# Tokens of the episode that lives through an update.
LONG = 150
# Log-probs of an engine's own fp32 CPU kernels (vLLM's, SGLang's torch-native attention)
# against transformers' eager fp32 forward: other summation orders over a forward whose
# log-probs are O(10), each op's rounding ~1e-7 relative, a few hundred ops deep.
LOGPROB_TOL = 2e-4


def hf_reference(
    prompt: list[int], params: SamplingConfig, state_dict: dict[str, torch.Tensor] | None = None
):
    """The hf engine's answer on the same model and seed (optionally other weights)."""

    async def run():
        engine = HFEngine(ModelConfig(source=TINY), RolloutConfig(device="cpu", dtype="float32"))
        try:
            if state_dict is not None:
                await engine.load_weights(state_dict, 1)
            return await engine.generate(prompt, params)
        finally:
            await engine.close()

    return asyncio.run(run())


def initial_weights() -> dict[str, torch.Tensor]:
    """The weights the server started from (the trainer's initial ones, from the seed), as a
    trainer sends them: the tied output head is the embedding, and is left out."""
    sd = load_model(TINY, seed=0).state_dict()
    return {k: v.clone() for k, v in sd.items() if k != "lm_head.weight"}


def expect_invalid(call, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert [f for f, _ in field_violations(info.value)] == [field], info.value.details()


def negotiate_gloo(server: Any, port: int, group: str) -> weight_sync_pb2.NegotiateResponse:
    """A DISTRIBUTED (gloo) plan for the group at ``port`` with this process as rank 0."""
    plan = server.sync.Negotiate(
        weight_sync_pb2.NegotiateRequest(
            offers=[
                distributed_offer(
                    backend=weight_sync_pb2.COLLECTIVE_BACKEND_GLOO,
                    master_port=port,
                    group_name=group,
                )
            ],
            sender_id="test",
        ),
        timeout=RPC_TIMEOUT,
    )
    assert plan.plan.method == weight_sync_pb2.TRANSFER_METHOD_DISTRIBUTED
    return plan


def join_as_sender(server: Any, tensors: dict[str, torch.Tensor], version: int):
    """Negotiates a DISTRIBUTED (gloo) plan as its rank 0; (the group's parameters, the
    update's request)."""
    port = free_port()
    group = f"weights-{port}"
    plan = negotiate_gloo(server, port, group)
    assert not plan.plan.distributed.joined
    request = weight_sync_pb2.UpdateFromDistributedRequest(
        plan_id=plan.plan_id,
        policy_version=version,
        tensors=[tc.tensor_spec(n, t) for n, t in tensors.items()],
    )
    return GroupParams("127.0.0.1", port, 2, 0, group, "gloo", timeout_s=60), request


# A sender that joins the group, broadcasts the first half of the tensors, and dies.
DYING_SENDER = """
import os, signal, sys, torch
from areal_grpc.weight_transfer import GroupParams, WeightGroup
port, name, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
shapes = [[int(d) for d in s.split("x")] for s in sys.argv[4:]]
group = WeightGroup(GroupParams("127.0.0.1", port, 2, 0, name, "gloo", timeout_s=60))
for shape in shapes[:count]:
    group.broadcast(torch.full(shape, 7.0))
os.kill(os.getpid(), signal.SIGKILL)
"""


def long_episode_across_an_update(
    server: Any, new: dict[str, torch.Tensor], seed: int | None = 5, running_s: float = 0.0
) -> tuple[rollout_pb2.PauseGenerationResponse, common_pb2.Trajectory]:
    """Runs one long sampled episode through RunEpisodes and, once some of its tokens are
    out, Pause, an update to ``new`` and Resume; the pause's answer and the trajectory.

    ``running_s``: for an engine that reports tokens only when a request ends, pause once
    its request has been running this long instead."""
    results: list[rollout_pb2.RunEpisodesResponse] = []

    def run() -> None:
        task = rollout_pb2.EpisodeTask(
            task_id="long",
            data=item_struct({"input_ids": PROMPT, "answer": "-"}),
            workflow="rlvr",
            workflow_params=item_struct({"reward_fn": "exact_match"}),
            group_size=1,
            sampling=common_pb2.SamplingParams(
                temperature=1.0, max_new_tokens=LONG, ignore_eos=True, seed=seed
            ),
        )

        def requests():
            yield rollout_pb2.RunEpisodesRequest(task=task)
            while not results:
                time.sleep(0.05)

        for res in server.rollout.RunEpisodes(requests(), timeout=RPC_TIMEOUT):
            results.append(res)
            break

    v = server.version()
    start = server.engine.status().generated_tokens
    worker = threading.Thread(target=run)
    worker.start()
    # Let some tokens come out under the old weights.
    deadline = time.monotonic() + 60
    if running_s:
        while not server.engine.status().running and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(running_s)
    while server.engine.status().generated_tokens < start + 20 and time.monotonic() < deadline:
        if running_s:
            break
        time.sleep(0.02)
    paused = server.rollout.PauseGeneration(
        rollout_pb2.PauseGenerationRequest(), timeout=RPC_TIMEOUT
    )
    assert server.push(new, v + 1).policy_version == v + 1
    server.rollout.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT)
    worker.join(timeout=120)
    assert not worker.is_alive()
    [res] = results
    assert res.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED, res.reason
    [traj] = res.group.trajectories
    return paused, traj


def check_versions_and_logprobs_across(
    traj: common_pb2.Trajectory, v: int, new: dict[str, torch.Tensor]
) -> None:
    """The tokens before the update carry version ``v`` and those after it ``v + 1``, and
    the log-probs after it are the new weights' (as the trainer recomputes them)."""
    gen = [i for i, m in enumerate(traj.loss_mask) if m]
    versions = [traj.versions[i] for i in gen]
    assert len(gen) == LONG
    # Old version first, then the new one: the episode went on after the update.
    assert versions[0] == v and versions[-1] == v + 1
    switch = versions.index(v + 1)
    assert versions == [v] * switch + [v + 1] * (LONG - switch)
    model = load_model(TINY, seed=0)
    model.load_state_dict(new, strict=False)  # the tied head is the embedding
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([list(traj.token_ids)])).logits[0], -1)
    want = [logp[i - 1, traj.token_ids[i]].item() for i in gen[switch:]]
    got = [traj.logprobs[i] for i in gen[switch:]]
    assert got == pytest.approx(want, abs=LOGPROB_TOL)
