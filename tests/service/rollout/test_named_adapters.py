"""Named LoRA adapters on one hf rollout server (``LoadAdapter``, ``RemoveAdapter``,
``GenerateRequest.adapter``), over real gRPC on loopback with the built-in micro model.

A request naming an adapter must generate exactly what a standalone peft model with that
adapter generates: the same greedy tokens, log-probs within ``LOGPROB_TOL``; alone, and batched
with rows of other adapters and of the run's own policy.
"""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest
import torch
from areal_clients.rollout import adapter_requests
from areal_servers.rollout.service import item_to_struct
from arealgrpc.v1 import common_pb2, rollout_pb2

from areal_grpc.config import LoraSettings
from areal_grpc.errors import field_violations, retry_delay_s
from areal_grpc.model import load_model
from tests.support.rollout import rollout_server

# float32 throughout: the server decodes with a KV cache (and in a mixed batch, each adapter's
# update on its own rows), the reference recomputes every position from scratch.
LOGPROB_TOL = 1e-4
NEW_TOKENS = 8
ATTN = ["q_proj", "v_proj"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 100, 7, 100, 7, 1], [77, 78, 79, 80, 81]]


@functools.cache
def peft_adapter(seed: int, rank: int, targets: tuple[str, ...]):
    """A standalone peft model on the server's base (micro, seed 0) with a random adapter that
    changes its outputs, and that adapter's tensors by peft's saved names."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False
    )
    model = get_peft_model(load_model("builtin:micro", seed=0), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)  # large enough to move the greedy tokens
    model.eval()
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return model, tensors


A = (1, 4, tuple(ATTN))
B = (2, 8, tuple(ALL_LINEAR))
C = (3, 4, tuple(ATTN))


@functools.cache
def base_model():
    return load_model("builtin:micro", seed=0).eval()


@functools.cache
def reference(which: tuple | None, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, each position recomputed from the whole sequence."""
    model = base_model() if which is None else peft_adapter(*which)[0]
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax())
            ids.append(tok)
            logprobs.append(float(lp[tok]))
    return ids[len(prompt) :], logprobs


def greedy() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


async def load(stub, name, which):
    _, tensors = peft_adapter(*which)
    rank = which[1]
    return await stub.LoadAdapter(adapter_requests(name, tensors, rank, 2.0 * rank))


async def generate(stub, prompt, adapter=""):
    out = await stub.Generate(
        rollout_pb2.GenerateRequest(input_ids=prompt, sampling=greedy(), adapter=adapter)
    )
    return out.completions[0]


def assert_matches(completion, which, prompt):
    tokens, logprobs = reference(which, tuple(prompt))
    assert list(completion.output_ids) == tokens
    assert max(abs(a - b) for a, b in zip(completion.output_logprobs, logprobs, strict=True)) < (
        LOGPROB_TOL
    )


async def wait_status(stub, predicate):
    while True:
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        if predicate(st):
            return st
        await asyncio.sleep(0.005)


async def test_each_request_generates_with_the_adapter_it_names_as_peft_does():
    torch.set_num_threads(1)
    async with rollout_server() as (stub, _):
        a = await load(stub, "a", A)
        b = await load(stub, "b", B)
        # micro has 2 decoder layers: 2 x 2 attention projections, 2 x 7 linear layers.
        assert (a.name, a.adapted_layers, a.replaced) == ("a", 4, False)
        assert (b.adapted_layers, b.adapter_bytes) == (
            14,
            sum(t.numel() * 4 for t in peft_adapter(*B)[1].values()),
        )
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        assert list(st.adapters) == ["a", "b"]
        prompt = PROMPTS[0]
        outs = {}
        for name, which in (("", None), ("a", A), ("b", B)):
            outs[name] = await generate(stub, prompt, name)
            assert_matches(outs[name], which, prompt)
        # The adapters change what is generated (else this test would prove nothing).
        assert len({tuple(c.output_ids) for c in outs.values()}) == 3
        streamed = [
            tok
            async for msg in stub.GenerateStream(
                rollout_pb2.GenerateStreamRequest(input_ids=prompt, sampling=greedy(), adapter="b")
            )
            for tok in msg.output_ids
        ]
        assert streamed == list(outs["b"].output_ids)


async def test_rows_of_different_adapters_in_one_batch_equal_each_alone():
    torch.set_num_threads(1)
    async with rollout_server() as (stub, _):
        await load(stub, "a", A)
        await load(stub, "b", B)
        which = {"": None, "a": A, "b": B}
        jobs = [(prompt, name) for prompt in PROMPTS for name in ("", "a", "b")]
        alone = [await generate(stub, prompt, name) for prompt, name in jobs]
        # Paused, every request waits in the queue; resumed, all are admitted in one round
        # and decode as rows of one batch: own-policy rows beside both adapters' rows, and
        # prompts of several lengths (left-padded).
        await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest())
        tasks = [asyncio.ensure_future(generate(stub, p, n)) for p, n in jobs]
        await wait_status(stub, lambda st: st.queued_requests == len(jobs))
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        batched = await asyncio.gather(*tasks)
    for (prompt, name), one, many in zip(jobs, alone, batched, strict=True):
        assert_matches(one, which[name], prompt)
        assert list(many.output_ids) == list(one.output_ids), (prompt, name)
        assert (
            max(abs(x - y) for x, y in zip(many.output_logprobs, one.output_logprobs, strict=True))
            < LOGPROB_TOL
        )


async def test_unknown_adapter_is_not_found_naming_the_field_and_the_server_serves_on():
    torch.set_num_threads(1)
    async with rollout_server() as (stub, _):
        await load(stub, "a", A)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, PROMPTS[0], "nope")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details().startswith("adapter: ") and "'nope'" in err.value.details()
        call = stub.GenerateStream(
            rollout_pb2.GenerateStreamRequest(input_ids=[5], sampling=greedy(), adapter="nope")
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [m async for m in call]
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RemoveAdapter(rollout_pb2.RemoveAdapterRequest(name="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details().startswith("name: ")
        assert_matches(await generate(stub, PROMPTS[0], "a"), A, PROMPTS[0])


async def test_removal_lets_running_requests_finish_and_a_reload_replaces():
    torch.set_num_threads(1)
    async with rollout_server() as (stub, _):
        await load(stub, "a", A)
        await load(stub, "b", B)
        prompt = PROMPTS[1]
        # A request naming "a" is queued (paused) when "a" is removed: it still runs on "a".
        await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest())
        pending = asyncio.ensure_future(generate(stub, prompt, "a"))
        await wait_status(stub, lambda st: st.queued_requests == 1)
        removed = await stub.RemoveAdapter(rollout_pb2.RemoveAdapterRequest(name="a"))
        assert removed.adapter_bytes > 0  # b's, and a's until its last request ends
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        assert list(st.adapters) == ["b"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, prompt, "a")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        assert_matches(await pending, A, prompt)
        # The server serves on: b and the own policy as before, and "a" loads again, here
        # with other tensors; loading "b" again replaces it.
        assert_matches(await generate(stub, prompt, "b"), B, prompt)
        assert_matches(await generate(stub, prompt), None, prompt)
        assert not (await load(stub, "a", C)).replaced
        assert_matches(await generate(stub, prompt, "a"), C, prompt)
        assert (await load(stub, "b", A)).replaced
        assert_matches(await generate(stub, prompt, "b"), A, prompt)
        removed = await stub.RemoveAdapter(rollout_pb2.RemoveAdapterRequest(name="b"))
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        assert list(st.adapters) == ["a"]
        assert removed.adapter_bytes == sum(t.numel() * 4 for t in peft_adapter(*C)[1].values())


async def test_an_adapter_that_does_not_fit_the_model_is_invalid_argument_naming_the_field():
    torch.set_num_threads(1)
    _, tensors = peft_adapter(*A)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wrong_shape = dict(tensors)
    wrong_shape[key] = torch.zeros(4, 5)
    no_layer = {k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()}
    only_a = {k: v for k, v in tensors.items() if "q_proj.lora_B" not in k}
    cases = [
        (adapter_requests("a", wrong_shape, 4, 8.0), f'tensor["{key}"].shape'),
        (
            adapter_requests("a", no_layer, 4, 8.0),
            f'tensor["{key.replace("layers.0.", "layers.9.")}"]',
        ),
        (adapter_requests("a", only_a, 4, 8.0), f'tensor["{key.replace("lora_A", "lora_B")}"]'),
        (adapter_requests("a", tensors, 8, 8.0), f'tensor["{key}"].shape'),
        (adapter_requests("a", tensors, 0, 8.0), "header.rank"),
        (adapter_requests("a", tensors, 4, 0.0), "header.alpha"),
        (adapter_requests("no spaces", tensors, 4, 8.0), "header.name"),
        (adapter_requests("__base__", tensors, 4, 8.0), "header.name"),
        (list(adapter_requests("a", tensors, 4, 8.0))[1:], "header"),
    ]
    async with rollout_server() as (stub, _):
        for requests, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LoadAdapter(iter(requests))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert [f for f, _ in field_violations(err.value)] == [field]
        # Nothing was half-loaded, and the server serves on.
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        assert list(st.adapters) == []
        await load(stub, "a", A)
        assert_matches(await generate(stub, PROMPTS[0], "a"), A, PROMPTS[0])


async def test_adapter_caps_are_resource_exhausted_with_a_retry_delay():
    torch.set_num_threads(1)
    a_bytes = sum(t.numel() * 4 for t in peft_adapter(*A)[1].values())
    b_bytes = sum(t.numel() * 4 for t in peft_adapter(*B)[1].values())
    async with rollout_server(max_adapters=1) as (stub, _):
        await load(stub, "a", A)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await load(stub, "b", B)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert retry_delay_s(err.value) is not None
        assert "rollout.max_adapters" in err.value.details()
        # Replacing the one held is not one more; after a removal there is room again.
        assert (await load(stub, "a", C)).replaced
        await stub.RemoveAdapter(rollout_pb2.RemoveAdapterRequest(name="a"))
        await load(stub, "b", B)
        assert_matches(await generate(stub, PROMPTS[0], "b"), B, PROMPTS[0])
    # Room for b alone, not for a beside it; and an adapter over the whole budget is refused
    # while it streams in, before it is allocated.
    mib = (b_bytes + a_bytes // 2) / 2**20
    async with rollout_server(max_adapter_mib=mib) as (stub, _):
        await load(stub, "b", B)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await load(stub, "a", A)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rollout.max_adapter_mib" in err.value.details()
    async with rollout_server(max_adapter_mib=(b_bytes // 2) / 2**20) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await load(stub, "b", B)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await load(stub, "a", A)
        st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        assert list(st.adapters) == ["a"]


async def test_in_a_lora_run_own_rows_compute_the_runs_adapter_and_named_rows_theirs():
    """The run's own policy is its current LoRA adapter; a named adapter replaces it for its
    rows (it is an adapter of the base model, not of the run's adapter)."""
    torch.set_num_threads(1)
    lora = LoraSettings(rank=A[1], alpha=2.0 * A[1], target_modules=list(ATTN))
    async with rollout_server(lora=lora) as (stub, servicer):
        engine = servicer.engine
        # The run's version 1 is adapter A (peft names it "default" in the served model).
        update = {
            name: peft_adapter(*A)[1][name.replace(".default.", ".")]
            for name in engine.model.state_dict()
            if ".lora_" in name
        }
        await engine.load_weights(update, 1)
        await load(stub, "b", B)
        jobs = [(prompt, name) for prompt in PROMPTS for name in ("", "b")]
        await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest())
        tasks = [asyncio.ensure_future(generate(stub, p, n)) for p, n in jobs]
        await wait_status(stub, lambda st: st.queued_requests == len(jobs))
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        batched = await asyncio.gather(*tasks)
        for (prompt, name), got in zip(jobs, batched, strict=True):
            assert_matches(got, A if name == "" else B, prompt)
            assert set(got.output_versions) == {1}
        # With the named adapter gone, the run's rows decode as before.
        await stub.RemoveAdapter(rollout_pb2.RemoveAdapterRequest(name="b"))
        assert_matches(await generate(stub, PROMPTS[0]), A, PROMPTS[0])


async def test_loading_and_removing_adapters_while_requests_decode_leaves_their_tokens_alone():
    """The first adapter switches every later forward pass to per-row adapters, and the last
    one's removal back: requests decoding meanwhile get the tokens they get alone."""
    torch.set_num_threads(1)
    async with rollout_server() as (stub, _):
        sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)

        async def run(prompt):
            reply = await stub.Generate(
                rollout_pb2.GenerateRequest(input_ids=prompt, sampling=sampling)
            )
            return list(reply.completions[0].output_ids)

        alone = [await run(p) for p in PROMPTS]
        tasks = [asyncio.ensure_future(run(p)) for p in PROMPTS]
        await wait_status(stub, lambda st: st.running_requests == len(PROMPTS))
        await load(stub, "a", A)
        await stub.RemoveAdapter(rollout_pb2.RemoveAdapterRequest(name="a"))
        assert await asyncio.gather(*tasks) == alone


async def test_an_episode_task_naming_an_adapter_generates_every_sample_with_it():
    torch.set_num_threads(1)
    item = {"prompt": "abc=", "answer": "a"}

    def task(task_id: str, adapter: str) -> rollout_pb2.RunEpisodesRequest:
        return rollout_pb2.RunEpisodesRequest(
            task=rollout_pb2.EpisodeTask(
                task_id=task_id,
                data=item_to_struct(item),
                group_size=2,
                sampling=greedy(),
                adapter=adapter,
            )
        )

    async with rollout_server() as (stub, _):
        await load(stub, "a", A)
        requests = [task("own", ""), task("a", "a"), task("nope", "nope")]
        results = {r.task_id: r async for r in stub.RunEpisodes(iter(requests))}
    assert results["nope"].outcome == rollout_pb2.EPISODE_OUTCOME_FAILED
    assert results["nope"].reason.startswith("NOT_FOUND: task.adapter")
    completions = {}
    for task_id, which in (("own", None), ("a", A)):
        assert results[task_id].outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED
        for traj in results[task_id].group.trajectories:
            prompt = tuple(traj.token_ids[: traj.prompt_length])
            completion = list(traj.token_ids[traj.prompt_length :])
            assert completion == reference(which, prompt)[0]
            completions[task_id] = completion
    assert completions["own"] != completions["a"]
